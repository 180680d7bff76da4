"""Mixture-of-experts flags (Megatron-LM names and defaults). Expert parallelism's layout is checked with
the other parallel sizes (distributed.py)."""

from __future__ import annotations

import argparse

from megatron_resil.arguments.device import cuda_available
from megatron_resil.arguments.errors import ArgumentError

DISPATCHERS = ("allgather", "alltoall")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: dense)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    g.add_argument("--moe-token-dispatcher-type", choices=DISPATCHERS, default="allgather")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="weight of the load-balancing loss (logged as load_balancing_loss)")
    g.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING, default="aux_loss")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="run the local experts as one grouped GEMM (GPU)")
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in the linear layers (required with --num-experts)")


def validate(args: argparse.Namespace, world_size: int) -> None:
    if args.num_experts is None:
        return
    if args.num_experts <= 1:
        raise ArgumentError("--num-experts must be at least 2")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        raise ArgumentError(f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts "
                            f"{args.num_experts}")
    if args.moe_aux_loss_coeff < 0:
        raise ArgumentError("--moe-aux-loss-coeff must not be negative")
    if not args.disable_bias_linear:
        # megatron-core's expert MLPs add the bias in place on an autograd view and fail in backward.
        raise ArgumentError("--num-experts needs --disable-bias-linear (megatron-core's experts take no "
                            "bias)")
    if args.moe_grouped_gemm and not cuda_available():
        raise ArgumentError("--moe-grouped-gemm needs CUDA (grouped GEMM kernels); leave it off on CPU")
