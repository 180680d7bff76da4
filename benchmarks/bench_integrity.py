"""What Megatron-LM's integrity manifest (--verify-integrity, SHA-256 of every file) costs a save and a load.

    python benchmarks/bench_integrity.py            # 512 MiB of tensors, 5 repeats (about 20 s here)
    python benchmarks/bench_integrity.py --quick    # 64 MiB, 2 repeats: a smoke run

One process (a world of one, gloo). Save: `GlobalTier.save` of the same sharded state with and without
`verify_integrity`, interleaved (A, B, B, A, ...), each into a fresh iteration that is then deleted; the
ratio is the median of the per-repeat ratios. Load: `GlobalTier.verify` of a checkpoint saved with the
manifest (our CRC-32 and the SHA-256 in one read of each file) / of one saved without (CRC-32 only).
Every file is in the page cache, so these are the hashing costs, not the disk's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import harness

TENSOR_MIB = 32


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir)")
    opts = parser.parse_args()
    total_mib, repeats = (64, 2) if opts.quick else (512, 5)

    harness.start_worker(quiet=True)  # what pretrain.py installs (CPU: megatron-core's CUDA calls)
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_resil.checkpointing.global_tier import GlobalTier
    from megatron_resil.checkpointing.tier import TierCandidate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    numel = TENSOR_MIB * 2**20 // 4
    state = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.randn(numel))
             for i in range(total_mib // TENSOR_MIB)}
    base = tempfile.mkdtemp(prefix="bench_integrity_", dir=opts.workdir)
    try:
        tiers = {False: GlobalTier(os.path.join(base, "plain")),
                 True: GlobalTier(os.path.join(base, "sha256"), verify_integrity=True)}
        iteration = 0

        def save(with_manifest: bool, keep: bool = False) -> float:
            nonlocal iteration
            iteration += 1
            tier = tiers[with_manifest]
            os.sync()
            t0 = time.perf_counter()
            path = tier.save(state, iteration)
            seconds = time.perf_counter() - t0
            if not keep:
                shutil.rmtree(path)
            return seconds

        save(False), save(True)  # warm-up: imports, first plans
        ratios, plain, hashed = [], [], []
        for repeat in range(repeats):
            order = (False, True) if repeat % 2 == 0 else (True, False)
            seconds = {with_manifest: save(with_manifest) for with_manifest in order}
            plain.append(seconds[False])
            hashed.append(seconds[True])
            ratios.append(seconds[True] / seconds[False])

        save(False, keep=True)
        plain_candidate = TierCandidate("persistent", iteration, tiers[False].root + f"/iter_{iteration:07d}")
        save(True, keep=True)
        candidate = TierCandidate("persistent", iteration, tiers[True].root + f"/iter_{iteration:07d}")
        verify_ratios = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            assert tiers[True].verify(candidate) is None
            both = time.perf_counter() - t0
            t0 = time.perf_counter()
            assert tiers[False].verify(plain_candidate) is None
            verify_ratios.append(both / (time.perf_counter() - t0))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        dist.destroy_process_group()

    print(f"state: {total_mib} MiB in {len(state)} tensors, {repeats} repeats, torch {torch.__version__}")
    print(f"save without / with --verify-integrity (s, median): {statistics.median(plain):.2f} / "
          f"{statistics.median(hashed):.2f}")
    print(f"save with / without --verify-integrity: {harness.spread(ratios, 2)}")
    print(f"verify with integrity.json (CRC-32 + SHA-256, one read) / without (CRC-32): "
          f"{harness.spread(verify_ratios, 2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
