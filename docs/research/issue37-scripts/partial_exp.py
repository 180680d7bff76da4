import os, sys, time, signal, subprocess, random, datetime
sys.path.insert(0, os.path.dirname(__file__))
from common import tree, kill_all
import torch.distributed as dist
py, trials, numel = sys.argv[1], int(sys.argv[2]), sys.argv[3]
results = []
for t in range(trials):
    port = 30100 + t
    store = dist.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MASTER_PORT=str(port), NUMEL=numel)
    procs = [subprocess.Popen([py, os.path.join(os.path.dirname(__file__), "w_partial.py")], env=dict(env, RANK=str(r)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True) for r in range(4)]
    try:
        store.wait([f"ready/{r}" for r in range(4)], datetime.timedelta(seconds=120))
        time.sleep(0.5 + random.random())
        victim = 1
        os.kill(procs[victim].pid, signal.SIGKILL)
        store.wait([f"count/{r}" for r in range(4) if r != victim], datetime.timedelta(seconds=60))
        counts = {r: int(store.get(f"count/{r}")) for r in range(4) if r != victim}
        results.append(counts)
        print(f"trial {t}: completed all_reduces per survivor {counts} -> {'DISAGREE' if len(set(counts.values())) > 1 else 'agree'}", flush=True)
    finally:
        kill_all(tree([p.pid for p in procs]))
        del store
