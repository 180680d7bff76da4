"""What verification costs when loading, per tier, measured in one run on 2 ranks (gloo, loopback).

    python benchmarks/bench_tiers.py            # full run (a few minutes on an idle 2-core box)
    python benchmarks/bench_tiers.py --quick    # smoke run, numbers not meaningful

Ratios between two things measured in the same run, interleaved (A, B, B, A, ...) and repeated;
reported as the median of the per-repeat ratios with their spread:

1. persistent verified load / unverified load: the loader (`load_first_verified` over a
   GlobalTier: candidates, sizes of every file, CRC32 of this rank's share, one agreement, then
   dist_checkpointing.load) / megatron-core's plain `dist_checkpointing.load` of the same checkpoint.
2. local verified load / unverified load: the loader over a LocalTier with replication (every copy
   this rank holds checked against its owner's CRC32, agreement, exchange plan, unseal,
   to_state_dict) / NVRx's LocalCheckpointManager (find_latest, load: file presence only, then
   torch.load) followed by the same to_state_dict.
3. local save / NVRx local save: LocalTier.save (seal: serialize once + CRC32, replicate the bytes,
   manifest, write) / NVRx LocalCheckpointManager.save of the tensor-aware state dict with the same
   replication.

Both sides read files the previous step wrote (the page cache is warm for both). Results go to
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import harness

FULL = {"shape": (4, 768, 12), "repeats": 7}
QUICK = {"shape": (2, 128, 4), "repeats": 2}
GOALS = {"persistent_load": 1.2, "local_load": 1.2}


def model_argv(layers: int, hidden: int, heads: int) -> list[str]:
    return [*harness.gpt_argv(layers, hidden, heads, 256, 1024), "--train-iters", "100", "--lr", "1e-4",
            "--min-lr", "1e-5"]


def worker(opts: argparse.Namespace) -> None:
    harness.start_worker()  # what pretrain.py installs at start-up
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )

    from megatron_resil import parallel
    from megatron_resil.checkpointing import loader
    from megatron_resil.checkpointing.global_tier import GlobalTier
    from megatron_resil.checkpointing.local_tier import LocalTier
    from megatron_resil.checkpointing.replication import build_clique_strategy
    from megatron_resil.checkpointing.state import build_sharded_state
    from megatron_resil.progress import TrainProgress

    cfg = QUICK if opts.quick else FULL
    world = int(os.environ["WORLD_SIZE"])
    engine = harness.build(model_argv(*cfg["shape"]), world, first_step=True)  # realistic Adam state
    model, optimizer, scheduler, args = engine.model, engine.optimizer, engine.scheduler, engine.args

    def state(loading: bool = False) -> dict:
        return build_sharded_state(model, optimizer, scheduler, TrainProgress(iteration=10), args,
                                   with_optimizer=True, with_rng=True, loading=loading)

    def template(_candidate=None, _saved_args=None, _saved_metadata=None) -> dict:
        return state(loading=True)

    root = opts.dir
    results: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}

    # 1. persistent tier
    persistent = GlobalTier(os.path.join(root, "persistent"))
    path = persistent.save(state(), 10)
    sizes["persistent"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    verified = lambda: loader.load_first_verified([persistent], template)  # noqa: E731
    plain = lambda: dist_checkpointing.load(template(), path)  # noqa: E731
    results["persistent_load"] = _interleave(verified, plain, cfg["repeats"])

    # 2 and 3. local tier with replication (factor 2 over the 2 ranks)
    ours = LocalTier(os.path.join(root, "ours"), replication=(1, 2))
    nvrx = LocalCheckpointManager(os.path.join(root, "nvrx"), repl_strategy=build_clique_strategy(1, 2))
    counter = {"ours": 10, "nvrx": 10}

    def save_ours() -> None:
        counter["ours"] += 1
        ours.save(state(), counter["ours"])

    def save_nvrx() -> None:
        counter["nvrx"] += 1
        tasd, _ = MCoreTensorAwareStateDict.from_state_dict(
            state(), algo="fully_parallel",
            parallelization_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        nvrx.save(tasd, counter["nvrx"])

    results["local_save"] = _interleave(save_ours, save_nvrx, cfg["repeats"])
    mine = os.path.join(root, "ours", str(parallel.rank()))
    sizes["local_per_rank"] = sum(os.path.getsize(os.path.join(mine, f)) for f in os.listdir(mine)
                                  if f.endswith("_local.pt"))

    def load_ours() -> None:
        result = loader.load_first_verified([ours], template)
        assert result is not None and result.candidate.tier == "local"

    nvrx_plain = LocalCheckpointManager(os.path.join(root, "nvrx"))  # own shards: no CPU-incapable transfer

    def load_nvrx() -> None:
        nvrx_plain.latest_iteration = -1
        assert nvrx_plain.find_latest() > 0
        loaded, _ = nvrx_plain.load()
        loaded.to_state_dict(template(), algo="fully_parallel", exchange_algo="gather_object",
                             parallelization_group=parallel_state.get_data_parallel_group(
                                 with_context_parallel=True))

    results["local_load"] = _interleave(load_ours, load_nvrx, cfg["repeats"])
    harness.write_results(opts.out, {"ratios": results, "sizes": sizes, "shape": cfg["shape"],
                                     "world": world})
    parallel.shutdown()


def _interleave(a, b, repeats: int) -> list[float]:
    """Ratios a/b over `repeats` pairs, alternating which runs first; one warm-up pair first."""
    timed = harness.timed
    timed(a), timed(b)
    ratios = []
    for i in range(repeats):
        if i % 2:
            tb, ta = timed(b), timed(a)
        else:
            ta, tb = timed(a), timed(b)
        ratios.append(ta / tb)
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the results here")
    harness.worker_flags(parser)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts)
        return 0
    work = tempfile.mkdtemp(prefix="bench_tiers_", dir=opts.workdir)
    try:
        data = harness.run_workers(__file__, 2, ["--dir", os.path.join(work, "ckpt"),
                                                 *(["--quick"] if opts.quick else [])])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nmodel (layers, hidden, heads) {tuple(data['shape'])}, {data['world']} ranks; persistent "
          f"checkpoint {data['sizes']['persistent'] / 2**20:.1f} MiB, local files per rank (own + "
          f"replica) {data['sizes']['local_per_rank'] / 2**20:.1f} MiB\n")
    print("| ratio | goal | median | min-max | n |\n|---|---|---|---|---|")
    labels = {"persistent_load": "persistent: verified load / unverified load",
              "local_load": "local: verified load / NVRx load (unverified)",
              "local_save": "local: sealed save / NVRx save"}
    for key, label in labels.items():
        values = harness.summarize(data["ratios"][key])
        goal = f"<= {GOALS[key]}" if key in GOALS else "as measured"
        print(f"| {label} | {goal} | {values['median']:.3f} | {values['min']:.3f}-{values['max']:.3f} "
              f"| {values['n']} |")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
