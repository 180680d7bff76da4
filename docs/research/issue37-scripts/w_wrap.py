"""Worker for the NVRx Wrapper experiments (world 4, active 3, one warm reserve), CPU/gloo.
Started by wrap_exp.py as a plain process (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)."""
import os, sys, time, signal, datetime, gc, warnings, threading
sys.path.insert(0, os.path.dirname(__file__))
from common import log
T0 = time.time()
tag, logdir = sys.argv[1], sys.argv[2]
init_rank = int(os.environ["RANK"]); WS = int(os.environ["WORLD_SIZE"])
ACTIVE = int(os.environ.get("ACTIVE", "3")); TOTAL = int(os.environ.get("TOTAL", "120"))
f = open(f"{logdir}/rank{init_rank}.{os.getpid()}.log", "a")
log(f, f"start initial_rank={init_rank} pid={os.getpid()}")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist
    from nvidia_resiliency_ext import inprocess
log(f, f"imported in {time.time() - T0:.2f}s nvrx={getattr(inprocess, '__file__', '?').split('site-packages')[0][-30:]}")
torch.set_num_threads(1)
S = lambda name, d: datetime.timedelta(seconds=float(os.environ.get(name, d)))
port = int(os.environ["MASTER_PORT"])
STORE_HOST = os.environ.get("STORE_HOST", "rank0")
if STORE_HOST == "rank0":
    store = dist.TCPStore("127.0.0.1", port + 1, WS, is_master=init_rank == 0,
                          timeout=datetime.timedelta(seconds=60), wait_for_workers=True)
else:  # hosted by the driver (outside every rank)
    store = dist.TCPStore("127.0.0.1", port + 1, None, is_master=False, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
log(f, "dist store up")

STATE = {"step": 0, "model": None, "obj_id": None, "attempts": []}  # lives across attempts
# A warm reserve builds its model ahead, before the Wrapper runs (no torch.distributed needed for a
# plain module); an active rank builds it too. The Tree activates the first ACTIVE initial ranks.
if os.environ.get("PREBUILD", "1") == "1":
    tb = time.time()
    torch.manual_seed(1234)
    STATE["model"] = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    STATE["opt"] = torch.optim.Adam(STATE["model"].parameters())
    log(f, f"prebuilt model (reserve={init_rank >= ACTIVE}) in {time.time() - tb:.3f}s")
STATE["obj_id"] = id(STATE["model"])

def _timed(cls, name):
    orig = getattr(cls, name)
    def wrapped(self, *a, **k):
        t = time.time()
        try:
            return orig(self, *a, **k)
        finally:
            log(f, f"NVRX {cls.__name__}.{name} {time.time() - t:.3f}s")
    setattr(cls, name, wrapped)
_timed(inprocess.store.StoreMixin, "iteration_barrier")
_timed(inprocess.rank_assignment.Tree, "__call__")
inject = {"exc": False}
signal.signal(signal.SIGUSR1, lambda *a: inject.__setitem__("exc", True))


class LogInit(inprocess.initialize.Initialize):
    def __call__(self, state):
        log(f, f"INIT it={state.iteration} mode={state.mode.name} rank={state.rank} active_rank={state.active_rank} "
               f"active_ws={state.active_world_size} initial={state.initial_rank}")
        return state


class Release(inprocess.abort.Abort):
    def __call__(self, state):
        t = time.time()
        log(f, f"ABORT start it={state.iteration} (monitor thread)")
        inprocess.abort.AbortTorchDistributed()(state)
        t1 = time.time()
        if dist.is_initialized():
            dist.destroy_process_group()
        t2 = time.time()
        gc.collect()
        log(f, f"ABORT it={state.iteration} took {time.time() - t:.3f}s (nvrx abort {t1 - t:.3f}s, destroy {t2 - t1:.3f}s, gc {time.time() - t2:.3f}s)")
        return state


class Fin(inprocess.finalize.Finalize):
    def __call__(self, state):
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        log(f, f"FINALIZE it={state.iteration}")
        return state


def train(call_wrapper: inprocess.CallWrapper = None):
    it = call_wrapper.iteration
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    STATE["attempts"].append(it)
    log(f, f"ENTER it={it} active_rank={rank} ws={ws} initial={init_rank} kept_model={id(STATE['model']) == STATE['obj_id']} "
           f"step={STATE['step']} attempts_seen={STATE['attempts']}")
    tp = time.time()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{it}", store), rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "30"))))
    t = torch.tensor([float(STATE["step"])])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # agree on the step to continue from
    STATE["step"] = int(t.item())
    log(f, f"PG it={it} ready in {time.time() - tp:.3f}s agreed step={STATE['step']}")
    x = torch.ones(1)
    try:
        loop(it, x)
    except BaseException as e:
        log(f, f"FN-EXC it={it} {type(e).__name__}: {str(e)[:120]}")
        raise
    dist.barrier()
    dist.destroy_process_group()
    log(f, f"DONE it={it}")
    return STATE["step"]


def loop(it, x):
    while STATE["step"] < TOTAL:
        if inject["exc"]:
            inject["exc"] = False
            log(f, "RAISE injected exception")
            raise RuntimeError(f"injected on initial rank {init_rank}")
        dist.all_reduce(x); x.fill_(1)
        STATE["step"] += 1
        if STATE["step"] % 10 == 0:
            log(f, f"STEP {STATE['step']} it={it}")
        time.sleep(0.05)


class OutsideStore(inprocess.store.TCPStore):
    TCP_STORE_HOST_RANK = -1  # no rank hosts it: the driver (a launcher's role) does


wrapper = inprocess.Wrapper(
    store_factory=OutsideStore if STORE_HOST == "driver" else inprocess.store.TCPStore,
    store_kwargs={"port": port + 2, "timeout": datetime.timedelta(seconds=60)},
    initialize=inprocess.Compose(LogInit(), inprocess.initialize.RetryController(max_iterations=5, min_world_size=ACTIVE)),
    abort=Release(), finalize=Fin(), health_check=None,
    rank_assignment=inprocess.rank_assignment.Tree(layers=[inprocess.rank_assignment.Layer(
        min_ranks=ACTIVE, max_ranks=ACTIVE, flag=inprocess.rank_assignment.LayerFlag.RESERVE)]),
    monitor_thread_interval=S("MTI", 0.1), monitor_process_interval=S("MPI", 0.1),
    progress_watchdog_interval=S("PWI", 0.1), heartbeat_interval=S("HBI", 0.2), heartbeat_timeout=S("HBT", 1.0),
    soft_timeout=S("SOFT", 2.0), hard_timeout=S("HARD", 4.0), barrier_timeout=S("BARRIER", 30),
    completion_timeout=S("COMPLETION", 30), last_call_wait=S("LCW", 0.1), termination_grace_time=S("GRACE", 0.5),
)
if os.environ.get("GCFREEZE") == "1":
    gc.collect(); gc.freeze()
    log(f, f"gc.freeze(): {gc.get_freeze_count()} objects frozen")
try:
    ret = wrapper(train)()
    log(f, f"EXIT returned {ret}")
except BaseException as e:
    log(f, f"EXIT raised {type(e).__name__}: {str(e)[:200]}")
    raise
