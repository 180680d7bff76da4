"""The GPU-only features the training loop drives, as Megatron-LM drives them (d98e8a6,
megatron/training/{training,initialize}.py): CUDA graphs (--cuda-graph-impl local: megatron-core's own
per-layer graphs, which its pipeline schedules capture and replay; transformer_engine: megatron-core's
TECudaGraphHelper, captured here once --cuda-graph-warmup-steps iterations have run), Transformer Engine's
userbuffers (--tp-comm-overlap) and fine-grained activation offloading (megatron-core's schedules offload;
this pins the rank's CPU threads near its GPU). Without CUDA the flags were ignored at start-up
(arguments/gpu_features.py), so on CPU nothing here does anything.
Read against Megatron-LM, not run: no GPU has run this code yet."""

from __future__ import annotations

import argparse


def seed_kwargs(args: argparse.Namespace) -> dict:
    """megatron-core's RNG tracker for model_parallel_cuda_manual_seed: Transformer Engine's with
    --te-rng-tracker, and a graph-safe generator under CUDA graphs (Megatron-LM's _set_random_seed)."""
    return {"te_rng_tracker": args.te_rng_tracker, "use_cudagraphable_rng": args.cuda_graph_impl != "none"}


def set_up(args: argparse.Namespace) -> None:
    """After the process groups: the userbuffers, and the CPU affinity activation offloading wants."""
    if args.tp_comm_overlap:
        _initialize_userbuffers(args)
    if args.fine_grained_activation_offloading:
        from megatron.core.pipeline_parallel.utils import set_ideal_affinity_for_current_gpu

        set_ideal_affinity_for_current_gpu()


def _initialize_userbuffers(args: argparse.Namespace) -> None:
    """--tp-comm-overlap: Transformer Engine's userbuffers for the tensor-parallel GEMMs, sized for one
    microbatch's sequence on this context-parallel rank (Megatron-LM's _initialize_tp_communicators)."""
    import inspect

    import yaml
    from transformer_engine.pytorch import module as te_module

    ub_cfgs = {}
    if args.tp_comm_overlap_cfg is not None:
        with open(args.tp_comm_overlap_cfg) as stream:
            ub_cfgs = yaml.safe_load(stream) or {}
    tokens = args.seq_length * args.micro_batch_size // args.context_parallel_size
    kwargs = {"shape": [tokens, args.hidden_size], "tp_size": args.tensor_model_parallel_size,
              "ub_cfgs": ub_cfgs}
    if "quantization_modes" in inspect.signature(te_module.base.initialize_ub).parameters:  # TE 2.7 on
        mode = te_module.base.UserBufferQuantizationMode
        kwargs["quantization_modes"] = [mode.FP8 if args.fp8 else mode.NONE]
    else:
        kwargs["use_fp8"] = args.fp8 is not None
    te_module.base.initialize_ub(bootstrap_backend="nccl", **kwargs)


class GraphCapture:
    """--cuda-graph-impl transformer_engine: Transformer Engine's graphs of the layers, captured by
    megatron-core's TECudaGraphHelper after --cuda-graph-warmup-steps iterations of this run (0: before the
    first) and deleted when training ends. Nothing for the other implementations."""

    def __init__(self, args: argparse.Namespace, model: list, optimizer) -> None:
        self.helper = None
        self.warmup_steps = args.cuda_graph_warmup_steps
        if args.cuda_graph_impl == "transformer_engine":
            from megatron.core.transformer.cuda_graphs import TECudaGraphHelper
            from megatron.core.utils import get_model_config

            self.helper = TECudaGraphHelper(model=model, config=get_model_config(model[0]),
                                            seq_length=args.seq_length,
                                            micro_batch_size=args.micro_batch_size, optimizers=[optimizer])
        self.before_iteration(0)

    def before_iteration(self, taken_in_this_run: int) -> None:
        """Capture once this run has taken the warm-up iterations (forward pre-hooks stay enabled here,
        so megatron-core's graphs need no manual hooks)."""
        if self.helper is not None and taken_in_this_run == self.warmup_steps and \
                not self.helper.graphs_created():
            self.helper.create_cudagraphs()

    def close(self) -> None:
        if self.helper is not None and self.helper.graphs_created():
            self.helper.delete_cuda_graphs()
