"""Foundation benchmarks of megatron-resil against megatron-core baselines, measured in one run.

    python benchmarks/bench_foundation.py            # full run (about 3 minutes on an idle 2-core box)
    python benchmarks/bench_foundation.py --quick    # smoke run (< 60 s), numbers not meaningful
    python benchmarks/bench_foundation.py --what-if  # also the save with one cost removed (analysis)

Three ratios, each between two things measured in the same run, interleaved (A, B, B, A, ...) and
repeated; the table shows the median of the per-repeat ratios and their spread (min-max):

1. save overhead: `GlobalTier.save` (staging dir, dist_checkpointing.save, fsync_tree, manifest,
   rename, tracker) / megatron-core's plain `dist_checkpointing.save` of the same sharded state
   (model + Adam state from `build_sharded_state`) into a fresh directory, same save strategy.
2. save throughput: bytes of the published checkpoint / atomic save time, divided by the
   throughput of plain Python writes + fsync of the same bytes in the same files on the same disk.
3. step time: `megatron_resil.training.train_step` (rerun validation, fault hooks, loss reporting) / a
   bare megatron-core loop on the same engine: the same model chunks in megatron-core's DDP, the same
   optimizer from get_megatron_optimizer (--use-distributed-optimizer), the same pipeline schedule with
   a plain mean-loss function, optimizer.step(), scheduler.step().

1 and 2 run on 2 ranks under torchrun (gloo, loopback); 3 runs afterwards in rank 0 alone, once
the other rank has exited, as a world of one. Each GlobalTier.save is also timed step by step
(see SaveStepTimer). Everything is written under a temporary directory in --workdir, removed at
the end. Results: BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import harness

SCRIPT = os.path.abspath(__file__)

# Model shapes. "save_small": a few hundred MB of model + Adam state; "save_large": >= 1 GiB.
FULL = {
    "save_small": {"layers": 4, "hidden": 768, "heads": 12, "seq": 256, "vocab": 1024},
    "save_large": {"layers": 7, "hidden": 1024, "heads": 16, "seq": 256, "vocab": 1024},
    "step": {"layers": 4, "hidden": 256, "heads": 4, "seq": 256, "vocab": 1024, "mbs": 4},
    "save_small_repeats": 11,
    "save_large_repeats": 7,
    "step_warmup": 3,
    "step_repeats": 5,
    "step_block": 8,
}
QUICK = {
    "save_small": {"layers": 2, "hidden": 128, "heads": 4, "seq": 64, "vocab": 256},
    "save_large": {"layers": 2, "hidden": 256, "heads": 4, "seq": 64, "vocab": 256},
    "step": {"layers": 2, "hidden": 64, "heads": 4, "seq": 64, "vocab": 256, "mbs": 2},
    "save_small_repeats": 3,
    "save_large_repeats": 3,
    "step_warmup": 1,
    "step_repeats": 3,
    "step_block": 2,
}

WHAT_IF = {
    "atomic_mcore_writer": "GlobalTier.save through megatron-core's own writer (a forked process per file, "
                           "shards read back for their checksums): the save before shard_writer",
    "atomic_no_checksum": "GlobalTier.save with no checksum of the shard data (sizes only): what the "
                          "checksum costs",
    "atomic_constant_structure": "GlobalTier.save with Megatron's --ckpt-assume-constant-structure (the "
                                 "plan and data-parallel spread of the first save reused, no sharding "
                                 "validation): what megatron-core's planning costs",
}
GOALS = {"save_overhead": ("<=", 1.05), "save_throughput": (">=", 0.9), "step_time": ("<=", 1.02)}


def pretrain_argv(shape: dict, mbs: int = 1) -> list[str]:
    return [*harness.gpt_argv(shape["layers"], shape["hidden"], shape["heads"], shape["seq"], shape["vocab"],
                              mbs),
            "--train-iters", "1000", "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine",
            "--lr-warmup-iters", "10", "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
            "--log-interval", "1000"]


_T0 = float(os.environ.get("BENCH_T0", time.time()))


def log(msg: str) -> None:
    print(f"[bench {time.time() - _T0:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# save benchmarks (2 ranks under torchrun)
# ---------------------------------------------------------------------------------------------
class _Proxy:
    """Delegates to a module, except for the attributes given (the timed wrappers)."""

    def __init__(self, target, **overrides) -> None:
        self._target = target
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._target, name)


class SaveStepTimer:
    """Times the steps of GlobalTier.save by wrapping the names its modules look up at call time.

    The code path is the tier's own (each wrapper adds two perf_counter calls). Nested calls are
    recorded under their caller ("fsync_tree > fsync_file[*.distcp]"); collectives are numbered in
    call order within one save. Steps the tier does not have (any more) are simply not wrapped, and
    whatever is not wrapped shows up as "other".
    """

    TIER_STEPS = ("_make_staging", "gather_checksums", "_barrier", "fsync_tree", "fsync_dir",
                  "write_manifest", "publish_directory", "write_tracker", "checksum_files")
    COLLECTIVES = ("barrier", "all_gather_object", "broadcast_object_list", "all_reduce", "broadcast_object",
                   "all_ranks_agree", "any_rank")

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        self._stack: list[str] = []
        self._counts: dict[str, int] = {}
        self.active = False  # only GlobalTier.save is recorded, not the baseline saves

    def start(self) -> None:
        self.current, self._stack, self._counts, self.active = {}, [], {}, True

    def finish(self, total: float | None) -> None:
        self.active = False
        if total is not None:
            self.current["TOTAL"] = total
            self.history.append(self.current)

    def wrap(self, name: str, fn, numbered: bool = False, kind_of_path: bool = False):
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            label = name
            if numbered:
                self._counts[name] = self._counts.get(name, 0) + 1
                label = f"{name} #{self._counts[name]}"
            if kind_of_path and args:
                base = os.path.basename(str(args[0]))
                label = f"{name}[{'*.distcp' if base.endswith('.distcp') else base}]"
            path = " > ".join([*self._stack, label])
            self.current.setdefault(path, 0.0)  # first-call order, parents before children
            self._stack.append(label)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                self.current[path] += time.perf_counter() - t0
        return timed

    def install(self) -> None:
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        from megatron_resil import parallel
        from megatron_resil.checkpointing import atomic, manifest
        from megatron_resil.checkpointing import global_tier as tdt

        def proxy(module, names, numbered):
            return _Proxy(module, **{n: self.wrap(f"{module.__name__.split('.')[-1]}.{n}", getattr(module, n),
                                                   numbered=numbered)
                                     for n in names if hasattr(module, n)})

        tdt.dist_checkpointing = proxy(dist_checkpointing, ["save"], numbered=False)
        tdt.parallel = proxy(parallel, self.COLLECTIVES, numbered=True)
        tdt.dist = proxy(dist, self.COLLECTIVES, numbered=True)
        for name in self.TIER_STEPS:
            if callable(getattr(tdt, name, None)):
                numbered = name in ("_barrier", "gather_checksums")
                setattr(tdt, name, self.wrap(name, getattr(tdt, name), numbered=numbered))
        # Inside those steps: the helpers they look up in their own modules' globals.
        for module, names in ((atomic, ("fsync_file", "fsync_dir")),
                              (manifest, ("file_checksum", "fsync_file", "all_files", "checksum_files"))):
            for name in names:
                if callable(getattr(module, name, None)):
                    setattr(module, name, self.wrap(name, getattr(module, name),
                                                    kind_of_path=name in ("fsync_file", "file_checksum")))
        from megatron_resil.checkpointing import shard_writer
        for name in ("write_buckets", "own_shard_checksums"):  # looked up at call time, so wrappable
            setattr(shard_writer, name, self.wrap(name, getattr(shard_writer, name)))
        self._install_dcp_phases()

    def _install_dcp_phases(self) -> None:
        """Inside dist_checkpointing.save: megatron-core 0.16's phases, where they exist."""
        from megatron.core.dist_checkpointing import serialization
        from megatron.core.dist_checkpointing.strategies import async_utils, common, filesystem_async
        from megatron.core.dist_checkpointing.strategies import fully_parallel as fp
        from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

        for module, names in ((serialization, ("save_preprocess", "save_config")),
                              (torch_strategy, ("_replace_state_dict_keys_with_sharded_keys",
                                                "mcore_to_pyt_state_dict", "save_state_dict_async_plan",
                                                "save_state_dict_async_finalize"))):
            for name in names:
                if callable(getattr(module, name, None)):
                    setattr(module, name, self.wrap(name, getattr(module, name)))
        for cls, name in ((common.TorchCommonSaveStrategy, "save_common"),
                          (fp.FullyParallelSaveStrategyWrapper, "apply_saving_parallelization"),
                          (filesystem_async.FileSystemWriterAsync, "prepare_write_data"),
                          (filesystem_async.FileSystemWriterAsync, "preload_tensors"),
                          (filesystem_async.FileSystemWriterAsync, "write_preloaded_data_multiproc"),
                          (async_utils.AsyncRequest, "execute_sync")):
            raw = cls.__dict__.get(name)
            if isinstance(raw, staticmethod):
                setattr(cls, name, staticmethod(self.wrap(name, raw.__func__)))
            elif callable(raw):
                setattr(cls, name, self.wrap(name, raw))

    def summary(self) -> dict[str, float]:
        """Mean seconds per step over the recorded saves (means add up to the mean total)."""
        labels: list[str] = []
        for record in self.history:
            labels += [k for k in record if k not in labels]
        return {k: statistics.fmean([r.get(k, 0.0) for r in self.history]) for k in labels}


