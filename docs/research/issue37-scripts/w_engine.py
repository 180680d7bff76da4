"""megatron-core engine experiments (Q4/Q5): one rank of a 4-rank DP run on gloo, plain process.
MODE=ref: train 2K steps straight. MODE=rebuild: K steps; then every rank tears down its process groups,
rebuilds them on a fresh store prefix (same ranks), rebuilds GPTModel+DDP+optimizer and copies the old
objects' state in; rank DST drops its state and receives everything from rank SRC over a fresh group, with
a per-tensor checksum; then K more steps. Losses and a parameter hash are logged per step."""
import os, sys, time, hashlib, json, datetime, gc, warnings
sys.path.insert(0, os.path.dirname(__file__))
from common import log
T0 = time.time()
logdir = sys.argv[1]
RANK, WS = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
f = open(f"{logdir}/rank{RANK}.log", "a")
K = int(os.environ.get("K", "5")); MODE = os.environ.get("MODE", "ref")
SRC, DST = int(os.environ.get("SRC", "0")), int(os.environ.get("DST", "3"))
warnings.simplefilter("ignore")
sys.path.insert(0, "/work/main")
from megatron_resil.arguments import parse_args
ARGV = ["--num-layers", os.environ.get("LAYERS", "4"), "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data", "--log-interval", "1",
        "--eval-interval", "1000", "--eval-iters", "1", "--train-iters", "100", "--seed", "1234",
        *os.environ.get("EXTRA", "").split()]
args = parse_args(ARGV)
from megatron_resil import patches
patches.install(args)
import torch, torch.distributed as dist
from megatron_resil import training, parallel, events, rerun
from megatron_resil.progress import TrainProgress
from megatron_resil.data import build_datasets
from megatron_resil.tokenizer import build_tokenizer
from megatron.core import parallel_state
torch.set_num_threads(1)
log(f, f"imports {time.time() - T0:.2f}s")
store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]) + 1, None, is_master=False,
                      timeout=datetime.timedelta(seconds=120), wait_for_workers=False)


def fmt(x):
    return float(x).hex()


def param_hash(model):
    h = hashlib.sha256()
    for chunk in model:
        for name, p in sorted(chunk.named_parameters()):
            h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def start(prefix):
    t = time.time()
    with parallel.attempt_store(dist.PrefixStore(prefix, store)):
        parallel.initialize(args)
    t1 = time.time()
    tok = build_tokenizer(args)
    engine = training.build_engine(args, tok.vocab_size)
    t2 = time.time()
    return tok, engine, t1 - t, t2 - t1


def step(engine, ds, progress):
    model, opt, sched = engine
    report, stop = training.train_step(args, model, opt, sched, ds, progress)
    assert stop is None
    progress.iteration += 1
    progress.consumed_train_samples += report.global_batch_size
    log(f, f"ITER {progress.iteration} loss={fmt(report.loss)} gnorm={fmt(report.grad_norm)} params={param_hash(model)}")


def flat_state(engine):
    """Every tensor of the model, optimizer and scheduler, in a fixed order, plus the small objects."""
    model, opt, sched = engine
    tensors, meta = [], []
    for i, chunk in enumerate(model):
        for k, v in chunk.state_dict().items():
            if torch.is_tensor(v):
                tensors.append(v); meta.append(("model", i, k))
    osd = opt.state_dict()
    for pid, st in sorted(osd["state"].items()):
        for k, v in sorted(st.items()):
            if torch.is_tensor(v):
                tensors.append(v); meta.append(("opt", pid, k))
    return tensors, meta


