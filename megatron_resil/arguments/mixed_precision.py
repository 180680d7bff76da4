"""Numeric precision and loss-scaling flags (Megatron-LM names and defaults)."""

from __future__ import annotations

import argparse

from megatron_resil.arguments.errors import ArgumentError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true", help="bf16 weights and activations, fp32 optimizer state")
    g.add_argument("--fp16", action="store_true", help="fp16 weights and activations, with loss scaling")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="fixed loss scale under --fp16 (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="iterations without overflow before the dynamic scale grows")
    g.add_argument("--hysteresis", type=int, default=2, help="overflows tolerated before the scale shrinks")


def validate(args: argparse.Namespace, world_size: int) -> None:
    if args.bf16 and args.fp16:
        raise ArgumentError("--bf16 and --fp16 are mutually exclusive; pick one")
    if args.loss_scale is not None and args.loss_scale <= 0:
        raise ArgumentError("--loss-scale must be positive")
    for flag in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"):
        if getattr(args, flag) <= 0:
            raise ArgumentError(f"--{flag.replace('_', '-')} must be positive")
    if args.min_loss_scale > args.initial_loss_scale:
        raise ArgumentError(f"--min-loss-scale {args.min_loss_scale} is larger than --initial-loss-scale "
                            f"{args.initial_loss_scale}")