def dir_files(path: str) -> dict[str, int]:
    out = {}
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, path)] = os.path.getsize(full)
    return out


def writer_rank(rel: str, world: int) -> int:
    """Which rank wrote a file of a torch_dist checkpoint: `__<rank>_<i>.distcp`; the rest rank 0."""
    name = os.path.basename(rel)
    if name.startswith("__") and name.endswith(".distcp"):
        try:
            return int(name[2:].split("_")[0]) % world
        except ValueError:
            return 0
    return 0


class SaveBenchmarks:
    """Benchmarks 1 and 2, on every rank: for each model shape, GlobalTier.save against megatron-core's
    plain dist_checkpointing.save of the same sharded state (and, for 2, raw writes of the same bytes),
    interleaved and repeated; the tier's saves also timed step by step (SaveStepTimer)."""

    def __init__(self, opts: argparse.Namespace) -> None:
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        from megatron_resil import parallel

        self.opts, self.dist = opts, dist
        self.world = int(os.environ["WORLD_SIZE"])
        self.rank0 = parallel.is_rank0()
        self.timer = SaveStepTimer()
        self.timer.install()
        self.plain_save = dist_checkpointing.save  # before the timer's proxy, as megatron-core has it
        self.buf = os.urandom(16 << 20)

    def sync_disk(self) -> None:
        """Flush every earlier write (and deletions) so no one is charged for another's dirty pages."""
        self.dist.barrier()
        if self.rank0:
            os.sync()
        self.dist.barrier()

    def remove(self, path: str) -> None:
        if self.rank0:
            shutil.rmtree(path, ignore_errors=True)
        self.dist.barrier()

    def state_of(self, shape: dict):
        """A way to build the sharded state (model + Adam state after one train_step, progress, RNG) of a
        model of this shape, and its parameter count."""
        from megatron_resil.checkpointing.state import build_sharded_state
        from megatron_resil.progress import TrainProgress

        engine = harness.build(pretrain_argv(shape), self.world, validation=False, first_step=True)
        progress = TrainProgress(iteration=100, consumed_train_samples=800)

        def fresh_state() -> dict:
            return build_sharded_state(engine.model, engine.optimizer, engine.scheduler, progress,
                                       engine.args, with_optimizer=True, with_rng=True)
        return fresh_state, engine.parameters

    def plain_strategy(self):
        """The same strategy GlobalTier uses: torch_dist, spread over data-parallel ranks."""
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )

        strategy = get_default_save_sharded_strategy("torch_dist")
        if self.world > 1:
            strategy = FullyParallelSaveStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
        return strategy

    def run(self, name: str, shape: dict, repeats: int, with_raw: bool) -> dict:
        fresh_state, n_params = self.state_of(shape)
        config = _ConfigSaves(self, name, fresh_state)
        if self.rank0:
            log(f"{name}: {n_params / 1e6:.1f}M params; warm-up saves (excluded) ...")
        config.atomic_once(record=False)  # also spawns megatron-core's multiprocessing Manager
        if self.opts.what_if:
            config.atomic_once(record=False, variant="atomic_constant_structure")  # its planning save
        config.plain_once()
        if with_raw:
            config.raw_once()
            config.raw_once(hot=True)
        ops = ["atomic", "raw", "raw_hot", "plain"] if with_raw else ["atomic", "plain"]
        if self.opts.what_if:
            ops += list(WHAT_IF)
        times: dict[str, list[float]] = {op: [] for op in ops}
        sizes = []
        for rep in range(repeats):
            # Interleaved, and the order reversed every other repeat (A B, B A, ...) against drift.
            for op in ops if rep % 2 == 0 else ops[::-1]:
                if op == "atomic":
                    seconds, size = config.atomic_once(record=True)
                    sizes.append(size)
                elif op == "raw":
                    seconds = config.raw_once()
                elif op == "raw_hot":
                    seconds = config.raw_once(hot=True)
                elif op == "plain":
                    seconds = config.plain_once()
                else:
                    seconds, _ = config.atomic_once(record=False, variant=op)
                times[op].append(seconds)
            if self.rank0:
                done = ", ".join(f"{op} {v[-1]:.3f}s" for op, v in times.items())
                log(f"{name} rep {rep + 1}/{repeats}: {done}")
        self.remove(config.base)
        breakdown = self.timer.summary()
        self.timer.history.clear()
        return {"params": n_params, "bytes": statistics.median(sizes), "files": len(config.layout),
                "layout": config.layout, "raw": [], **times, "breakdown": breakdown}


