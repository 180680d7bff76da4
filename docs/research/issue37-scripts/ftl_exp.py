import os, sys, time, glob, signal, subprocess, shutil
sys.path.insert(0, os.path.dirname(__file__))
from common import tree, tagged, kill_all
name, py = sys.argv[1], sys.argv[2]
launcher = sys.argv[3:]
logdir = f"/work/research37/logs/ftl_{name}"; shutil.rmtree(logdir, ignore_errors=True); os.makedirs(logdir)
import torch.distributed as dist
sport = int(os.environ.get("R37_STORE_PORT", "29640"))
host = dist.TCPStore("127.0.0.1", sport, None, is_master=True, wait_for_workers=False)  # a store outside every rank
env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", R37_STORE_PORT=str(sport))
L = subprocess.Popen([py, os.path.join(os.path.dirname(__file__), "ftl_replace.py"), *launcher,
                      os.path.join(os.path.dirname(__file__), "own_worker.py"), "env", logdir],
                     env=env, stdout=open(f"{logdir}/launcher.out", "w"), stderr=subprocess.STDOUT, start_new_session=True)
def lines():
    out = []
    for p in glob.glob(f"{logdir}/*.log"):
        for l in open(p):
            ts, rest = l.split(" ", 1); out.append((float(ts), os.path.basename(p), rest.strip()))
    return sorted(out)
try:
  t0 = time.time()
  while not any("STEP 25" in l[2] for l in lines()) and time.time() - t0 < 150:
    time.sleep(0.1)
  victim = [p for p in glob.glob(f"{logdir}/rank1.*.log")][0]
  pid = int(os.path.basename(victim).split(".")[1])
  tf = time.time(); os.kill(pid, signal.SIGKILL)
  print(f"KILL -9 rank 1 pid {pid} at {tf:.3f}")
  while time.time() - tf < 40 and L.poll() is None:
      time.sleep(0.2)
  print("launcher exit", L.poll())
  for ts, who, rest in lines():
      if ts >= tf - 0.1 and not (rest.startswith("STEP") and "STEP 50 " not in rest):
          print(f"  {who:24s} {ts - tf:+.3f} {rest[:120]}")
  for l in open(f"{logdir}/launcher.out"):
      if "ftl_replace" in l or "SIGTERM" in l or "closing signal" in l:
          ts = l.split()[1] if l.startswith("[ftl") else None
          print("  launcher:", l.strip()[:200] if not l.startswith("[ftl") else f"{float(l.split()[1]) - tf:+.3f} {l.strip()[:180]}")
finally:
  kill_all(tree([L.pid]) | set(tagged(logdir)))
