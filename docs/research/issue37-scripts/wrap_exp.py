"""Start 4 ranks of w_wrap.py as plain processes (no launcher: nothing kills the survivors), inject a
fault into one active rank once all are stepping, report the timeline relative to the fault.
usage: wrap_exp.py NAME PYTHON FAULT(kill9|sigstop|exc|none) VICTIM"""
import os, sys, time, glob, signal, subprocess, shutil, re, datetime
sys.path.insert(0, os.path.dirname(__file__))
from common import tree, tagged, kill_all
import psutil
name, py, fault, victim = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
logdir = f"/work/research37/logs/wrap_{name}"; shutil.rmtree(logdir, ignore_errors=True); os.makedirs(logdir)
tag = f"r37tag_{name}_{os.getpid()}"
port = int(os.environ.get("PORT", "29700"))
env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="4", TORCH_CPP_LOG_LEVEL="ERROR")
env.pop("LOCAL_RANK", None)
host = None
if os.environ.get("STORE_HOST") == "driver":
    import torch.distributed as dist
    host = dist.TCPStore("127.0.0.1", port + 1, None, is_master=True, wait_for_workers=False)
    host2 = dist.TCPStore("127.0.0.1", port + 2, None, is_master=True, wait_for_workers=False)
procs = {}
for r in range(4):
    out = open(f"{logdir}/out{r}.txt", "w")
    procs[r] = subprocess.Popen([py, os.path.join(os.path.dirname(__file__), "w_wrap.py"), tag, logdir],
                                env=dict(env, RANK=str(r)), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
def lines():
    out = []
    for p in glob.glob(f"{logdir}/rank*.log"):
        for l in open(p):
            ts, rest = l.split(" ", 1)
            out.append((float(ts), os.path.basename(p).split(".")[0], rest.strip()))
    return sorted(out)
t0 = time.time()
while time.time() - t0 < 120:
    steps = [l for l in lines() if l[2].startswith("STEP 30 it=0")]
    if len(steps) >= 3:
        break
    time.sleep(0.1)
tf = time.time()
pid = procs[victim].pid
if fault == "kill9":
    os.kill(pid, signal.SIGKILL)
elif fault == "sigstop":
    os.kill(pid, signal.SIGSTOP)
elif fault == "exc":
    os.kill(pid, signal.SIGUSR1)
print(f"FAULT {fault} initial rank {victim} pid {pid} at {tf:.3f} (ranks stepping after {tf - t0:.1f}s)")
deadline = tf + float(os.environ.get("WATCH", "40"))
while time.time() < deadline and any(p.poll() is None for r, p in procs.items()):
    time.sleep(0.2)
for r, p in procs.items():
    st = "running" if p.poll() is None else p.returncode
    try:
        if p.poll() is None and psutil.Process(p.pid).status() == psutil.STATUS_STOPPED:
            st = "stopped"
    except psutil.NoSuchProcess:
        pass
    print(f"rank{r} pid {p.pid}: {st}")
for ts, who, rest in lines():
    if re.match(r"STEP \d+", rest) and not re.match(r"STEP (30|40|50|60|120) ", rest):
        continue
    if ts < tf - 0.5 and not rest.startswith(("ENTER", "PG", "INIT", "prebuilt", "imported")):
        continue
    print(f"  {who:6s} {ts - tf:+7.3f} {rest[:170]}")
left = tree([p.pid for p in procs.values()]) | set(tagged(tag))
kill_all(left)
print("cleaned", len(left), "processes")
