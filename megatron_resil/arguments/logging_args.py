"""Logging flags (Megatron-LM names)."""

from __future__ import annotations

import argparse
import importlib.util
import os

from megatron_resil.arguments.errors import ArgumentError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)


def validate(args: argparse.Namespace, world_size: int) -> None:
    if args.log_interval <= 0:
        raise ArgumentError("--log-interval must be positive")
    if args.tensorboard_dir is not None and os.path.isfile(args.tensorboard_dir):
        raise ArgumentError(f"--tensorboard-dir {args.tensorboard_dir} is a file; give a directory")
    if args.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise ArgumentError("--tensorboard-dir needs the tensorboard package: pip install -e .[tensorboard]")
    if args.tensorboard_log_interval <= 0:
        raise ArgumentError("--tensorboard-log-interval must be positive")