class _ConfigSaves:
    """The saves of one model shape: the tier's (and its what-if variants), the plain one, the raw writes."""

    def __init__(self, bench: SaveBenchmarks, name: str, fresh_state) -> None:
        from megatron_resil.checkpointing.global_tier import GlobalTier

        self.bench, self.fresh_state = bench, fresh_state
        self.base = os.path.join(bench.opts.dir, name)
        self.tier = GlobalTier(os.path.join(self.base, "atomic"))
        # The same tier with Megatron's --ckpt-assume-constant-structure (the what-if below): its first
        # save, the warm-up, plans; later ones reuse the plan and skip the sharding validation.
        self.constant_tier = GlobalTier(os.path.join(self.base, "atomic"), assume_constant_structure=True)
        self.plain_root = os.path.join(self.base, "plain")
        self.raw_root = os.path.join(self.base, "raw")
        if bench.rank0:
            os.makedirs(self.plain_root)
            os.makedirs(self.raw_root)
        self.counter = {"iteration": 0, "plain": 0, "raw": 0}
        self.layout: dict[str, int] = {}
        self.sources: dict[str, bytearray] = {}

    def atomic_once(self, record: bool, variant: str | None = None) -> tuple[float, int]:
        from megatron_resil import parallel

        bench = self.bench
        self.counter["iteration"] += 1
        iteration = self.counter["iteration"]
        state = self.fresh_state()
        bench.sync_disk()
        bench.timer.start()
        saver = self.constant_tier if variant == "atomic_constant_structure" else self.tier
        with what_if(variant):
            seconds = harness.timed(lambda: saver.save(state, iteration))
        bench.timer.finish(seconds if record else None)
        final = os.path.join(self.tier.root, f"iter_{iteration:07d}")
        files = dir_files(final) if bench.rank0 else {}
        if not self.layout:
            self.layout.update(parallel.broadcast_object(files))
        bench.remove(final)
        return seconds, sum(files.values())

    def plain_once(self) -> float:
        bench = self.bench
        self.counter["plain"] += 1
        path = os.path.join(self.plain_root, f"save_{self.counter['plain']}")
        state = self.fresh_state()
        bench.sync_disk()

        def op() -> None:
            if bench.rank0:
                os.makedirs(path)
            bench.dist.barrier()
            bench.plain_save(state, path, sharded_strategy=bench.plain_strategy())
        seconds = harness.timed(op)
        bench.remove(path)
        return seconds

    def source_for(self, rel: str, size: int) -> memoryview:
        """The file's bytes as distinct memory, as a checkpoint's tensors are: writing them reads `size`
        bytes of RAM, not one 16 MiB buffer that stays in the CPU's cache."""
        buf = self.bench.buf
        if rel not in self.sources:
            data = bytearray(size)
            for offset in range(0, size, len(buf)):
                n = min(len(buf), size - offset)
                data[offset:offset + n] = buf[:n]
            self.sources[rel] = data
        return memoryview(self.sources[rel])

    def raw_once(self, hot: bool = False) -> float:
        import threading

        bench, buf = self.bench, self.bench.buf
        self.counter["raw"] += 1
        path = os.path.join(self.raw_root, f"raw_{self.counter['raw']}")
        mine = [(rel, size) for rel, size in self.layout.items()
                if writer_rank(rel, bench.world) == bench.dist.get_rank()]
        bench.sync_disk()

        def write_file(rel: str, size: int) -> None:
            full = os.path.join(path, rel)
            view = memoryview(buf) if hot else self.source_for(rel, size)
            with open(full, "wb") as f:
                offset = 0
                while offset < size:
                    n = min(size - offset, len(buf))
                    f.write(view[:n] if hot else view[offset:offset + n])
                    offset += n
                f.flush()
                os.fsync(f.fileno())

        def op() -> None:
            if bench.rank0:
                os.makedirs(path)
                for rel in {os.path.dirname(r) for r in self.layout if os.path.dirname(r)}:
                    os.makedirs(os.path.join(path, rel), exist_ok=True)
            bench.dist.barrier()
            # One writer per file, as the checkpoint writers run one thread (or process) per file.
            threads = [threading.Thread(target=write_file, args=item) for item in mine]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        seconds = harness.timed(op)
        bench.remove(path)
        return seconds


