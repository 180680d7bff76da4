"""Checkpoint save/load flags (Megatron-LM names, plus --ckpt-keep-last)."""

from __future__ import annotations

import argparse
import os

from megatron_resil.arguments.errors import ArgumentError

SUPPORTED_FORMATS = ("torch_dist",)
MEGATRON_FORMATS = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor", "zarr")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory for persistent checkpoints")
    g.add_argument("--load", default=None, help="directory to resume from (follows its tracker)")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--save-retain-interval", type=int, default=None,
                   help="older checkpoints are deleted unless their iteration is a multiple of this")
    g.add_argument("--ckpt-keep-last", type=int, default=None,
                   help="keep only the newest K checkpoints (plus --save-retain-interval ones)")
    g.add_argument("--ckpt-format", choices=MEGATRON_FORMATS, default="torch_dist")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only; reset iteration, optimizer and RNG")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--non-persistent-ckpt-type", choices=["global", "local"], default=None,
                   help="global: torch_dist checkpoints in --non-persistent-global-ckpt-dir, only the "
                        "newest kept")
    g.add_argument("--non-persistent-save-interval", type=int, default=None)
    g.add_argument("--non-persistent-global-ckpt-dir", default=None, help="default: <save>/non_persistent")
    g.add_argument("--ckpt-skip-checksums", action="store_true",
                   help="do not verify file checksums on load (sizes and the manifest still are)")


def _check_dir_flag(flag: str, path: str | None) -> None:
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ArgumentError(f"{flag} {path} is a file, not a directory; give a checkpoint directory")


def _check_interval(flag: str, value: int | None, needs: str | None) -> None:
    """An interval flag, if given, is positive; `needs` names the flag it cannot work without."""
    if value is None:
        return
    if needs is not None:
        raise ArgumentError(f"{flag} needs {needs}")
    if value <= 0:
        raise ArgumentError(f"{flag} must be positive")


def _check_writable(flag: str, path: str | None) -> None:
    """Fail now, not at the first save hours later; creates nothing."""
    if path is None:
        return
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ArgumentError(f"{flag} {path}: {probe} is a file, so the directory cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ArgumentError(f"{flag} {path}: {probe} is not writable; choose a directory you can write")


def validate(args: argparse.Namespace, world_size: int) -> None:
    if args.ckpt_format not in SUPPORTED_FORMATS:
        raise ArgumentError(
            f"--ckpt-format {args.ckpt_format} is not supported; use --ckpt-format torch_dist")
    _check_dir_flag("--save", args.save)
    _check_dir_flag("--load", args.load)
    _check_writable("--save", args.save)
    for flag in ("--save-interval", "--save-retain-interval"):
        _check_interval(flag, getattr(args, flag[2:].replace("-", "_")),
                        needs=None if args.save else "--save DIR")
    if args.ckpt_keep_last is not None and args.ckpt_keep_last < 1:
        raise ArgumentError("--ckpt-keep-last must be at least 1")
    _validate_non_persistent(args)
    if args.exit_on_missing_checkpoint and args.load is None:
        raise ArgumentError("--exit-on-missing-checkpoint needs --load DIR")


def _validate_non_persistent(args: argparse.Namespace) -> None:
    if args.non_persistent_ckpt_type == "local":
        raise ArgumentError("--non-persistent-ckpt-type local is not implemented yet; use global")
    _check_interval("--non-persistent-save-interval", args.non_persistent_save_interval,
                    needs=None if args.non_persistent_ckpt_type else "--non-persistent-ckpt-type global")
    if args.non_persistent_ckpt_type == "global":
        if args.non_persistent_global_ckpt_dir is None:
            if args.save is None:
                raise ArgumentError("--non-persistent-ckpt-type global needs --save or "
                                    "--non-persistent-global-ckpt-dir")
            args.non_persistent_global_ckpt_dir = os.path.join(args.save, "non_persistent")
        _check_dir_flag("--non-persistent-global-ckpt-dir", args.non_persistent_global_ckpt_dir)
        _check_writable("--non-persistent-global-ckpt-dir", args.non_persistent_global_ckpt_dir)