def checksum(t):
    return hashlib.sha1(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


events.configure(None)
rerun.initialize(rerun.RerunConfig.from_args(args))
tok, engine, t_pg, t_build = start("a0")
log(f, f"first start: process groups {t_pg:.3f}s, engine {t_build:.3f}s")
train_ds, _ = build_datasets(args, tok)
if os.environ.get("FREEZE") == "1":
    gc.collect(); gc.freeze()
progress = TrainProgress()
n = 2 * K if MODE == "ref" else K
for _ in range(n):
    step(engine, train_ds, progress)
if MODE == "rebuild":
    rng = parallel.rng_state()
    old = engine
    t = time.time()
    parallel.release_process_groups()
    t_release = time.time() - t
    tok, engine, t_pg, t_build = start("a1")
    t = time.time()
    model, opt, sched = engine
    if RANK != DST:  # survivors: copy the kept objects' state into the new ones
        for new, o in zip(model, old[0]):
            new.load_state_dict(o.state_dict())
        opt.load_state_dict(old[1].state_dict())
        sched.load_state_dict(old[2].state_dict())
        parallel.set_rng_state(rng)
    t_copy = time.time() - t
    if RANK == DST:
        # The replacement: whatever it had is dropped; it needs Adam's state to exist to receive into it
        del old, rng
        opt.state_dict()  # FP32Optimizer: state is created lazily at the first step -> initialise it
    log(f, f"REBUILD release {t_release:.3f}s, process groups {t_pg:.3f}s, engine {t_build:.3f}s, copy {t_copy:.3f}s")
    # ---- transfer SRC -> DST over a fresh 2-rank group
    t = time.time()
    pair = dist.new_group([SRC, DST])
    t_group = time.time() - t
    if RANK in (SRC, DST):
        t = time.time()
        if RANK == DST:
            # the receiver must have tensors of the same shapes: take the sender's layout first
            pass
        small = [{"rng": parallel.rng_state(), "sched": sched.state_dict(), "progress": vars(progress),
                  "opt": opt.state_dict(), "model_keys": None}] if RANK == SRC else [None]
        # the optimizer's state dict (tensors included) travels as an object: simplest, pickled
        dist.broadcast_object_list(small, src=SRC, group=pair)
        t_obj = time.time() - t
        tensors, meta = flat_state(engine) if RANK == SRC else (None, None)
        t = time.time()
        if RANK == SRC:
            sums = [checksum(x) for x in tensors]
            layout = [(m, tuple(x.shape), str(x.dtype)) for m, x in zip(meta, tensors)]
            box = [(layout, sums)]
        else:
            box = [None]
        dist.broadcast_object_list(box, src=SRC, group=pair)
        layout, sums = box[0]
        t_meta = time.time() - t
        t = time.time()
        if RANK == DST:
            model_sd = [chunk.state_dict() for chunk in model]
            recv = []
            for (kind, i, k), shape, dtype in layout:
                if kind == "model":
                    tgt = model_sd[i][k]
                    assert tuple(tgt.shape) == shape and str(tgt.dtype) == dtype, (k, tgt.shape, shape)
                else:
                    tgt = torch.empty(shape, dtype=getattr(torch, dtype.split(".")[1]))
                recv.append(tgt)
            works = [dist.broadcast(x, src=SRC, group=pair, async_op=True) for x in recv]
        else:
            works = [dist.broadcast(x.detach().contiguous(), src=SRC, group=pair, async_op=True) for x in tensors]
        for w in works:
            w.wait()
        t_tensors = time.time() - t
        t = time.time()
        nbytes = sum(x.numel() * x.element_size() for x in (recv if RANK == DST else tensors))
        if RANK == DST:
            bad = [m for m, x, s in zip(layout, recv, sums) if checksum(x) != s]
            # place what came: model tensors were received in place; optimizer from the object message
            for chunk, sd in zip(model, model_sd):
                chunk.load_state_dict(sd)
            got = small[0]
            opt.load_state_dict(got["opt"])
            sched.load_state_dict(got["sched"])
            parallel.set_rng_state(got["rng"])
            ok = not bad
        else:
            ok = True
        t_verify = time.time() - t
        log(f, f"TRANSFER {'recv' if RANK == DST else 'send'} {nbytes / 1e6:.3f} MB in {len(layout)} tensors: "
               f"new group {t_group:.3f}s, objects(opt+rng+sched) {t_obj:.3f}s, layout+checksums {t_meta:.3f}s, "
               f"tensors {t_tensors:.3f}s, verify+load {t_verify:.3f}s, checksums ok={ok}")
    dist.barrier()
    for _ in range(K):
        step(engine, train_ds, progress)
dist.barrier()
parallel.shutdown()
log(f, "DONE")