@contextlib.contextmanager
def what_if(variant: str | None):
    """Experiments for BENCHMARKS.md (--what-if): the tier's save another way, same state."""
    if variant is None:
        yield
        return
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    from megatron_resil.checkpointing import shard_writer
    from megatron_resil.checkpointing.global_tier import GlobalTier

    if variant not in WHAT_IF:
        raise ValueError(variant)
    strategy, extend = GlobalTier.__dict__["_strategy"], shard_writer.extend_checksum
    try:
        if variant == "atomic_mcore_writer":
            # megatron-core's default torch_dist strategy; its shards are then not in the writer's
            # registry, so own_shard_checksums reads them back, as the tier did before.
            def megatron_core_writer(cls, cache_structure=False):
                return cls._parallel(get_default_save_sharded_strategy("torch_dist"))
            GlobalTier._strategy = classmethod(megatron_core_writer)
        elif variant == "atomic_no_checksum":
            shard_writer.extend_checksum = lambda crc, chunk, algorithm=None: 0
        yield
    finally:
        GlobalTier._strategy = strategy
        shard_writer.extend_checksum = extend


def save_worker(opts: argparse.Namespace) -> None:
    """The workers: benchmarks 1 and 2 on every rank, then 3 in rank 0 alone, once the others have exited."""
    harness.start_worker()  # what pretrain.py installs at start-up
    import torch.distributed as dist

    from megatron_resil import parallel
    from megatron_resil.arguments import parse_args

    cfg = QUICK if opts.quick else FULL
    world = int(os.environ["WORLD_SIZE"])
    parallel.initialize(parse_args(pretrain_argv(cfg["save_small"]), world_size=world))
    saves = SaveBenchmarks(opts)
    results = {
        "world_size": world,
        "save_small": saves.run("save_small", cfg["save_small"], cfg["save_small_repeats"], with_raw=False),
        "save_large": saves.run("save_large", cfg["save_large"], cfg["save_large_repeats"], with_raw=True),
    }
    # Benchmark 3 runs in rank 0 alone: the other ranks leave first, so they take no CPU from it.
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    parallel.shutdown()
    if not saves.rank0:
        return
    log("save benchmarks done; waiting for the other ranks to exit ...")
    deadline = time.time() + 60
    while time.time() < deadline and any(_alive(pid) for pid in pids[1:]):
        time.sleep(0.2)
    results["step"] = step_benchmark(cfg, opts.step_threads)
    with open(opts.out, "w") as f:
        json.dump(results, f)


