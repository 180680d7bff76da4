"""Parallel layout and process-group flags (Megatron-LM names)."""

from __future__ import annotations

import argparse

import torch

from megatron_resil.arguments import training
from megatron_resil.arguments.errors import ArgumentError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl when CUDA is present, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)


def validate(args: argparse.Namespace, world_size: int) -> None:
    tp = args.tensor_model_parallel_size
    if tp <= 0:
        raise ArgumentError("--tensor-model-parallel-size must be positive")
    if args.pipeline_model_parallel_size != 1:
        raise ArgumentError("--pipeline-model-parallel-size > 1 is not supported yet; use 1")
    if world_size % tp:
        raise ArgumentError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp}")
    if args.num_attention_heads % tp:
        raise ArgumentError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}")
    if args.num_query_groups % tp:
        raise ArgumentError(
            f"--num-query-groups {args.num_query_groups} is not divisible by "
            f"--tensor-model-parallel-size {tp}")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    elif args.distributed_backend == "nccl" and not torch.cuda.is_available():
        raise ArgumentError("--distributed-backend nccl needs CUDA; use --distributed-backend gloo")
    if args.distributed_timeout_minutes <= 0:
        raise ArgumentError("--distributed-timeout-minutes must be positive")
    args.world_size = world_size
    args.data_parallel_size = world_size // tp
    training.validate_batch_sizes(args, args.data_parallel_size)
