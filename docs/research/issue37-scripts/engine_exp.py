"""Run w_engine.py on 4 plain processes with a driver-hosted store; print the per-step lines side by side."""
import os, sys, subprocess, shutil, time, datetime, glob
sys.path.insert(0, os.path.dirname(__file__))
from common import tree, kill_all
name, py = sys.argv[1], sys.argv[2]
logdir = f"/work/research37/logs/engine_{name}"; shutil.rmtree(logdir, ignore_errors=True); os.makedirs(logdir)
port = int(os.environ.get("PORT", "29800"))
import torch.distributed as dist
host = dist.TCPStore("127.0.0.1", port + 1, None, is_master=True, wait_for_workers=False)
env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1",
           MASTER_PORT=str(port), WORLD_SIZE="4", PYTHONPATH="/work/main")
procs = [subprocess.Popen([py, os.path.join(os.path.dirname(__file__), "w_engine.py"), logdir], env=dict(env, RANK=str(r)),
                          stdout=open(f"{logdir}/out{r}.txt", "w"), stderr=subprocess.STDOUT, start_new_session=True)
         for r in range(4)]
try:
    for p in procs:
        p.wait(timeout=float(os.environ.get("LIMIT", "300")))
finally:
    kill_all(tree([p.pid for p in procs]))
print("exit codes", [p.returncode for p in procs])
for r in range(4):
    for l in open(f"{logdir}/rank{r}.log"):
        print(f"rank{r} {l.split(' ', 1)[1].rstrip()}")
