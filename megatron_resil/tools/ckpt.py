"""Inspect a checkpoint directory without training: what is there, whether each checkpoint verifies,
and which one `pretrain.py --load DIR` would resume from, and why.

    python -m megatron_resil.tools.ckpt list DIR [TIERS]
    python -m megatron_resil.tools.ckpt verify DIR [TIERS] [--iteration N]
    python -m megatron_resil.tools.ckpt which DIR [TIERS]

DIR is the --save/--load directory (the persistent tier). TIERS adds the others, with the paths the
run was given: --non-persistent-global-ckpt-dir D and --non-persistent-local-ckpt-dir D. The local
tier is read from every rank directory visible from this machine (on a cluster: run it on a node
for that node's ranks, or where the directories are gathered); a copy lost with its node counts as
missing. `which` tries the candidates in the order pretrain.py does: newest first across tiers,
local first at equal iterations.

Read-only: it never quarantines, cleans or rewrites anything. Exit codes: 0 fine, 1 a checkpoint
failed verification (verify) or nothing is loadable (which), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_resil import patches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_resil.tools.ckpt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["list", "verify", "which"])
    parser.add_argument("dir", help="a --save/--load directory")
    parser.add_argument("--iteration", type=int, default=None, help="verify only this iteration")
    parser.add_argument("--non-persistent-local-ckpt-dir", dest="local", default=None,
                        help="also the local tier under this root (<root>/<rank>/...)")
    parser.add_argument("--non-persistent-global-ckpt-dir", dest="non_persistent", default=None,
                        help="also the global non-persistent tier in this directory")
    args = parser.parse_args(argv)
    for flag, path in (("DIR", args.dir), ("--non-persistent-local-ckpt-dir", args.local),
                       ("--non-persistent-global-ckpt-dir", args.non_persistent)):
        if path is not None and not os.path.isdir(path):
            parser.error(f"{flag} {path} is not a directory; give the directory the run was given")
    # The tiers import megatron-core, which without the start-up patches imports TorchInductor: seconds.
    patches.install_import_speedups()
    from megatron_resil.tools import ckpt_commands as commands

    if args.command == "list":
        return commands.cmd_list(args.dir, args.local, args.non_persistent)
    tiers = commands.tiers(args.dir, args.local, args.non_persistent)
    if args.command == "verify":
        return commands.cmd_verify(tiers, args.iteration)
    return commands.cmd_which(tiers)


if __name__ == "__main__":
    sys.exit(main())
