"""End-to-end prototype of same-step recovery without NVRx, on the real engine (megatron-core GPTModel + DDP +
Adam through megatron_resil.training), DP=4 on gloo. A rank trains; on a collective error it drops its process
groups, waits for the launcher's plan (which rank was lost, which spare replaces it), rebuilds groups on a fresh
store namespace and its engine, copies its kept state in, and the ranks agree where to continue: the highest
completed iteration; every rank behind it (the replacement, or a survivor whose step did not complete) receives
model, optimizer, scheduler, RNG and progress from a rank that completed it, checked per tensor."""
import os, sys, time, json, hashlib, datetime, gc, warnings, threading
sys.path.insert(0, os.path.dirname(__file__))
from common import log
T0 = time.time()
role, logdir = sys.argv[1], sys.argv[2]
f = open(f"{logdir}/{role}.{os.getpid()}.log", "a")
warnings.simplefilter("ignore")
import faulthandler, signal
faulthandler.register(signal.SIGUSR2, file=open(f"{logdir}/{role}.{os.getpid()}.stacks", "w"), all_threads=True)
sys.path.insert(0, "/work/main")
WS, TOTAL = 4, int(os.environ.get("TOTAL", "30"))
from megatron_resil.arguments import parse_args
ARGV = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "2", "--mock-data", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
        "--train-iters", "100", "--seed", "1234", "--distributed-timeout-minutes", "1"]
os.environ["WORLD_SIZE"] = str(WS)
args = parse_args(ARGV)
from megatron_resil import patches
patches.install(args)
import torch, torch.distributed as dist
from megatron_resil import training, parallel, events, rerun
from megatron_resil.progress import TrainProgress
from megatron_resil.data import build_datasets
from megatron_resil.tokenizer import build_tokenizer
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), None, is_master=False,
                      timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
events.configure(None)
rerun.initialize(rerun.RerunConfig.from_args(args))
tok = build_tokenizer(args)
log(f, f"imports+args {time.time() - T0:.2f}s")
PREBUILT_DS = None
if role.startswith("spare"):
    # a warm spare does, before it has a rank, what needs none: the (rank-independent) dataset, without groups
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    PREBUILT_DS, _ = build_datasets(args, tok)
    dist.destroy_process_group()
    store.set(f"spare_ready/{role}", str(os.getpid()))
    gc.collect(); gc.freeze()
    rank, gen = json.loads(store.get(f"assign/{role}"))
    log(f, f"ASSIGNED rank={rank} gen={gen}")
else:
    rank, gen = int(role[4:]), 0
    gc.collect(); gc.freeze()  # after the imports, before anything that holds a process group
os.environ["RANK"] = str(rank)


def heartbeat():
    while True:
        store.set(f"hb/{rank}", f"{time.time():.3f}"); time.sleep(0.1)
threading.Thread(target=heartbeat, daemon=True).start()


def fmt(x):
    return float(x).hex()


