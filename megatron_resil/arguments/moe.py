"""Mixture-of-experts flags (Megatron-LM names and defaults), passed to megatron-core's TransformerConfig.
Expert parallelism's layout is checked with the other parallel sizes (distributed.py)."""

from __future__ import annotations

import argparse

from megatron_resil.arguments import layer_pattern, sizes
from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags

TC = "TransformerConfig"
KERNEL = "only selects a GPU kernel (same results)"
DISPATCHERS = ("allgather", "alltoall")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
# Megatron-LM's --moe-layer-freq: N (one MoE layer every N layers) or a list expression of 0 (dense) and 1
# (MoE) per layer, e.g. "([0]*3+[1]*12)", read without evaluating it.
moe_layer_freq = layer_pattern.argument_type("moe layer pattern")

FLAGS = (
    Flag("--num-experts", None, int, "experts per MoE layer (default: dense)", to=TC,
         field="num_moe_experts"),
    Flag("--moe-layer-freq", 1, moe_layer_freq, to=TC,
         help="N: one MoE layer every N layers; or a list of 0 (dense) and 1 (MoE) per layer, "
              "e.g. '([0]*1+[1]*15)'"),
    Flag("--moe-ffn-hidden-size", None, int, "each expert's hidden size (default: --ffn-hidden-size)", to=TC),
    Flag("--moe-shared-expert-intermediate-size", None, int, to=TC,
         help="total hidden size of the shared experts every token also goes through (default: none)"),
    Flag("--moe-shared-expert-overlap", to=TC,
         help="run the shared experts while the dispatcher communicates"),
    Flag("--moe-shared-expert-gate", to=TC, help="a gate on the shared experts' output"),
    Flag("--moe-router-topk", 2, int, "experts each token is routed to", to=TC),
    Flag("--moe-router-score-function", "softmax", str, choices=("softmax", "sigmoid"), to=TC),
    Flag("--moe-router-pre-softmax", to=TC, help="softmax (or sigmoid) before the top-k selection"),
    Flag("--moe-router-topk-scaling-factor", None, float, "scale of the top-k routing scores", to=TC),
    Flag("--moe-router-num-groups", None, int, "expert groups for group-limited routing", to=TC),
    Flag("--moe-router-group-topk", None, int, "groups each token may use (group-limited routing)", to=TC),
    Flag("--moe-router-enable-expert-bias", to=TC,
         help="aux-loss-free load balancing: a per-expert bias, updated from each step's token counts"),
    Flag("--moe-router-bias-update-rate", 1e-3, float, "how fast the expert bias moves", to=TC),
    Flag("--moe-router-dtype", None, str, choices=("fp32", "fp64"), to=TC,
         help="routing and the weighted sum of expert outputs in this precision"),
    Flag("--moe-router-load-balancing-type", "aux_loss", str, choices=LOAD_BALANCING, nargs="+", to=TC),
    Flag("--moe-aux-loss-coeff", 0.0, float, "weight of the load-balancing loss (logged as "
                                            "load_balancing_loss)", nargs="+", to=TC),
    Flag("--moe-z-loss-coeff", None, float, "weight of the router z-loss (logged as z_loss)", to=TC),
    Flag("--moe-input-jitter-eps", None, float, "multiplicative noise on the router input", to=TC),
    Flag("--moe-token-dispatcher-type", "allgather", str, choices=DISPATCHERS, to=TC),
    Flag("--moe-expert-capacity-factor", None, float, "tokens over this share of the even load are "
                                                     "dropped (default: none dropped)", to=TC),
    Flag("--moe-pad-expert-input-to-capacity", to=TC, help="pad each expert's input to its capacity"),
    Flag("--moe-token-drop-policy", "probs", str, choices=("probs", "position"), to=TC),
    Flag("--moe-per-layer-logging", help="log the auxiliary losses of each MoE layer to TensorBoard"),
    Flag("--moe-grouped-gemm", to=TC, gpu=KERNEL, help="run the local experts as one grouped GEMM"),
    Flag("--moe-permute-fusion", to=TC, gpu=KERNEL, help="fused token permutation"),
    Flag("--moe-router-fusion", to=TC, gpu=KERNEL, help="fused top-k routing and aux-loss computation"),
    Flag("--disable-bias-linear", True, dest="add_bias_linear", to=TC,
         help="no biases in the linear layers (required with --num-experts)"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "mixture of experts", FLAGS)


def validate(args: argparse.Namespace, world_size: int) -> None:
    # Megatron-LM takes lists for these and turns a one-element list into its value.
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, name)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, name, value[0])
    if args.num_experts == 0:  # Megatron-LM: 0 means dense (a checkpoint's 0 is refused before this)
        args.num_experts = None
    sizes.check(args, sizes.MOE)
    if args.num_experts is None:
        return
    if args.num_experts <= 1:
        raise ArgumentError("--num-experts must be at least 2")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        raise ArgumentError(f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts "
                            f"{args.num_experts}")
    coefficients = args.moe_aux_loss_coeff if isinstance(args.moe_aux_loss_coeff, list) \
        else [args.moe_aux_loss_coeff]
    if any(c < 0 for c in coefficients):
        raise ArgumentError("--moe-aux-loss-coeff must not be negative")
    if args.add_bias_linear:
        # megatron-core's expert MLPs add the bias in place on an autograd view and fail in backward.
        raise ArgumentError("--num-experts needs --disable-bias-linear (megatron-core's experts take no "
                            "bias)")
    if isinstance(args.moe_layer_freq, list) and len(args.moe_layer_freq) != args.num_layers:
        raise ArgumentError(f"--moe-layer-freq lists {len(args.moe_layer_freq)} layers, not --num-layers "
                            f"{args.num_layers}")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if (args.moe_router_num_groups is None) != (args.moe_router_group_topk is None):
        raise ArgumentError("--moe-router-num-groups and --moe-router-group-topk go together "
                            "(group-limited routing)")
