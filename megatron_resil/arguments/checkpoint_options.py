"""Megatron-LM's checkpoint loading and writing options beyond those checkpointing.py owns: how a load
treats keys the checkpoint and the model do not share, and how the work of a save or load is spread."""

from __future__ import annotations

import argparse

from megatron_resil.arguments.flag_table import Flag, add_flags

STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
              "return_unexpected", "return_all", "ignore_all")
SPREAD = "accepted; it changes how the work is spread, not what is saved or loaded: "

FLAGS = (
    Flag("--dist-ckpt-strictness", "assume_ok_unexpected", str, choices=STRICTNESS,
         help="what a load from a global tier (--load, --non-persistent-ckpt-type global) does with keys "
              "that the checkpoint and the model do not share, as megatron-core's StrictHandling: "
              "assume_ok_unexpected and raise_* fail the load on a model key the checkpoint lacks; log_*, "
              "return_* and ignore_all load around it, and the weight keeps its initial value (said in one "
              "line; resume such a model with --no-load-optim or --finetune)"),
    Flag("--ckpt-fully-parallel-load", help=SPREAD + "every rank reads the shards it needs"),
    Flag("--no-ckpt-fully-parallel-save", True, dest="ckpt_fully_parallel_save",
         help=SPREAD + "saves spread the writing of replicated tensors over data-parallel ranks either way"),
    Flag("--ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save_deprecated",
         help="deprecated in Megatron-LM (the default); see --no-ckpt-fully-parallel-save"),
    Flag("--async-strategy", "nvrx", str, choices=("nvrx", "mcore"),
         help=SPREAD + "--async-save always uses this project's persistent writer process"),
    Flag("--async-ckpt-use-cpu-shm", help=SPREAD + "staging to CPU shared memory before the async writer"),
    Flag("--auto-detect-ckpt-format",
         help="accepted: loading always detects the checkpoint's format (torch_dist or zarr)"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "checkpoint loading and writing (Megatron-LM's options)", FLAGS)


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Nothing to check beyond the choices: these options change no result."""
