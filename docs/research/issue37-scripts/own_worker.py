"""Q6 prototype: same-step recovery without NVRx. A rank (or a spare waiting on a store key) trains in
generations; each generation is a process group on a fresh PrefixStore namespace of the launcher's store.
On a collective error, a rank drops its groups and waits for the launcher's plan for the next generation
(who replaces the lost rank); the replacement receives the state from a live peer, checked per tensor."""
import os, sys, time, json, datetime, gc, threading, hashlib, warnings
sys.path.insert(0, os.path.dirname(__file__))
from common import log
warnings.simplefilter("ignore")
role, logdir = sys.argv[1], sys.argv[2]
if role != "env":
    f = open(f"{logdir}/{role}.{os.getpid()}.log", "a")
import torch, torch.distributed as dist
torch.set_num_threads(1)
UNDER_LAUNCHER = role == "env"
if UNDER_LAUNCHER:  # started by (patched) ft_launcher: its agent's store outlives every worker
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    sport = int(os.environ["MASTER_PORT"]) if agent_store and not os.environ.get("R37_STORE_PORT") else int(os.environ["R37_STORE_PORT"])
    base = dist.TCPStore("127.0.0.1", sport, None, is_master=False,
                         timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
    store = dist.PrefixStore("r37", base)
    role = ("spare_for" if os.environ.get("RESIL_REPLACEMENT") else "rank") + os.environ["RANK"]
    f = open(f"{logdir}/{role}.{os.getpid()}.log", "a")
else:
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), None, is_master=False,
                          timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
WS, TOTAL = 4, int(os.environ.get("TOTAL", "150"))
PG_TO = datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "5")))
# the state a rank keeps: 'model' (a 2.6 MB buffer standing for model + Adam state), the step
STATE = {"step": 0, "model": torch.zeros(650_000)}
gc.collect(); gc.freeze()
if role.startswith("spare_for"):  # a replacement started by the launcher for this rank
    rank = int(role[9:]); gen = store.add("gen", 1); fresh = True
    store.set(f"gen{gen}/plan", json.dumps({"replaced": rank}))
    log(f, f"REPLACEMENT for rank {rank} joins gen {gen}")
elif role.startswith("spare"):
    log(f, f"spare waiting pid={os.getpid()}")
    store.set(f"spare_ready/{role}", str(os.getpid()))
    rank, gen = json.loads(store.get(f"assign/{role}"))  # blocks until the launcher assigns a rank
    log(f, f"ASSIGNED rank={rank} gen={gen}")
    fresh = True
else:
    rank, gen, fresh = int(role[4:]), 0, False
    torch.manual_seed(7); STATE["model"] = torch.randn(650_000)
def heartbeat():
    while True:
        store.set(f"hb/{rank}", f"{time.time():.3f}")
        time.sleep(0.1)
threading.Thread(target=heartbeat, daemon=True).start()
def checksum(t):
    return hashlib.sha1(t.numpy().tobytes()).hexdigest()
while True:
    t0 = time.time()
    members = json.loads(store.get(f"gen{gen}/plan")) if gen else {"replaced": None}
    dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{gen}", store), rank=rank, world_size=WS, timeout=PG_TO)
    # the iteration every rank of this generation continues from: the highest completed one (a replacement has 0)
    t = torch.tensor([STATE["step"]], dtype=torch.int64); dist.all_reduce(t, op=dist.ReduceOp.MAX)
    t1 = time.time()
    replaced = members["replaced"]
    if replaced is not None:  # the replacement gets the state from a live replica (lowest surviving rank)
        src = min(r for r in range(WS) if r != replaced)
        buf = STATE["model"]
        sums = [checksum(buf)] if rank == src else [None]
        dist.broadcast(buf, src=src)
        dist.broadcast_object_list(sums, src=src)
        ok = checksum(buf) == sums[0]
        STATE["step"] = int(t.item())
        t2 = time.time()
        if rank in (src, replaced):
            log(f, f"TRANSFER {'sent' if rank == src else 'received'} {buf.numel() * 4 / 1e6:.1f} MB in {t2 - t1:.3f}s checksum ok={ok}")
    else:
        STATE["step"] = int(t.item())
    log(f, f"GEN {gen} ready: rank={rank} step={STATE['step']} (process group {t1 - t0:.3f}s)")
    x = torch.ones(1)
    try:
        while STATE["step"] < TOTAL:
            dist.all_reduce(x); x.fill_(1)
            STATE["model"].add_(1e-3)
            STATE["step"] += 1
            if STATE["step"] % 25 == 0:
                log(f, f"STEP {STATE['step']} gen={gen}")
            time.sleep(0.05)
        dist.barrier()
        store.set("done", "1")
        log(f, f"DONE step={STATE['step']} model_sum={float(STATE['model'].double().sum()):.6f}")
        break
    except Exception as e:
        te = time.time()
        log(f, f"ERROR gen={gen}: {str(e)[:100]}")
        dist.destroy_process_group(); gc.collect()  # closes this rank's gloo pairs: releases its other peers
        log(f, f"released in {time.time() - te:.3f}s; waiting for the plan of gen {gen + 1}")
        gen += 1