def checksum(t):
    return hashlib.sha1(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def start(g):
    with parallel.attempt_store(dist.PrefixStore(f"gen{g}", store)):
        parallel.initialize(args)
    return training.build_engine(args, tok.vocab_size)


def model_tensors(model):
    return [(i, k, v) for i, chunk in enumerate(model) for k, v in chunk.state_dict().items() if torch.is_tensor(v)]


def opt_tensors(opt):
    sd = opt.state_dict()
    return [v for _, st in sorted(sd["state"].items()) for _, v in sorted(st.items()) if torch.is_tensor(v)]


engine, progress, train_ds, kept = None, None, None, None
while True:
    tg = time.time()
    plan = json.loads(store.get(f"gen{gen}/plan")) if gen else {"replaced": None}
    engine = start(gen)
    model, opt, sched = engine
    if gen:  # megatron-core's rerun state machine was left mid-step by the failure: every rank starts it afresh
        rerun.initialize(rerun.RerunConfig.from_args(args))
    t_engine = time.time() - tg
    if kept:  # a survivor: its kept state goes into the new objects
        for new, sd in zip(model, kept[0]):
            new.load_state_dict(sd)
        opt.load_state_dict(kept[1]); sched.load_state_dict(kept[2])
        parallel.set_rng_state(kept[3])
    if progress is None:
        progress = TrainProgress()
        train_ds = PREBUILT_DS if PREBUILT_DS is not None else build_datasets(args, tok)[0]
    kept = None
    # where to continue: the highest completed iteration; who is behind it receives from one who has it
    its = parallel.all_gather_object(progress.iteration if plan["replaced"] != rank or gen == 0 else -1)
    top = max(its); src = its.index(top); behind = [r for r, i in enumerate(its) if i < top]
    t_move = time.time()
    if gen and behind:
        group = dist.new_group([src] + behind)
        if rank == src or rank in behind:
            small = [{"opt": opt.state_dict(), "sched": sched.state_dict(), "rng": parallel.rng_state(),
                      "progress": vars(progress)}] if rank == src else [None]
            dist.broadcast_object_list(small, src=src, group=group)
            tensors = model_tensors(model)
            sums = [[checksum(v) for _, _, v in tensors]] if rank == src else [None]
            dist.broadcast_object_list(sums, src=src, group=group)
            if rank == src:
                for _, _, v in tensors:
                    dist.broadcast(v.detach().contiguous(), src=src, group=group)
            else:
                sds = [chunk.state_dict() for chunk in model]
                for i, k, v in tensors:
                    dist.broadcast(sds[i][k], src=src, group=group)
                bad = [k for (i, k, _), s in zip(tensors, sums[0]) if checksum(sds[i][k]) != s]
                for chunk, sd in zip(model, sds):
                    chunk.load_state_dict(sd)
                got = small[0]
                opt.load_state_dict(got["opt"]); sched.load_state_dict(got["sched"]); parallel.set_rng_state(got["rng"])
                progress = TrainProgress(**got["progress"])
                if bad:
                    raise SystemExit(f"transfer checksum mismatch in {bad[:3]}: fall back")
                log(f, f"RECEIVED state of iteration {progress.iteration} from rank {src}: {len(tensors)} model tensors "
                       f"checked, optimizer, scheduler, RNG, progress in {time.time() - t_move:.3f}s")
    log(f, f"GEN {gen} ready rank={rank}: iterations {its} -> continue after {top}; groups+engine {t_engine:.3f}s, "
           f"state move {time.time() - t_move:.3f}s, since gen start {time.time() - tg:.3f}s")
    committed = {"it": None}
    _orig_step = opt.step
    def _step_and_mark(*a, **k):  # the commit point: past it, this rank's iteration is done whatever follows
        out = _orig_step(*a, **k)
        committed["it"] = progress.iteration + 1
        return out
    opt.step = _step_and_mark
    try:
        while progress.iteration < TOTAL:
            report, stop = training.train_step(args, model, opt, sched, train_ds, progress)
            progress.iteration += 1
            progress.consumed_train_samples += report.global_batch_size
            log(f, f"ITER {progress.iteration} loss={fmt(report.loss)} gnorm={fmt(report.grad_norm)} gen={gen}")
            time.sleep(float(os.environ.get("STEP_SLEEP", "0.1")))
        dist.barrier()
        store.set("done", "1")
        log(f, "DONE")
        break
    except Exception as e:
        report = None
        te = time.time()
        if committed["it"] == progress.iteration + 1:  # stepped, but a collective after the step failed
            progress.iteration += 1
            progress.consumed_train_samples += args.global_batch_size
            log(f, f"iteration {progress.iteration} committed before the failure (its loss report was lost)")
        log(f, f"ERROR at iteration {progress.iteration} (gen {gen}): {str(e)[:90]}")
        # keep the state (tensors), not the objects: DDP and the optimizer hold the old process groups, and
        # a gloo group closes its connections (releasing peers still blocked in it) only once unreferenced
        kept = ([chunk.state_dict() for chunk in model], opt.state_dict(), sched.state_dict(), parallel.rng_state())
        opt.step = _orig_step
        del engine, model, opt, sched, _orig_step, _step_and_mark, report
        engine = None
        e.__traceback__ = None
        del e
        parallel.release_process_groups()
        log(f, f"released groups in {time.time() - te:.3f}s")
        gen += 1
parallel.shutdown()
