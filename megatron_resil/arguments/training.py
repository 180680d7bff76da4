"""Batch sizes, iterations, optimizer and learning-rate schedule flags (Megatron-LM names)."""

from __future__ import annotations

import argparse

from megatron_resil.arguments.errors import ArgumentError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch size x data-parallel size")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save and exit when the iteration number is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit after this many minutes of training")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--optimizer", choices=["adam"], default="adam")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine"])
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)


def validate(args: argparse.Namespace, world_size: int) -> None:
    if args.train_iters is None:
        raise ArgumentError("--train-iters is required")
    if args.train_iters <= 0:
        raise ArgumentError("--train-iters must be positive")
    if args.micro_batch_size is None:
        raise ArgumentError("--micro-batch-size is required")
    if args.micro_batch_size <= 0:
        raise ArgumentError("--micro-batch-size must be positive")
    if args.lr is None:
        raise ArgumentError("--lr is required")
    if args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None:
        raise ArgumentError("--lr-decay-style WSD needs --lr-wsd-decay-iters")
    if args.lr_warmup_iters < 0:
        raise ArgumentError("--lr-warmup-iters must not be negative")
    if args.lr_warmup_iters >= args.lr_decay_iters:  # megatron-core's scheduler requires this
        raise ArgumentError(f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
                            f"{args.lr_decay_iters} (default: --train-iters)")
    if args.eval_interval is not None and args.eval_interval <= 0:
        raise ArgumentError("--eval-interval must be positive")
    if args.eval_iters < 0:
        raise ArgumentError("--eval-iters must not be negative")
    if args.exit_interval is not None and args.exit_interval <= 0:
        raise ArgumentError("--exit-interval must be positive")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        raise ArgumentError("--exit-duration-in-mins must be positive")
    if args.clip_grad < 0:
        raise ArgumentError("--clip-grad must not be negative (0 disables clipping)")


def validate_batch_sizes(args: argparse.Namespace, data_parallel_size: int) -> None:
    """Called by distributed.validate once the data-parallel size is known."""
    per_step = args.micro_batch_size * data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size <= 0 or args.global_batch_size % per_step:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {data_parallel_size}")
    args.num_microbatches = args.global_batch_size // per_step