def _alive(pid: int) -> bool:
    """False once `pid` has exited (a zombie waiting for torchrun to reap it counts as exited)."""
    from megatron_resil import rank_process

    return rank_process.alive(pid)


# ---------------------------------------------------------------------------------------------
# step-time benchmark (one process)
# ---------------------------------------------------------------------------------------------
def step_benchmark(cfg: dict, threads: int) -> dict:
    """Runs in rank 0 after the other ranks have exited, as a world of one."""
    import torch
    import torch.distributed as dist

    from megatron_resil import parallel
    from megatron_resil.data import get_microbatch
    from megatron_resil.progress import TrainProgress

    shape = cfg["step"]
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    engine = harness.build([*pretrain_argv(shape, mbs=shape["mbs"]), "--use-distributed-optimizer"], 1)
    args = engine.args
    # progress is not advanced, so train_step draws the same microbatch every step (it still pays
    # for fetching it from the dataset, as in training); the bare loop reuses that batch.
    progress = TrainProgress()
    batch = get_microbatch(engine.train_ds, 0, 0, args.micro_batch_size, 0, 1)

    def ours() -> None:
        engine.train_step(progress)

    # Megatron-LM's train_step: its rerun loop around the schedule (DDP's NaN check reports to the machine).
    bare = harness.bare_step(engine, batch["tokens"], batch["position_ids"], batch["labels"], rerun_loop=True)

    def one(fn) -> tuple[float, float]:
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - w0, time.process_time() - c0

    n_params = engine.parameters
    log(f"step: {n_params / 1e6:.2f}M params, seq {args.seq_length}, micro batch {args.micro_batch_size}, "
        f"{torch.get_num_threads()} torch threads; warm-up ...")
    for _ in range(cfg["step_warmup"]):
        one(ours)
        one(bare)
    # Alternate single steps (A B, B A, A B, ...) so both see the same machine; a block's figure is
    # the median of its steps, which a burst of load from other processes on this shared machine
    # moves less than a mean.
    blocks = []
    for rep in range(cfg["step_repeats"]):
        times: dict[str, list[tuple[float, float]]] = {"ours": [], "bare": []}
        for i in range(cfg["step_block"]):
            order = (("ours", ours), ("bare", bare)) if i % 2 == 0 else (("bare", bare), ("ours", ours))
            for key, fn in order:
                times[key].append(one(fn))
        blocks.append(times)
        med = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
        log(f"step rep {rep + 1}/{cfg['step_repeats']}: train_step {med['ours'] * 1e3:.1f} ms, "
            f"bare {med['bare'] * 1e3:.1f} ms (median of {cfg['step_block']} alternating steps each)")

    def per_block(key: str, index: int) -> list[float]:
        return [statistics.median(step[index] for step in block[key]) for block in blocks]

    ours_times, bare_times = per_block("ours", 0), per_block("bare", 0)
    ours_cpu, bare_cpu = per_block("ours", 1), per_block("bare", 1)
    parallel.shutdown()
    return {"params": n_params, "threads": torch.get_num_threads(), "ours": ours_times,
            "bare": bare_times, "ours_cpu": ours_cpu, "bare_cpu": bare_cpu, "block": cfg["step_block"],
            "steps": {k: [[w for w, _ in b[k]] for b in blocks] for k in ("ours", "bare")}}


