"""Logging flags (Megatron-LM names, defaults and meanings): the iteration line, timers, TensorBoard and
Weights & Biases (train_log.py writes them)."""

from __future__ import annotations

import argparse
import importlib.util
import os

from megatron_resil.arguments.device import package_available
from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags

FLAGS = (
    Flag("--log-interval", 100, int, "print the iteration line every N iterations"),
    Flag("--log-params-norm", help="compute the weights' L2 norm each step; log it as 'params norm'"),
    Flag("--log-num-zeros-in-grad", to="OptimizerConfig",
         help="count the zeros in the gradients each step; log them as 'num zeros'"),
    Flag("--log-throughput", help="log the model FLOPs each GPU (rank) achieves, in TFLOP/s"),
    Flag("--timing-log-level", 0, int, choices=(0, 1, 2),
         help="0: iteration time only; 1: also forward-backward, optimizer and gradient-sync times; "
              "2: also each microbatch's compute and pipeline communication (Megatron-LM's timers)"),
    Flag("--timing-log-option", "minmax", str, choices=("max", "minmax", "all"),
         help="which ranks' timer values are printed: the slowest, the fastest and slowest, or all"),
    Flag("--logging-level", None, int, "Python logging level (10 debug, 20 info, 30 warning, ...)"),
    Flag("--tensorboard-dir", None, str),
    Flag("--tensorboard-log-interval", 1, int),
    Flag("--tensorboard-queue-size", 1000, int, "events TensorBoard queues before it writes them"),
    Flag("--log-timers-to-tensorboard", help="write the timers (iteration time, --timing-log-level's) to "
                                             "TensorBoard"),
    Flag("--log-memory-to-tensorboard", gpu="only writes CUDA memory statistics",
         help="write CUDA memory statistics to TensorBoard"),
    Flag("--log-validation-ppl-to-tensorboard", help="write validation perplexity to TensorBoard"),
    Flag("--no-log-loss-scale-to-tensorboard", True, help="do not write the loss scale to TensorBoard"),
    Flag("--log-world-size-to-tensorboard", help="write the world size to TensorBoard"),
    Flag("--wandb-project", None, str, "Weights & Biases project: log there too (from the last rank; what "
                                       "Megatron-LM logs: the per-step scalars with --tensorboard-dir)"),
    Flag("--wandb-exp-name", None, str, "the run's name in Weights & Biases"),
    Flag("--wandb-entity", None, str, "the Weights & Biases team or user"),
    Flag("--wandb-save-dir", None, str, "where Weights & Biases keeps its files (default: <save>/wandb)"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "logging", FLAGS)


def validate(args: argparse.Namespace, world_size: int) -> None:
    for flag in ("log_interval", "tensorboard_log_interval", "tensorboard_queue_size"):
        if getattr(args, flag) <= 0:
            raise ArgumentError(f"--{flag.replace('_', '-')} must be positive")
    if args.tensorboard_dir is not None and os.path.isfile(args.tensorboard_dir):
        raise ArgumentError(f"--tensorboard-dir {args.tensorboard_dir} is a file; give a directory")
    if args.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise ArgumentError("--tensorboard-dir needs the tensorboard package: pip install -e .[tensorboard]")
    if args.wandb_project and not package_available("wandb"):
        raise ArgumentError("--wandb-project needs the wandb package: pip install wandb")
    if args.wandb_project == "":
        args.wandb_project = None  # Megatron-LM: an empty project means no Weights & Biases
    if args.wandb_project and args.wandb_exp_name == "":
        raise ArgumentError("--wandb-exp-name is empty: name the run, or leave the flag out for W&B's name")
    if args.wandb_project and not args.wandb_save_dir and not args.save:
        raise ArgumentError("--wandb-project needs --wandb-save-dir or --save (its files go to <save>/wandb)")
    if args.wandb_project and args.wandb_save_dir and os.path.isfile(args.wandb_save_dir):
        raise ArgumentError(f"--wandb-save-dir {args.wandb_save_dir} is a file; give a directory")
