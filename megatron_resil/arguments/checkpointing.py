"""Checkpoint save/load flags (Megatron-LM names, plus --ckpt-keep-last)."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os

from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags

SUPPORTED_FORMATS = ("torch_dist", "zarr", "torch")
MEGATRON_FORMATS = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor", "zarr")


FLAGS = (
    Flag("--save", None, str, "directory for persistent checkpoints"),
    Flag("--load", None, str, "directory to resume from (follows its tracker)"),
    Flag("--save-interval", None, int),
    Flag("--save-retain-interval", None, int,
         "older checkpoints are deleted unless their iteration is a multiple of this"),
    Flag("--ckpt-keep-last", None, int,
         "keep only the newest K checkpoints (plus --save-retain-interval ones)"),
    Flag("--ckpt-format", "torch_dist", str, choices=MEGATRON_FORMATS,
         help="what global checkpoints are written in: torch_dist, zarr (zarr v3 through tensorstore, one "
              "array per tensor, readable outside PyTorch; synchronous saves only, not with "
              "--use-distributed-optimizer) or torch (Megatron-LM's legacy per-rank files, "
              "mp_rank_*/model_optim_rng.pt; synchronous, loads only under the parallel sizes that saved "
              "it). Loading reads any of them."),
    Flag("--dist-ckpt-optim-fully-reshardable",
         help="save the distributed optimizer's state fully reshardable (any data-parallel size, gathered "
              "per parameter); default: dp_reshardable (each rank's buffer shard)"),
    Flag("--no-save-optim"),
    Flag("--no-save-rng"),
    Flag("--no-load-optim"),
    Flag("--no-load-rng"),
    Flag("--finetune", help="load model weights only; reset iteration, optimizer and RNG"),
    Flag("--exit-on-missing-checkpoint"),
    Flag("--non-persistent-ckpt-type", None, str, choices=("global", "local"),
         help="global: torch_dist checkpoints in --non-persistent-global-ckpt-dir, only the newest kept; "
              "local: one file per rank in --non-persistent-local-ckpt-dir (node-local storage), optionally "
              "replicated to other nodes"),
    Flag("--non-persistent-save-interval", None, int),
    Flag("--non-persistent-global-ckpt-dir", None, str, "default: <save>/non_persistent"),
    Flag("--non-persistent-local-ckpt-dir", None, str,
         "root of the local tier: <dir>/<rank>/iter_<7 digits>_<rank>_local.pt"),
    Flag("--non-persistent-local-ckpt-algo", "fully_parallel", str, choices=("fully_parallel", "atomic"),
         help="fully_parallel: data-parallel ranks split replicated tensors; atomic: each rank saves "
              "everything it holds"),
    Flag("--replication", help="copy each rank's local checkpoint to --replication-factor - 1 other ranks"),
    Flag("--replication-jump", None, int,
         "rank distance between copies; set it to the ranks per node so copies land on other nodes "
         "(required with --replication)"),
    Flag("--replication-factor", 2, int, "how many ranks hold each local checkpoint, its owner included"),
    Flag("--non-persistent-canary-iters", 5, int,
         "after resuming from a non-persistent checkpoint, a NaN or Inf loss or grad norm within this many "
         "iterations rejects it and reloads the persistent checkpoint (0: off)"),
    Flag("--async-save",
         help="persistent interval saves are written by a background worker while training continues; "
              "published atomically once every rank has written"),
    Flag("--use-persistent-ckpt-worker",
         help="accepted for Megatron compatibility: the --async-save worker is always persistent"),
    Flag("--async-save-timeout-secs", 600.0, float,
         "an async save not written within this time is dropped and its worker killed (the previous "
         "checkpoints stay; training continues)"),
    Flag("--async-save-max-failures", 3, int,
         "this many failed async saves in a row end the job with exit code 4 (one failed save is dropped and "
         "training continues)"),
    Flag("--async-save-when-busy", "wait", str, choices=("wait", "skip"),
         help="an interval save due while the previous async save is still being written: wait for it, "
              "then save (default, as Megatron: no save is lost, the trainer stalls), or skip this save and "
              "train on (the next one comes at the next interval). Said once with the figures either way; "
              "the save at exit always waits"),
    Flag("--ckpt-assume-constant-structure",
         help="the model and optimizer state keep their structure for the whole job (as in Megatron): "
              "torch_dist saves after the first reuse its plan and its spread over data-parallel ranks and "
              "skip the sharding validation"),
    Flag("--ckpt-skip-checksums",
         help="do not verify file checksums on load (sizes and the manifest still are)"),
    Flag("--verify-integrity",
         help="as in Megatron-LM: every global checkpoint saved gets its SHA-256 manifest (integrity.json), "
              "and a checkpoint loaded must have one (one without it is passed over, not quarantined); "
              "torch_dist only. Without this flag, a checkpoint that has one is still checked against it"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "checkpointing", FLAGS)


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
    fs = os.statvfs(probe)
    if fs.f_flag & os.ST_RDONLY:
        raise ArgumentError(f"{flag} {path}: {probe} is on a read-only file system; choose a writable one")
    if fs.f_blocks == 0 and fs.f_files == 0:  # /proc, /sys: root may "write" there, nothing is stored
        raise ArgumentError(f"{flag} {path}: {probe} is on a pseudo file system (like /proc) that stores "
                            "no files; choose a directory on a disk")


def _core_takes_other_strategies() -> bool:
    """Our zarr strategy plugs into megatron-core 0.16's registry of sharded strategies
    (dist_checkpointing/strategies/base.py); 0.19 has none and saves torch_dist only. Looked up on disk,
    not imported: arguments are checked before megatron-core is loaded."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        return True  # no megatron-core: its import fails later with its own message
    return any(os.path.isfile(os.path.join(location, "dist_checkpointing", "strategies", "base.py"))
               for location in spec.submodule_search_locations)