# ---------------------------------------------------------------------------------------------
# orchestration and report
# ---------------------------------------------------------------------------------------------
def verdict(key: str, value: float) -> str:
    op, goal = GOALS[key]
    ok = value <= goal if op == "<=" else value >= goal
    return "yes" if ok else "NO"


def report(save: dict, step: dict, quick: bool, elapsed: float) -> dict:
    small, large = save["save_small"], save["save_large"]
    r1 = harness.ratios(small["atomic"], small["plain"])
    r2 = harness.ratios(large["raw"], large["atomic"])  # (bytes/atomic) / (bytes/raw) = raw / atomic
    r3 = harness.ratios(step["ours"], step["bare"])
    steps_ours, steps_bare = sum(step["steps"]["ours"], []), sum(step["steps"]["bare"], [])
    best = {"save_overhead": min(small["atomic"]) / min(small["plain"]),
            "save_throughput": min(large["raw"]) / min(large["atomic"]),
            "step_time": min(steps_ours) / min(steps_bare)}
    mib = 1024 * 1024
    rows = [
        ("1", "save time: GlobalTier.save / plain dist_checkpointing.save",
         f"{small['bytes'] / mib:.0f} MiB, {small['files']} files, 2 ranks",
         f"{statistics.median(small['atomic']):.3f} s", f"{statistics.median(small['plain']):.3f} s",
         r1, "save_overhead"),
        ("2", "save throughput: checkpoint / raw write+fsync",
         f"{large['bytes'] / mib:.0f} MiB, {large['files']} files, 2 ranks",
         f"{large['bytes'] / mib / statistics.median(large['atomic']):.0f} MiB/s",
         f"{large['bytes'] / mib / statistics.median(large['raw']):.0f} MiB/s", r2, "save_throughput"),
        ("3", "step time: train_step / bare megatron-core loop",
         f"{step['params'] / 1e6:.2f}M params, 1 proc, {step['threads']} thread(s)",
         f"{statistics.median(step['ours']) * 1e3:.1f} ms", f"{statistics.median(step['bare']) * 1e3:.1f} ms",
         r3, "step_time"),
    ]
    print()
    print("megatron-resil foundation benchmarks" + (" (--quick smoke run: numbers not meaningful)"
                                                    if quick else ""))
    header = ("#", "comparison (A / B)", "workload", "A median", "B median", "ratio median",
              "spread min-max", "n", "best/best", "goal", "meets")
    table = [header]
    for num, what, workload, a, b, r, key in rows:
        op, goal = GOALS[key]
        table.append((num, what, workload, a, b, f"{r['median']:.3f}", f"{r['min']:.3f}-{r['max']:.3f}",
                      str(r["n"]), f"{best[key]:.3f}", f"{op} {goal}", verdict(key, r["median"])))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print("ratio: median of the per-repeat ratios (1, 2: one per interleaved pair of saves; 3: one per block "
          "of alternating steps, each side its median step). best/best: the same ratio from each side's "
          "fastest run, the least disturbed by other load. 'meets' judges the median.")
    large_plain = statistics.median(large["plain"])
    cpu = harness.ratios(step["ours_cpu"], step["bare_cpu"])
    print(f"\nratio 3 by process CPU time instead of wall time: {cpu['median']:.3f} "
          f"(spread {cpu['min']:.3f}-{cpu['max']:.3f}); per-step medians over all blocks: "
          f"train_step {statistics.median(sum(step['steps']['ours'], [])) * 1e3:.1f} ms, "
          f"bare {statistics.median(sum(step['steps']['bare'], [])) * 1e3:.1f} ms")
    print(f"\nratio 2 context: plain dist_checkpointing.save of the same {large['bytes'] / mib:.0f} MiB: "
          f"{large_plain:.3f} s ({large['bytes'] / mib / large_plain:.0f} MiB/s); "
          f"atomic / plain = {harness.ratios(large['atomic'], large['plain'])['median']:.3f}")
    if large.get("raw_hot"):
        hot = statistics.median(large["raw_hot"])
        print(f"ratio 2 context: raw write+fsync from one 16 MiB buffer, re-read from the CPU's cache (the "
              f"baseline before 2026-11-25): {large['bytes'] / mib / hot:.0f} MiB/s; checkpoint / that = "
              f"{harness.ratios(large['raw_hot'], large['atomic'])['median']:.3f}")
    if any(k in small for k in WHAT_IF):
        print("\nwhat-if (--what-if): the tier's save another way, same run, interleaved")
        for key, what in WHAT_IF.items():
            w1 = harness.ratios(small[key], small["plain"])
            w2 = harness.ratios(large["raw"], large[key])
            b1 = min(small[key]) / min(small["plain"])
            b2 = min(large["raw"]) / min(large[key])
            print(f"  {what}:\n    ratio 1 {w1['median']:.3f} (spread {w1['min']:.3f}-{w1['max']:.3f}, "
                  f"best/best {b1:.3f}); ratio 2 {w2['median']:.3f} "
                  f"(spread {w2['min']:.3f}-{w2['max']:.3f}, best/best {b2:.3f})")
    for name, data, plain_list in (("1", small, small["plain"]), ("2", large, large["plain"])):
        print(f"\nGlobalTier.save step breakdown, benchmark {name} "
              f"(mean over {len(data['atomic'])} saves, rank 0 wall time, in call order):")
        total = data["breakdown"]["TOTAL"]
        accounted = 0.0
        for label, seconds in data["breakdown"].items():
            if label == "TOTAL":
                continue
            depth = label.count(" > ")
            if depth == 0:
                accounted += seconds
            shown = "  " * depth + label.split(" > ")[-1]
            print(f"  {shown:<58} {seconds * 1e3:9.1f} ms  {100 * seconds / total:5.1f} %")
        print(f"  {'other (unwrapped code, timing barrier)':<58} "
              f"{(total - accounted) * 1e3:9.1f} ms  {100 * (total - accounted) / total:5.1f} %")
        print(f"  {'TOTAL GlobalTier.save':<58} {total * 1e3:9.1f} ms")
        plain = statistics.fmean(plain_list)
        print(f"  {'plain dist_checkpointing.save (incl. mkdir + barriers)':<58} {plain * 1e3:9.1f} ms")
        print(f"  {'difference':<58} {(total - plain) * 1e3:9.1f} ms")
    print(f"\nwall time of the whole benchmark: {elapsed:.0f} s")
    return {"save": save, "step": step, "ratios": {"save_overhead": r1, "save_throughput": r2,
                                                   "step_time": r3}, "best": best}


