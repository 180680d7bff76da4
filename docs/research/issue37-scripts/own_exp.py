"""The launcher's role in the Q6 prototype: hosts the store, starts 4 ranks and one spare, watches its
children (a death is seen at once, as an agent's waitpid/pidfd sees it) and the heartbeats (a rank silent for
HB_TIMEOUT s is SIGKILLed: a hang becomes a death), publishes the next generation's plan, starts a new spare."""
import os, sys, time, json, signal, subprocess, shutil, datetime, glob
sys.path.insert(0, os.path.dirname(__file__))
from common import tree, kill_all
name, py, fault, victim = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
logdir = f"/work/research37/logs/own_{name}"; shutil.rmtree(logdir, ignore_errors=True); os.makedirs(logdir)
port = int(os.environ.get("PORT", "29990")); HB_TIMEOUT = float(os.environ.get("HB_TIMEOUT", "1.0"))
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False)
env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MASTER_PORT=str(port), PYTHONWARNINGS="ignore")
def start(role):
    return subprocess.Popen([py, os.path.join(os.path.dirname(__file__), os.environ.get("WORKER", "own_worker.py")), role, logdir], env=env,
                            stdout=open(f"{logdir}/out_{role}.txt", "w"), stderr=subprocess.STDOUT, start_new_session=True)
ranks = {r: start(f"rank{r}") for r in range(4)}
spares = {"spare0": start("spare0")}
all_procs = list(ranks.values()) + list(spares.values())
def lines():
    out = []
    for p in glob.glob(f"{logdir}/*.log"):
        for l in open(p):
            ts, rest = l.split(" ", 1); out.append((float(ts), os.path.basename(p).split(".")[0], rest.strip()))
    return sorted(out)
t0 = time.time()
while not any(os.environ.get("FAULT_AT", "STEP 25") in l[2] for l in lines()) and time.time() - t0 < 120:
    time.sleep(0.1)
store.wait(["spare_ready/spare0"], datetime.timedelta(seconds=60))
tf = time.time()
if fault != "none":
    os.kill(ranks[victim].pid, signal.SIGKILL if fault == "kill9" else signal.SIGSTOP)
print(f"FAULT {fault} rank {victim} at {tf:.3f}")
gen, nspare, handled = 0, 1, False
while time.time() - tf < float(os.environ.get("WATCH", "20")):
    dead = [r for r, p in ranks.items() if p.poll() is not None and p.returncode != 0]
    now = time.time()
    if store.check(["done"]) or nspare > 3:  # the run is finishing (or something is wrong): stop acting
        dead = []
    for r, p in ranks.items():  # hang detection: a heartbeat older than HB_TIMEOUT -> SIGKILL
        if store.check(["done"]) or nspare > 3:
            break
        if p.poll() is None and store.check([f"hb/{r}"]) and now - float(store.get(f"hb/{r}")) > HB_TIMEOUT:
            print(f"  launcher {now - tf:+.3f} rank {r} silent for {now - float(store.get(f'hb/{r}')):.2f}s: SIGKILL")
            os.kill(p.pid, signal.SIGCONT); os.kill(p.pid, signal.SIGKILL); p.wait(); dead.append(r)
    for r in dead:
        spare = f"spare{nspare - 1}"
        gen += 1
        store.set(f"gen{gen}/plan", json.dumps({"replaced": r}))
        store.set(f"assign/{spare}", json.dumps([r, gen]))
        print(f"  launcher {time.time() - tf:+.3f} rank {r} lost (exit {ranks[r].returncode}): {spare} takes rank {r} in gen {gen}")
        ranks[r] = spares.pop(spare)
        new = f"spare{nspare}"; spares[new] = start(new); all_procs.append(spares[new]); nspare += 1  # replenish
    if all(p.poll() is not None for p in ranks.values()):
        break
    if os.environ.get("DUMP_AFTER") and time.time() - tf > float(os.environ["DUMP_AFTER"]) and not globals().get("_dumped"):
        _dumped = True
        for p in list(ranks.values()):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGUSR2)
    time.sleep(0.02)
print("rank exit codes", {r: p.poll() for r, p in ranks.items()})
for ts, who, rest in lines():
    if ts >= tf - float(os.environ.get("SHOW_BEFORE", "0.1")) and not (rest.startswith("STEP") and not rest.startswith(("STEP 50 ", "STEP 150"))):
        print(f"  {who:7s} {ts - tf:+.3f} {rest[:140]}")
kill_all(tree([p.pid for p in all_procs]))
