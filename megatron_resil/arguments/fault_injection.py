"""Deterministic fault injection flags, for tests and drills (ours; Megatron has no equivalent)."""

from __future__ import annotations

import argparse

from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags

KINDS = ("kill", "exception", "sigterm", "hang", "slow", "nan-loss", "spiky-loss", "crash-mid-save",
         "flip-weight", "kill-in-grad-sync")


FLAGS = (
    Flag("--inject-fault", None, str, choices=KINDS,
         help="kill: SIGKILL itself; exception: raise; sigterm: signal itself; hang: stop making progress; "
              "slow: sleep every iteration from then on; nan-loss: NaN loss at that iteration (with "
              "--inject-fault-repeat: on every pass of it, reruns too); spiky-loss: that iteration's loss "
              "x1000 (once: its rerun sees the true loss); crash-mid-save: die after writing the shards of "
              "the first save at or after that iteration, before it is published; flip-weight: flip one bit "
              "of one weight (the last weight matrix's largest element, in place: its data-parallel replicas "
              "then differ); kill-in-grad-sync: SIGKILL itself in that iteration as its gradients' reduction "
              "begins, its peers being inside it (after its forward and backward passes)"),
    Flag("--inject-fault-iteration", None, int, "the iteration at which the fault strikes (before it runs)"),
    Flag("--inject-fault-ranks", "0", str, "comma-separated global ranks (default 0)"),
    Flag("--inject-fault-slow-secs", 1.0, float),
    Flag("--inject-fault-repeat",
         help="strike again after a restart (default: once per job, remembered under --save)"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "fault injection (tests and drills)", FLAGS)


def validate(args: argparse.Namespace, world_size: int) -> None:
    if args.inject_fault is None:
        if args.inject_fault_iteration is not None:
            raise ArgumentError("--inject-fault-iteration needs --inject-fault KIND")
        return
    if args.inject_fault_iteration is None or args.inject_fault_iteration < 1:
        raise ArgumentError("--inject-fault needs --inject-fault-iteration N (N >= 1)")
    try:
        ranks = sorted({int(r) for r in args.inject_fault_ranks.split(",") if r.strip()})
    except ValueError:
        raise ArgumentError(f"--inject-fault-ranks {args.inject_fault_ranks!r}: give ranks like 0,3") \
            from None
    if not ranks or ranks[0] < 0 or ranks[-1] >= world_size:
        raise ArgumentError(f"--inject-fault-ranks {args.inject_fault_ranks!r}: ranks must be in "
                            f"[0, {world_size})")
    args.inject_fault_ranks = ranks
    if args.inject_fault_slow_secs <= 0:
        raise ArgumentError("--inject-fault-slow-secs must be positive")
    if not args.inject_fault_repeat and args.save is None:
        raise ArgumentError("--inject-fault remembers that it struck under --save so a restart does not "
                            "repeat it: pass --save DIR, or --inject-fault-repeat")
