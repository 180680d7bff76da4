"""Numeric precision and loss-scaling flags (Megatron-LM names and defaults), fp8 included."""

from __future__ import annotations

import argparse

from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags, warn

TC, OC = "TransformerConfig", "OptimizerConfig"
# fp8 changes what is computed: refused without CUDA (flag_table.screen), and needs Transformer Engine.
FP8 = "results"

FLAGS = (
    Flag("--bf16", to=TC, help="bf16 weights and activations, fp32 optimizer state"),
    Flag("--fp16", to=TC, help="fp16 weights and activations, with loss scaling"),
    Flag("--loss-scale", None, float, "fixed loss scale under --fp16 (default: dynamic)", to=OC),
    Flag("--initial-loss-scale", 2.0**32, float, to=OC),
    Flag("--min-loss-scale", 1.0, float, to=OC),
    Flag("--loss-scale-window", 1000, float, "iterations without overflow before the dynamic scale grows",
         to=OC),
    Flag("--hysteresis", 2, int, "overflows tolerated before the scale shrinks", to=OC),
    Flag("--fp8-format", None, str, choices=("e4m3", "hybrid"), dest="fp8", to=TC, gpu=FP8,
         help="fp8 GEMMs through Transformer Engine: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 "
              "backward)"),
    Flag("--fp8-recipe", "delayed", str, choices=("tensorwise", "delayed", "mxfp8", "blockwise"), to=TC,
         help="fp8 scaling recipe (with --fp8-format)"),
    Flag("--fp8-margin", 0, int, "margin of the fp8 scaling factor", to=TC),
    Flag("--fp8-amax-history-len", 1, int, "amax history window (delayed scaling)", to=TC),
    Flag("--fp8-amax-compute-algo", "most_recent", str, choices=("most_recent", "max"), to=TC),
    Flag("--fp8-param-gather", gpu=FP8, help="keep the compute weights in fp8 and all-gather them in fp8"),
    Flag("--first-last-layers-bf16", to=TC, help="with fp8: keep the first and last layers in bf16"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "mixed precision", FLAGS)


def validate(args: argparse.Namespace, world_size: int) -> None:
    if args.bf16 and args.fp16:
        raise ArgumentError("--bf16 and --fp16 are mutually exclusive; pick one")
    if args.loss_scale is not None and args.loss_scale <= 0:
        raise ArgumentError("--loss-scale must be positive")
    for flag in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"):
        if getattr(args, flag) <= 0:
            raise ArgumentError(f"--{flag.replace('_', '-')} must be positive")
    if args.min_loss_scale > args.initial_loss_scale:
        raise ArgumentError(f"--min-loss-scale {args.min_loss_scale} is larger than --initial-loss-scale "
                            f"{args.initial_loss_scale}")
    if args.fp16 and args.loss_scale is None and args.check_for_nan_in_loss_and_grad:
        # Megatron-LM's adjustment, and its line: an overflow (Inf or NaN gradients) is what tells the
        # dynamic loss scaler to shrink the scale, so it must not stop the run.
        warn("Setting args.check_for_nan_in_loss_and_grad to False since dynamic loss scaling is being used")
        args.check_for_nan_in_loss_and_grad = False
    if args.fp8 is not None or args.fp8_param_gather:
        if args.transformer_impl != "transformer_engine":
            raise ArgumentError("--fp8-format and --fp8-param-gather need --transformer-impl "
                                "transformer_engine")
        if args.fp8_param_gather and args.fp8 is None:
            raise ArgumentError("--fp8-param-gather needs --fp8-format")
        if args.fp8_param_gather and not args.use_distributed_optimizer:
            raise ArgumentError("--fp8-param-gather needs --use-distributed-optimizer (as in Megatron-LM)")
