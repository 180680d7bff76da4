"""Flags of Megatron-LM's GPU-only features: overlaps, offloading, CUDA graphs, profiling and memory
housekeeping, Transformer Engine's userbuffers. Without CUDA, one that only changes speed or memory is
ignored with one warning line; on GPU megatron-core's configs get them and megatron_resil/gpu_features.py
drives what the training loop must (--cuda-graph-impl full_iteration, not wired, is refused with one line).
fp8 is with the other precisions."""

from __future__ import annotations

import argparse
import importlib.metadata
import os

from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags, warn
from megatron_resil.arguments.model import transformer_engine_available

TC = "TransformerConfig"
KERNEL = "only selects a GPU kernel (same results)"
OVERLAP = "only overlaps GPU work (same results)"
MEMORY = "only manages GPU memory (same results)"
PROFILE = "only drives the CUDA profiler"
GRAPH = "only replays captured GPU work (same results)"
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act",
                   "fused_group_mlp")
GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full")

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
    Flag("--fine-grained-activation-offloading", to=TC, gpu=MEMORY,
         help="offload the inputs of --offload-modules to CPU memory during the forward pass"),
    Flag("--offload-modules", [], str, nargs="+", to=TC, choices=OFFLOAD_MODULES,
         help="what --fine-grained-activation-offloading offloads"),
    Flag("--min-offloaded-tensor-size", 1024 * 1024, int, to=TC,
         help="smallest tensor (elements) --fine-grained-activation-offloading offloads"),
    Flag("--empty-unused-memory-level", 0, int, choices=(0, 1, 2), gpu=MEMORY,
         help="release cached CUDA memory after each step (1) and also after evaluation (2)"),
    Flag("--profile", gpu=PROFILE, help="start the CUDA profiler (nsys) for --profile-step-start .. end"),
    Flag("--profile-step-start", 10, int),
    Flag("--profile-step-end", 12, int),
    Flag("--profile-ranks", [], int, nargs="+", help="ranks that profile (default: all)"),
    Flag("--tp-comm-overlap", to=TC, gpu=OVERLAP,
         help="overlap tensor-parallel communication with GEMMs in Transformer Engine's userbuffers (needs "
              "--sequence-parallel)"),
    Flag("--tp-comm-overlap-cfg", None, str, help="YAML of Transformer Engine's userbuffer settings for "
                                                  "--tp-comm-overlap (default: Transformer Engine's)"),
    Flag("--cuda-graph-impl", "none", str, choices=("none", "local", "transformer_engine", "full_iteration"),
         to=TC, gpu=GRAPH, help="CUDA graphs: megatron-core's per-layer graphs (local), Transformer Engine's "
                                "(transformer_engine), or the whole forward-backward (full_iteration)"),
    Flag("--cuda-graph-modules", [], str, nargs="+", choices=GRAPH_MODULES,
         help="what the per-layer CUDA graphs capture (default: the whole layer)"),
    Flag("--cuda-graph-scope", None, str, nargs="+", choices=GRAPH_MODULES,
         dest="cuda_graph_scope_deprecated",
         help="deprecated name of --cuda-graph-modules"),
    Flag("--cuda-graph-warmup-steps", 3, int, to=TC, help="iterations run before CUDA graphs are captured"),
    Flag("--enable-cuda-graph", gpu=GRAPH, help="deprecated: --cuda-graph-impl local"),
    Flag("--external-cuda-graph", gpu=GRAPH, help="deprecated: --cuda-graph-impl transformer_engine"),
    Flag("--te-rng-tracker", to=TC, field="use_te_rng_tracker",
         gpu="only draws dropout masks from Transformer Engine's generator (which CUDA graphs need)",
         help="use Transformer Engine's CUDA RNG tracker"),
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
    _cuda_graphs(args)
    if args.fine_grained_activation_offloading:
        _offloading(args)
    if args.tp_comm_overlap:
        if not args.sequence_parallel:  # as Megatron-LM asserts
            raise ArgumentError("--tp-comm-overlap needs --sequence-parallel (and "
                                "--tensor-model-parallel-size > 1)")
        if args.transformer_impl != "transformer_engine":
            raise ArgumentError("--tp-comm-overlap needs --transformer-impl transformer_engine (its "
                                "userbuffers)")
        if args.tp_comm_overlap_cfg is not None and not os.path.isfile(args.tp_comm_overlap_cfg):
            raise ArgumentError(f"--tp-comm-overlap-cfg {args.tp_comm_overlap_cfg}: no such file")


