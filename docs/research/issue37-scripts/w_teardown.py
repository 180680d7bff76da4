"""Q3 on gloo, 4 plain processes. Part A: rank 3 is SIGSTOPped by the driver while ranks 0-2 are blocked in an
all_reduce; after 1 s, rank 0's side thread releases its groups in one of several ways (HOW); each rank logs
when its main thread returns and why. Part B (HOW=bench): tear down and rebuild the world group (+ megatron-core's
groups with MCORE=1) on a fresh PrefixStore namespace, N times."""
import os, sys, time, datetime, threading, gc
sys.path.insert(0, os.path.dirname(__file__))
from common import log
logdir = sys.argv[1]
R = int(os.environ["RANK"]); HOW = os.environ["HOW"]; port = int(os.environ["MASTER_PORT"])
f = open(f"{logdir}/rank{R}.log", "a")
import warnings; warnings.simplefilter("ignore")
import torch, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
TO = datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "20")))
if HOW == "bench":
    mcore = os.environ.get("MCORE") == "1"
    if mcore:
        from megatron.core import parallel_state as ps
    if os.environ.get("FREEZE") == "1":
        gc.freeze()
    times = []
    for k in range(int(os.environ.get("N", "8"))):
        store.set(f"go{k}/{R}", "1"); store.wait([f"go{k}/{r}" for r in range(4)])
        t = time.perf_counter()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"ns{k}", store), rank=R, world_size=4, timeout=TO)
        if mcore:
            ps.initialize_model_parallel(tensor_model_parallel_size=int(os.environ.get("TP", "1")),
                                         pipeline_model_parallel_size=int(os.environ.get("PP", "1")))
        x = torch.ones(1); dist.all_reduce(x)
        t1 = time.perf_counter()
        if mcore:
            ps.destroy_model_parallel()
        dist.destroy_process_group(); gc.collect()
        t2 = time.perf_counter()
        times.append((t1 - t, t2 - t1))
        log(f, f"round {k}: build {1000 * (t1 - t):.1f} ms, teardown {1000 * (t2 - t1):.1f} ms")
    if R == 0:
        b = sorted(x[0] for x in times); d = sorted(x[1] for x in times)
        log(f, f"MEDIAN build {1000 * b[len(b) // 2]:.1f} ms, teardown {1000 * d[len(d) // 2]:.1f} ms "
               f"(mcore={mcore} groups={len(dist.distributed_c10d._world.pg_names) if dist.is_initialized() else 'n/a'})")
    sys.exit(0)
dist.init_process_group("gloo", store=dist.PrefixStore("ns0", store), rank=R, world_size=4, timeout=TO)
x = torch.ones(1); dist.all_reduce(x)
store.set(f"ready/{R}", str(os.getpid()))
if R == 3:
    time.sleep(3600)  # the driver stops this process
store.wait(["stopped"])
def release():
    time.sleep(1.0)
    t = time.time()
    pg = dist.group.WORLD
    if HOW == "destroy":
        dist.destroy_process_group(); gc.collect()
    elif HOW == "abort":
        pg.abort()
    elif HOW == "shutdown":
        pg.shutdown()
    elif HOW == "backend_abort":
        pg._get_backend(torch.device("cpu")).abort()
    elif HOW == "c10d_abort":
        dist.distributed_c10d._abort_process_group(pg)
    log(f, f"side thread: {HOW} returned after {time.time() - t:.3f}s")
if R == 0 and HOW != "none":
    threading.Thread(target=release, daemon=True).start()
t = time.time()
log(f, "main: entering all_reduce (rank 3 is stopped)")
try:
    y = torch.ones(1000); dist.all_reduce(y)
    log(f, f"main: all_reduce returned after {time.time() - t:.3f}s")
except Exception as e:
    log(f, f"main: all_reduce raised after {time.time() - t:.3f}s: {str(e)[:150]}")
time.sleep(2)
