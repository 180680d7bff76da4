"""Worker for the launcher experiments: a gloo all_reduce every 0.1 s; reports what happens to it."""
import os, sys, time, signal, datetime
sys.path.insert(0, os.path.dirname(__file__))
from common import log
tag, logdir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"]); ws = int(os.environ["WORLD_SIZE"])
f = open(f"{logdir}/rank{rank}.{os.getpid()}.log", "a")
log(f, f"start rank={rank} pid={os.getpid()} ppid={os.getppid()} restart={os.environ.get('TORCHELASTIC_RESTART_COUNT')}")
def on(sig, frm):
    log(f, f"signal {signal.Signals(sig).name}"); f.flush(); os._exit(128 + sig)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, on)
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
log(f, "ready")
t = torch.ones(1)
i = 0
try:
    while True:
        dist.all_reduce(t); t.fill_(1); i += 1
        if i % 50 == 0:
            log(f, f"iter {i}")
        time.sleep(0.1)
except Exception as e:
    log(f, f"collective error {type(e).__name__}: {str(e)[:200]}")
    time.sleep(30)  # stay alive: does the launcher end us?
    log(f, "still alive after 30 s")
