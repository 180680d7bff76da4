"""Can a kill -9 inside an all_reduce leave survivors disagreeing on whether it completed? Each rank counts
completed all_reduces of a large tensor; after the victim is killed each survivor reports its count."""
import os, sys, time, datetime, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist
R = int(os.environ["RANK"]); N = int(os.environ.get("NUMEL", "4000000"))
store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), None, is_master=False, wait_for_workers=False)
dist.init_process_group("gloo", store=dist.PrefixStore("p", store), rank=R, world_size=4, timeout=datetime.timedelta(seconds=20))
x = torch.ones(N); done = 0
store.set(f"ready/{R}", "1")
try:
    while True:
        dist.all_reduce(x); done += 1
        x.fill_(1)
except Exception as e:
    store.set(f"count/{R}", str(done))