def orchestrate(opts: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    os.environ.setdefault("BENCH_T0", str(_T0))
    os.makedirs(opts.workdir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="bench_foundation_", dir=opts.workdir)
    try:
        ckpt_dir = os.path.join(tmp, "ckpt")
        os.makedirs(ckpt_dir)
        log(f"working in {tmp}")
        log("benchmarks 1, 2 on 2 ranks under torchrun, then 3 in rank 0 alone ...")
        save = harness.run_workers(SCRIPT, 2, ["--dir", ckpt_dir, "--step-threads", str(opts.step_threads),
                                               *(["--quick"] if opts.quick else []),
                                               *(["--what-if"] if opts.what_if else [])], timeout=1200)
        step = save.pop("step")
        out = report(save, step, opts.quick, time.perf_counter() - t0)
        if opts.json:
            for cfg in ("save_small", "save_large"):
                out["save"][cfg].pop("layout", None)
            with open(opts.json, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run (< 60 s)")
    parser.add_argument("--workdir", default=tempfile.gettempdir(),
                        help="where the temporary directory for checkpoints goes (default: %(default)s)")
    parser.add_argument("--json", default=None, help="also write the raw measurements here")
    parser.add_argument("--what-if", action="store_true",
                        help="also time the tier's save with one cost taken away (see BENCHMARKS.md)")
    parser.add_argument("--step-threads", type=int, default=1,
                        help="torch threads for benchmark 3 (default %(default)s: on a shared machine two "
                             "OpenMP threads are descheduled independently and add noise)")
    harness.worker_flags(parser)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        save_worker(opts)
        return 0
    return orchestrate(opts)


if __name__ == "__main__":
    sys.exit(main())
