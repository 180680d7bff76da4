"""Inspect a checkpoint directory without training: what is there, whether each checkpoint verifies,
and which one `pretrain.py --load DIR` would resume from, and why.

    python -m megatron_resil.tools.ckpt list DIR
    python -m megatron_resil.tools.ckpt verify DIR [--iteration N]
    python -m megatron_resil.tools.ckpt which DIR

Read-only: it never quarantines, cleans or rewrites anything. Exit codes: 0 fine, 1 a checkpoint
failed verification (verify) or nothing is loadable (which), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_resil.checkpointing import layout
from megatron_resil.checkpointing.manifest import has_manifest, read_manifest
from megatron_resil.checkpointing.torch_dist_tier import TorchDistTier
from megatron_resil.checkpointing.tracker import read_tracker


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def cmd_list(root: str) -> int:
    reading = read_tracker(root)
    tracker = "release" if reading.iteration == -1 else reading.iteration
    print(f"tracker: {tracker if reading.problem is None else reading.problem}")
    for iteration in layout.published_iterations(root):
        path = layout.iteration_dir(root, iteration)
        manifest, _ = read_manifest(path)
        kind = f"manifest v{manifest['version']}" if manifest else "no manifest"
        print(f"  iter_{iteration:07d}  {_size(path) / 2**20:10.1f} MiB  {kind}")
    for path in layout.quarantined(root):
        reason_file = os.path.join(path, "QUARANTINE_REASON.txt")
        reason = open(reason_file).read().strip() if os.path.isfile(reason_file) else "?"
        print(f"  quarantined {os.path.basename(path)}: {reason}")
    for kind, paths in layout.leftovers(root).items():
        for path in paths:
            print(f"  leftover ({kind}) {os.path.basename(path)}: removed at the next start of a run "
                  "that saves here")
    return 0


def cmd_verify(root: str, iteration: int | None) -> int:
    tier = TorchDistTier(root)
    failed = 0
    for candidate in tier.candidates():
        if iteration is not None and candidate.iteration != iteration:
            continue
        reason = tier.verify(candidate)
        if reason is not None:
            verdict = f"FAILED: {reason}"
        elif has_manifest(candidate.path):
            verdict = "ok (sizes and checksums match the manifest)"
        else:
            verdict = "ok (no manifest: presence of .metadata only)"
        failed += reason is not None
        print(f"iter_{candidate.iteration:07d}: {verdict}")
    return 1 if failed else 0


def cmd_which(root: str) -> int:
    tier = TorchDistTier(root)
    for candidate in tier.candidates():
        reason = tier.verify(candidate)
        where = f"iteration {candidate.iteration} ({candidate.path})"
        if reason is None:
            print(f"would load {where}: verified, {candidate.note}")
            return 0
        print(f"would reject {where}: {reason}")
    print(f"nothing loadable under {root}")
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_resil.tools.ckpt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["list", "verify", "which"])
    parser.add_argument("dir", help="a --save/--load directory")
    parser.add_argument("--iteration", type=int, default=None, help="verify only this iteration")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        parser.error(f"{args.dir} is not a directory; give a --save/--load directory")
    if args.command == "list":
        return cmd_list(args.dir)
    if args.command == "verify":
        return cmd_verify(args.dir, args.iteration)
    return cmd_which(args.dir)


if __name__ == "__main__":
    sys.exit(main())
