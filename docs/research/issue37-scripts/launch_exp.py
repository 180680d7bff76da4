"""Start a launcher with 4 workers (w_launch.py), kill -9 one worker, watch the survivors.
usage: launch_exp.py NAME VENV_PY -- LAUNCHER ARGS... (the worker script is appended)"""
import os, sys, time, glob, signal, subprocess, shutil
sys.path.insert(0, os.path.dirname(__file__))
from common import tree, tagged, kill_all
import psutil
name, py = sys.argv[1], sys.argv[2]
rest = sys.argv[sys.argv.index("--") + 1:]
launchers, cur = [], []
for a in rest:
    if a == "---":
        launchers.append(cur); cur = []
    else:
        cur.append(a)
launchers.append(cur)
victim = int(os.environ.get("VICTIM", "2")); watch = float(os.environ.get("WATCH", "20"))
logdir = f"/work/research37/logs/launch_{name}"; shutil.rmtree(logdir, ignore_errors=True); os.makedirs(logdir)
tag = f"r37tag_{name}_{os.getpid()}"
env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
Ls = []
for i, launcher in enumerate(launchers):
    cmd = launcher + [os.path.join(os.path.dirname(__file__), "w_launch.py"), tag, logdir]
    out = open(f"{logdir}/launcher{i}.out", "w")
    Ls.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    time.sleep(float(os.environ.get("STAGGER", "0")))
L = Ls[0]
def ready():
    return sum(1 for p in glob.glob(f"{logdir}/rank*.log") if "ready" in open(p).read())
t0 = time.time()
while ready() < int(os.environ.get("NW", "4")) and time.time() - t0 < 90:
    time.sleep(0.2)
time.sleep(1.5)
pids = {}
for p in glob.glob(f"{logdir}/rank*.log"):
    r, pid = os.path.basename(p).split(".")[:2]
    pids[int(r[4:])] = int(pid)
print("workers", pids, "ready after", round(time.time() - t0, 1))
tk = time.time()
os.kill(pids[victim], signal.SIGKILL)
print(f"KILL -9 rank {victim} pid {pids[victim]} at {tk:.3f}")
gone = {}
while time.time() - tk < watch:
    for r, pid in pids.items():
        if r not in gone and not (psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE):
            gone[r] = time.time() - tk
    for i, Li in enumerate(Ls):
        if Li.poll() is not None and f"launcher{i}" not in gone:
            gone[f"launcher{i}"] = time.time() - tk
    time.sleep(0.05)
print("gone after kill (s):", {k: round(v, 2) for k, v in gone.items()})
print("launcher rcs:", [Li.poll() for Li in Ls])
# new workers started by a restart?
for p in sorted(glob.glob(f"{logdir}/rank*.log")):
    for line in open(p):
        ts, rest = line.split(" ", 1)
        print(f"  {os.path.basename(p):22s} {float(ts) - tk:+7.2f} {rest.strip()}")
left = tree([Li.pid for Li in Ls]) | set(tagged(tag))
kill_all(left)
print("cleaned", sorted(left))
for i in range(len(Ls)):
    print(f"--- launcher{i} tail"); print("".join(l for l in open(f"{logdir}/launcher{i}.out").readlines()[-int(os.environ.get("TAIL", "12")):]))