def validate(args: argparse.Namespace, world_size: int) -> None:
    if args.ckpt_format not in SUPPORTED_FORMATS:
        raise ArgumentError(f"--ckpt-format {args.ckpt_format} is not supported; use --ckpt-format "
                            "torch_dist, zarr or torch")
    if args.verify_integrity and args.ckpt_format != "torch_dist":
        raise ArgumentError(f"--verify-integrity works with --ckpt-format torch_dist only (as in "
                            f"Megatron-LM), not {args.ckpt_format}; drop one of them")
    if args.verify_integrity and args.ckpt_skip_checksums:
        raise ArgumentError("--verify-integrity asks for every file's SHA-256 to be checked on load, "
                            "--ckpt-skip-checksums for none; drop one of them")
    _check_dir_flag("--save", args.save)
    _check_dir_flag("--load", args.load)
    _check_writable("--save", args.save)
    for flag in ("--save-interval", "--save-retain-interval"):
        _check_interval(flag, getattr(args, flag[2:].replace("-", "_")),
                        needs=None if args.save else "--save DIR")
    if args.ckpt_keep_last is not None and args.ckpt_keep_last < 1:
        raise ArgumentError("--ckpt-keep-last must be at least 1")
    _validate_non_persistent(args, world_size)
    if args.async_save and args.save is None:
        raise ArgumentError("--async-save needs --save DIR")
    if args.async_save and args.ckpt_format != "torch_dist":
        raise ArgumentError(f"--async-save works with --ckpt-format torch_dist only (as in Megatron), not "
                            f"{args.ckpt_format}; drop --async-save or use torch_dist")
    # The distributed optimizer saves each rank's buffer as pieces of uneven sizes under one key, which
    # a zarr array's regular chunk grid cannot hold: refused here rather than at the first save.
    if args.ckpt_format == "zarr" and args.use_distributed_optimizer:
        raise ArgumentError("--ckpt-format zarr cannot save the state of --use-distributed-optimizer; use "
                            "--ckpt-format torch_dist, or drop --use-distributed-optimizer")
    if args.ckpt_format == "torch" and args.use_distributed_optimizer:
        _check_torch_format_distributed_optimizer(args)
    if args.ckpt_format == "zarr" and not _core_takes_other_strategies():
        raise ArgumentError(f"--ckpt-format zarr needs megatron-core's pluggable checkpoint strategies, "
                            f"which megatron-core {importlib.metadata.version('megatron-core')} no longer "
                            "has; use --ckpt-format torch_dist, or megatron-core 0.16")
    if args.async_save_timeout_secs <= 0:
        raise ArgumentError("--async-save-timeout-secs must be positive")
    if args.async_save_max_failures < 1:
        raise ArgumentError("--async-save-max-failures must be at least 1")
    if args.exit_on_missing_checkpoint and args.load is None:
        raise ArgumentError("--exit-on-missing-checkpoint needs --load DIR")


