"""What megatron-core's distributed optimizer buys and costs here, measured in one run.

    python benchmarks/bench_engine.py           # about 3 minutes on an idle 2-core machine
    python benchmarks/bench_engine.py --quick   # smoke run, numbers not meaningful

1. Optimizer-state bytes per rank, with and without --use-distributed-optimizer, at DP=2 and DP=4 (a
   world of one model replica per rank): the Adam moments (and fp32 main parameters, when the model is
   16-bit) each rank holds after a step. Goal: distributed / (replicated / DP) within 5% of 1.
2. Save and load time of the same model's persistent checkpoint at DP=2, with and without the
   distributed optimizer (GlobalTier.save; the verified load through the loader), interleaved repeats:
   the ratio distributed / replicated, median and spread.

The step time of pretrain.py's train_step against a bare megatron-core loop on the same engine is
bench_foundation.py's third ratio. Results: BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.abspath(__file__)
FULL = {"layers": 4, "hidden": 512, "heads": 8, "seq": 128, "vocab": 1024, "repeats": 5}
QUICK = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128, "repeats": 2}


def model_argv(cfg: dict, world: int, distributed: bool) -> list[str]:
    argv = ["--num-layers", str(cfg["layers"]), "--hidden-size", str(cfg["hidden"]),
            "--num-attention-heads", str(cfg["heads"]), "--seq-length", str(cfg["seq"]),
            "--max-position-embeddings", str(cfg["seq"]), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(cfg["vocab"]), "--micro-batch-size", "1", "--global-batch-size", str(world),
            "--train-iters", "100", "--lr", "1e-4", "--mock-data", "--eval-iters", "0"]
    return [*argv, "--use-distributed-optimizer"] if distributed else argv


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the tensors the optimizer itself holds: moments, and fp32 main params where they are
    copies (with fp32 model parameters the distributed optimizer's main params are views of them)."""
    total = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values()
                         if hasattr(v, "numel") and v.dim() > 0)
    return total


def worker(opts: argparse.Namespace) -> None:
    sys.path.insert(0, REPO)
    import torch.distributed as dist

    from megatron_resil import parallel, patches, rerun
    from megatron_resil.arguments import parse_args
    from megatron_resil.checkpointing import loader
    from megatron_resil.checkpointing.global_tier import GlobalTier
    from megatron_resil.checkpointing.state import build_sharded_state, sharding_metadata
    from megatron_resil.data import build_datasets
    from megatron_resil.progress import TrainProgress
    from megatron_resil.tokenizer import build_tokenizer
    from megatron_resil.training import build_engine, train_step

    cfg = QUICK if opts.quick else FULL
    patches.install()  # what pretrain.py installs at start-up
    world = int(os.environ["WORLD_SIZE"])
    results: dict = {"world": world, "bytes": {}, "save": {}, "load": {}}
    engines = {}
    for distributed in (False, True):
        args = parse_args(model_argv(cfg, world, distributed), world_size=world)
        if not dist.is_initialized():
            parallel.initialize(args)
        rerun.initialize(rerun.RerunConfig.from_args(args))
        tokenizer = build_tokenizer(args)
        model, optimizer, scheduler = build_engine(args, tokenizer.vocab_size)
        train_ds, _ = build_datasets(args, tokenizer)
        train_step(args, model, optimizer, scheduler, train_ds, TrainProgress())  # allocates the state
        key = "distributed" if distributed else "replicated"
        results["bytes"][key] = parallel.all_gather_object(optimizer_state_bytes(optimizer))
        engines[key] = (args, model, optimizer, scheduler)
    if opts.timing:
        for rep in range(cfg["repeats"]):
            for key in (("replicated", "distributed") if rep % 2 == 0 else ("distributed", "replicated")):
                args, model, optimizer, scheduler = engines[key]
                tier = GlobalTier(os.path.join(opts.dir, f"{key}_{rep}"))
                tier.content_metadata = sharding_metadata(args)

                def state(loading: bool = False, args=args, model=model, optimizer=optimizer,
                          scheduler=scheduler) -> dict:
                    return build_sharded_state(model, optimizer, scheduler, TrainProgress(iteration=1), args,
                                               with_optimizer=True, with_rng=True, loading=loading,
                                               metadata=sharding_metadata(args))

                dist.barrier()
                began = time.perf_counter()
                tier.save(state(), 1)
                dist.barrier()
                results["save"].setdefault(key, []).append(time.perf_counter() - began)
                began = time.perf_counter()
                loader.load_first_verified([tier], lambda *_: state(loading=True))
                dist.barrier()
                results["load"].setdefault(key, []).append(time.perf_counter() - began)
                if parallel.is_rank0():
                    shutil.rmtree(tier.root)
    if parallel.is_rank0():
        with open(opts.out, "w") as f:
            json.dump(results, f)
    parallel.shutdown()


def launch(world: int, out: str, workdir: str, quick: bool, timing: bool) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           SCRIPT, "--worker", "--out", out, "--dir", workdir, *(["--quick"] if quick else []),
           *(["--timing"] if timing else [])]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
           "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, env=env, cwd=REPO, check=True, timeout=1800, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--timing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts)
        return 0
    work = tempfile.mkdtemp(prefix="bench_engine_")
    try:
        runs = {world: launch(world, os.path.join(work, f"dp{world}.json"), work, opts.quick,
                              timing=world == 2)
                for world in (2, 4)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| DP | replicated optimizer bytes/rank | distributed bytes/rank (max) "
          "| distributed / (replicated / DP) | goal |")
    print("|---|---|---|---|---|")
    for world, run in runs.items():
        replicated = max(run["bytes"]["replicated"])
        distributed = max(run["bytes"]["distributed"])
        ratio = distributed / (replicated / world)
        verdict = "met" if abs(ratio - 1) <= 0.05 else "missed"
        print(f"| {world} | {replicated:,} | {distributed:,} | {ratio:.3f} | within 5% of 1: {verdict} |")
    timing = runs[2]
    for what in ("save", "load"):
        ratios = [d / r for d, r in zip(timing[what]["distributed"], timing[what]["replicated"], strict=True)]
        print(f"{what} at DP=2: replicated {summary(timing[what]['replicated'])} s, distributed "
              f"{summary(timing[what]['distributed'])} s, ratio distributed/replicated {summary(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
