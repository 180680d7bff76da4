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
import os
import shutil
import sys
import tempfile

import harness

FULL = {"layers": 4, "hidden": 512, "heads": 8, "seq": 128, "vocab": 1024, "repeats": 5}
QUICK = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128, "repeats": 2}


def model_argv(cfg: dict, world: int, distributed: bool) -> list[str]:
    argv = [*harness.gpt_argv(cfg["layers"], cfg["hidden"], cfg["heads"], cfg["seq"], cfg["vocab"]),
            "--global-batch-size", str(world), "--train-iters", "100", "--lr", "1e-4"]
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
    harness.start_worker()  # what pretrain.py installs at start-up
    from megatron_resil import parallel
    from megatron_resil.checkpointing import loader
    from megatron_resil.checkpointing.global_tier import GlobalTier
    from megatron_resil.checkpointing.state import build_sharded_state, sharding_metadata
    from megatron_resil.progress import TrainProgress

    cfg = QUICK if opts.quick else FULL
    world = int(os.environ["WORLD_SIZE"])
    results: dict = {"world": world, "bytes": {}, "save": {}, "load": {}}
    engines = {}
    for distributed in (False, True):
        engine = harness.build(model_argv(cfg, world, distributed), world, first_step=True)  # the state
        key = "distributed" if distributed else "replicated"
        results["bytes"][key] = parallel.all_gather_object(optimizer_state_bytes(engine.optimizer))
        engines[key] = engine
    if opts.timing:
        for rep in range(cfg["repeats"]):
            for key in (("replicated", "distributed") if rep % 2 == 0 else ("distributed", "replicated")):
                engine = engines[key]
                tier = GlobalTier(os.path.join(opts.dir, f"{key}_{rep}"))
                tier.content_metadata = sharding_metadata(engine.args)

                def state(loading: bool = False, engine=engine) -> dict:
                    return build_sharded_state(engine.model, engine.optimizer, engine.scheduler,
                                               TrainProgress(iteration=1), engine.args, with_optimizer=True,
                                               with_rng=True, loading=loading,
                                               metadata=sharding_metadata(engine.args))

                def save(tier=tier, state=state) -> None:
                    tier.save(state(), 1)

                def load(tier=tier, state=state) -> None:
                    loader.load_first_verified([tier], lambda *_: state(loading=True))

                results["save"].setdefault(key, []).append(harness.timed(save))
                results["load"].setdefault(key, []).append(harness.timed(load))
                if parallel.is_rank0():
                    shutil.rmtree(tier.root)
    harness.write_results(opts.out, results)
    parallel.shutdown()


def launch(world: int, workdir: str, quick: bool, timing: bool) -> dict:
    return harness.run_workers(__file__, world, ["--dir", workdir, *(["--quick"] if quick else []),
                                                 *(["--timing"] if timing else [])], timeout=1800, quiet=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    harness.worker_flags(parser)
    parser.add_argument("--timing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts)
        return 0
    work = tempfile.mkdtemp(prefix="bench_engine_")
    try:
        runs = {world: launch(world, work, opts.quick, timing=world == 2) for world in (2, 4)}
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
        print(f"{what} at DP=2: replicated {harness.spread(timing[what]['replicated'])} s, distributed "
              f"{harness.spread(timing[what]['distributed'])} s, ratio distributed/replicated "
              f"{harness.spread(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