def _offloading(args: argparse.Namespace) -> None:
    """Megatron-LM's checks: Transformer Engine's layers, and from Transformer Engine 2.10 its version 1
    offloading (NVTE_CPU_OFFLOAD_V1=1), which leaves the weights in place."""
    if args.transformer_impl != "transformer_engine":
        raise ArgumentError("--fine-grained-activation-offloading needs --transformer-impl "
                            "transformer_engine")
    te = _transformer_engine_version()
    if te is not None and te >= (2, 10) and os.environ.get("NVTE_CPU_OFFLOAD_V1", "0") != "1":
        raise ArgumentError("--fine-grained-activation-offloading with Transformer Engine 2.10 or later "
                            "needs NVTE_CPU_OFFLOAD_V1=1 in the environment (so weights are not offloaded)")


def _transformer_engine_version() -> tuple[int, ...] | None:
    try:
        version = importlib.metadata.version("transformer-engine")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def _cuda_graphs(args: argparse.Namespace) -> None:
    """Megatron-LM's translations: the deprecated switches and --cuda-graph-scope become --cuda-graph-impl
    and --cuda-graph-modules (with its warnings); CUDA graphs with Transformer Engine use its RNG tracker."""
    for switch, impl in (("enable_cuda_graph", "local"), ("external_cuda_graph", "transformer_engine")):
        if getattr(args, switch):
            flag = "--" + switch.replace("_", "-")
            if args.cuda_graph_impl != "none":
                raise ArgumentError(f"{flag} and --cuda-graph-impl cannot be used together; keep "
                                    "--cuda-graph-impl")
            warn(f"{flag} is deprecated, use --cuda-graph-impl={impl} instead.")
            args.cuda_graph_impl = impl
    if args.cuda_graph_scope_deprecated is not None:
        if args.cuda_graph_modules:
            raise ArgumentError("--cuda-graph-scope and --cuda-graph-modules cannot be used together.")
        warn("--cuda-graph-scope is deprecated, use --cuda-graph-modules instead.")
        args.cuda_graph_modules = args.cuda_graph_scope_deprecated
    if "full" in args.cuda_graph_modules:
        warn("full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer.")
        args.cuda_graph_modules = [m for m in args.cuda_graph_modules if m != "full"]
    if args.cuda_graph_impl == "none":
        return
    if args.cuda_graph_impl == "full_iteration":
        # megatron-core's FullCudaGraphWrapper replays the schedule on its own static copies of the batches
        # it reads up front; our forward step reads each microbatch by number (replays, resumes).
        raise ArgumentError("--cuda-graph-impl full_iteration is not supported here (megatron-core's "
                            "wrapper replays its static data buffers, which our forward step does not read); "
                            "use --cuda-graph-impl local or transformer_engine")
    if args.cuda_graph_impl == "transformer_engine" and not transformer_engine_available():
        raise ArgumentError("--cuda-graph-impl transformer_engine needs Transformer Engine: pip install "
                            "megatron-resil[gpu], or use --cuda-graph-impl local")
    if "transformer_engine" in (args.transformer_impl, args.cuda_graph_impl) and not args.te_rng_tracker:
        args.te_rng_tracker = True
        warn("te_rng_tracker is not enabled, enabling it for CUDA graphs.")
