import os, sys, time, signal, subprocess, shutil, datetime
sys.path.insert(0, os.path.dirname(__file__))
from common import tree, kill_all
how, py = sys.argv[1], sys.argv[2]
logdir = f"/work/research37/logs/teardown_{how}{os.environ.get('SUFFIX', '')}"; shutil.rmtree(logdir, ignore_errors=True); os.makedirs(logdir)
port = int(os.environ.get("PORT", "29950"))
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False)
env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MASTER_PORT=str(port), HOW=how, PYTHONPATH="/work/main")
procs = [subprocess.Popen([py, os.path.join(os.path.dirname(__file__), "w_teardown.py"), logdir], env=dict(env, RANK=str(r)),
                          stdout=open(f"{logdir}/out{r}.txt", "w"), stderr=subprocess.STDOUT, start_new_session=True) for r in range(4)]
try:
    if how != "bench":
        store.wait([f"ready/{r}" for r in range(4)], datetime.timedelta(seconds=120))
        os.kill(procs[3].pid, signal.SIGSTOP)
        t = time.time(); store.set("stopped", "1")
        print(f"rank 3 stopped at {t:.3f}")
        if os.environ.get("KILL_AFTER"):
            time.sleep(float(os.environ["KILL_AFTER"])); tk = time.time(); os.kill(procs[3].pid, signal.SIGKILL)
            print(f"rank 3 (stopped) SIGKILLed at +{tk - t:.3f}")
        time.sleep(float(os.environ.get("WATCH", "8")))
    else:
        for p in procs[:3]:
            p.wait(timeout=300)
finally:
    kill_all(tree([p.pid for p in procs]))
for r in range(4):
    try:
        for l in open(f"{logdir}/rank{r}.log"):
            ts, rest = l.split(" ", 1)
            print(f"rank{r} {rest.rstrip()}" if how == "bench" else f"rank{r} {float(ts) - t:+.3f} {rest.rstrip()}")
    except FileNotFoundError:
        pass
