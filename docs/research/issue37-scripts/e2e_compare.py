import sys, glob, re
ref = {l.split()[0]: l.split()[1:3] for l in open("/work/research37/logs/e2e_reference_losses.txt")}
logdir = sys.argv[1]
bad, seen = 0, {}
for p in glob.glob(f"{logdir}/*.log"):
    for l in open(p):
        m = re.search(r"ITER (\d+) (loss=\S+) (gnorm=\S+)", l)
        if m:
            it = m.group(1)
            seen.setdefault(it, set()).add(p.split("/")[-1].split(".")[0])
            if ref[it] != [m.group(2), m.group(3)]:
                bad += 1; print("MISMATCH", p, l.strip())
print(f"iterations logged: {len(seen)} (1..{max(map(int, seen))}); lines differing from the fault-free run: {bad}")
twice = {it: sorted(w) for it, w in seen.items() if len(w) > 4}
print("iterations logged by more than 4 processes (recomputed):", twice or "none")
