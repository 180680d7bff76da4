"""Command line of pretrain.py: Megatron-LM's flag names, grouped by concern.

Each concern (model, training, data, distributed, checkpointing, ...) owns one module with
`add_arguments(parser)` and `validate(args, world_size)`. Bad input ends in one line naming the
flag and exit code 2, before any work starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from megatron_resil.arguments import (
    attention_variants,
    checkpoint_args,
    checkpoint_options,
    checkpointing,
    data,
    distributed,
    fault_injection,
    fault_tolerance,
    flag_table,
    gpu_features,
    inprocess,
    logging_args,
    mixed_precision,
    model,
    moe,
    rerun,
    signals,
    straggler,
    training,
)
from megatron_resil.arguments.device import cuda_available
from megatron_resil.arguments.errors import ArgumentError

# Order matters only for --help readability; validation order follows dependencies.
_GROUPS = (model, attention_variants, mixed_precision, moe, training, data, distributed, checkpointing,
           checkpoint_options, checkpoint_args, signals, fault_injection, fault_tolerance, inprocess,
           logging_args, straggler, rerun, gpu_features)
# Every table row of Megatron-LM's flags (flag_table.Flag), from the concerns that declare theirs in one.
FLAGS = tuple(flag for group in _GROUPS for flag in getattr(group, "FLAGS", ()))


class _Parser(argparse.ArgumentParser):
    """argparse, but every error is one line on stderr and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"pretrain.py: error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pretrain.py",
        description="Pretrain a megatron-core GPT with crash-safe checkpoints.",
        allow_abbrev=False,
    )
    for group in _GROUPS:
        group.add_arguments(parser)
    parser.add_argument("--check-args-only", action="store_true",
                        help="validate the command line (world size from WORLD_SIZE) and exit 0 without "
                             "training: the launch scripts run this before spending an allocation (what the "
                             "launcher will provide, such as ft_launcher's rank monitor, is taken as given)")
    return parser


def world_size_from_env() -> int:
    raw = os.environ.get("WORLD_SIZE", "1")
    if not raw.isdigit() or int(raw) < 1:
        raise ArgumentError(f"environment variable WORLD_SIZE={raw!r} must be a positive integer; "
                            "launch with torchrun, ft_launcher or srun")
    return int(raw)


SavedArgs = Callable[[argparse.Namespace, argparse.ArgumentParser], None]


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None,
               saved_args: SavedArgs | None = None) -> argparse.Namespace:
    """Parse and validate; on bad input print one line naming the flag and exit with code 2.
    `saved_args`: what takes --use-checkpoint-args' arguments from the checkpoint into the parsed ones
    (checkpointing.saved_args.take_from_checkpoint, which pretrain.py passes), called between parsing and
    validation as Megatron-LM's initialize_megatron calls load_args_from_checkpoint; this package reads no
    checkpoint, so without it --use-checkpoint-args is refused."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        world_size = world_size_from_env() if world_size is None else world_size
        if saved_args is not None:
            saved_args(args, parser)  # --use-checkpoint-args: what it takes is checked as if given
        elif args.use_checkpoint_args:
            raise ArgumentError("--use-checkpoint-args is read by pretrain.py: here no reader of a "
                                "checkpoint's arguments was given (parse_args' saved_args)")
        flag_table.screen(args, FLAGS, cuda_available())
        world_size = inprocess.training_world_size(args, world_size)  # warm reserves do not train
        for group in _GROUPS:
            group.validate(args, world_size)
    except ArgumentError as err:
        flag_table.flush_warnings(print_them=False)
        parser.error(str(err))
    flag_table.flush_warnings(print_them=True)
    return args


__all__ = ["FLAGS", "ArgumentError", "build_parser", "parse_args"]
