"""Flags of Megatron-LM's GPU-only features: overlaps, offloading, CUDA graphs, profiling and memory
housekeeping. Without CUDA, one that only changes speed or memory is ignored with one warning line;
what is not wired here is refused with one line, on any device. (fp8 is with the other precisions.)"""

from __future__ import annotations

import argparse

from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags

TC = "TransformerConfig"
KERNEL = "only selects a GPU kernel (same results)"
OVERLAP = "only overlaps GPU work (same results)"
MEMORY = "only manages GPU memory (same results)"
PROFILE = "only drives the CUDA profiler"
NOT_WIRED = "not supported yet here ({}); drop it"

FLAGS = (
    Flag("--use-transformer-engine-op-fuser", to=TC, gpu=KERNEL,
         help="let Transformer Engine fuse operations across layer boundaries"),
    Flag("--defer-embedding-wgrad-compute", to=TC, gpu=OVERLAP,
         help="pipeline: compute the output embedding's weight gradients during the pipeline flush"),
    Flag("--wgrad-deferral-limit", 0, int, "microbatches whose embedding weight gradients are deferred",
         to=TC),
    Flag("--delay-wgrad-compute", to=TC, gpu=OVERLAP,
         help="delay weight-gradient GEMMs to overlap them with communication"),
    Flag("--overlap-moe-expert-parallel-comm", to=TC, gpu=OVERLAP,
         help="overlap the experts' all-to-all with another microbatch's computation"),
    Flag("--fine-grained-activation-offloading",
         refuse=NOT_WIRED.format("the training loop does not drive megatron-core's offloading")),
    Flag("--offload-modules", [], str, nargs="+",
         help="what --fine-grained-activation-offloading offloads (not supported here): changes nothing"),
    Flag("--empty-unused-memory-level", 0, int, choices=(0, 1, 2), gpu=MEMORY,
         help="release cached CUDA memory after each step (1) and also after evaluation (2)"),
    Flag("--profile", gpu=PROFILE, help="start the CUDA profiler (nsys) for --profile-step-start .. end"),
    Flag("--profile-step-start", 10, int),
    Flag("--profile-step-end", 12, int),
    Flag("--profile-ranks", [], int, nargs="+", help="ranks that profile (default: all)"),
    Flag("--tp-comm-overlap", refuse=NOT_WIRED.format("Transformer Engine's userbuffers are not set up")),
    Flag("--tp-comm-overlap-cfg", None, str,
         refuse=NOT_WIRED.format("Transformer Engine's userbuffers are not set up")),
    Flag("--cuda-graph-impl", "none", str, choices=("none", "local", "transformer_engine", "full_iteration"),
         refuse=NOT_WIRED.format("CUDA graphs are not captured by this training loop")),
    Flag("--cuda-graph-modules", None, str, nargs="+",
         help="what CUDA graphs capture (with --cuda-graph-impl, not supported here): changes nothing"),
    Flag("--cuda-graph-warmup-steps", 3, int,
         help="warm-up steps before CUDA graph capture (with --cuda-graph-impl): changes nothing"),
    Flag("--te-rng-tracker", refuse=NOT_WIRED.format("Transformer Engine's RNG tracker is for CUDA graphs")),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "GPU-only features", FLAGS)


def validate(args: argparse.Namespace, world_size: int) -> None:
    if args.profile and args.profile_step_end <= args.profile_step_start:
        raise ArgumentError(f"--profile-step-end {args.profile_step_end} must come after "
                            f"--profile-step-start "
                            f"{args.profile_step_start}")
    if args.wgrad_deferral_limit < 0:
        raise ArgumentError("--wgrad-deferral-limit must not be negative")