def _check_torch_format_distributed_optimizer(args: argparse.Namespace) -> None:
    """The legacy format gathers the distributed optimizer's state to data-parallel rank 0 over Gloo, as in
    Megatron-LM, and keeps one distrib_optim.pt per model-parallel rank (one optimizer instance)."""
    if not args.use_gloo_process_groups:
        raise ArgumentError("--ckpt-format torch gathers the distributed optimizer's state over Gloo (as in "
                            "Megatron-LM): drop --disable-gloo-process-groups, or use --ckpt-format "
                            "torch_dist")
    if args.num_distributed_optimizer_instances > 1:
        raise ArgumentError("--ckpt-format torch keeps one distributed optimizer's state per model-parallel "
                            "rank, not that of --num-distributed-optimizer-instances "
                            f"{args.num_distributed_optimizer_instances}; use --ckpt-format torch_dist")


def _validate_non_persistent(args: argparse.Namespace, world_size: int) -> None:
    _check_interval("--non-persistent-save-interval", args.non_persistent_save_interval,
                    needs=None if args.non_persistent_ckpt_type else "--non-persistent-ckpt-type")
    if args.non_persistent_canary_iters < 0:
        raise ArgumentError("--non-persistent-canary-iters must be 0 (off) or positive")
    if args.non_persistent_ckpt_type == "local":
        if args.non_persistent_local_ckpt_dir is None:
            raise ArgumentError("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir "
                                "DIR (node-local storage, e.g. a local SSD)")
        _check_dir_flag("--non-persistent-local-ckpt-dir", args.non_persistent_local_ckpt_dir)
        _check_writable("--non-persistent-local-ckpt-dir", args.non_persistent_local_ckpt_dir)
    elif args.replication or args.non_persistent_local_ckpt_dir is not None:
        flag = "--replication" if args.replication else "--non-persistent-local-ckpt-dir"
        raise ArgumentError(f"{flag} needs --non-persistent-ckpt-type local")
    _validate_replication(args, world_size)
    if args.non_persistent_ckpt_type == "global":
        if args.non_persistent_global_ckpt_dir is None:
            if args.save is None:
                raise ArgumentError("--non-persistent-ckpt-type global needs --save or "
                                    "--non-persistent-global-ckpt-dir")
            args.non_persistent_global_ckpt_dir = os.path.join(args.save, "non_persistent")
        _check_dir_flag("--non-persistent-global-ckpt-dir", args.non_persistent_global_ckpt_dir)
        _check_writable("--non-persistent-global-ckpt-dir", args.non_persistent_global_ckpt_dir)


def _validate_replication(args: argparse.Namespace, world_size: int) -> None:
    if not args.replication:
        return
    if args.replication_jump is None:
        raise ArgumentError("--replication needs --replication-jump N; set N to the number of ranks "
                            "per node so that copies land on other nodes")
    if args.replication_jump < 1:
        raise ArgumentError("--replication-jump must be at least 1")
    if args.replication_factor < 2:
        raise ArgumentError("--replication-factor must be at least 2 (the owner plus one copy)")
    group = args.replication_jump * args.replication_factor
    if world_size % group:
        raise ArgumentError(f"--replication-jump {args.replication_jump} x --replication-factor "
                            f"{args.replication_factor} = {group} must divide the world size "
                            f"{world_size}")
