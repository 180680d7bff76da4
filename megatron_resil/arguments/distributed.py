"""Parallel layout, process-group and data-parallel engine flags (Megatron-LM names and defaults)."""

from __future__ import annotations

import argparse

from megatron_resil.arguments import training
from megatron_resil.arguments.device import cuda_available
from megatron_resil.arguments.errors import ArgumentError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved pipeline schedule: layers in each virtual stage")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="interleaved pipeline schedule: virtual stages each pipeline rank holds")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split activations along the sequence across tensor-parallel ranks (TP > 1)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split the sequence across ranks in attention (needs Transformer Engine, GPU)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl when CUDA is present, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--use-cpu-initialization", action="store_true", default=None,
                   help="initialise weights on the CPU (always so without CUDA)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state (and fp32 main params) across data-parallel ranks")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce gradient buckets during the backward pass")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="gather updated parameters during the next forward pass (distributed optimizer)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="keep and reduce gradients in fp32 under --bf16/--fp16")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (default: max(40M, 1M x data-parallel size))")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="average gradients inside the collective instead of scaling before it")


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) <= 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be positive")


def validate(args: argparse.Namespace, world_size: int) -> None:
    _positive(args, "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
              "expert_model_parallel_size", "distributed_timeout_minutes")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ArgumentError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp}")
    for heads_flag, heads in (("--num-attention-heads", args.num_attention_heads),
                              ("--num-query-groups", args.num_query_groups)):
        if heads % tp:
            raise ArgumentError(f"{heads_flag} {heads} is not divisible by --tensor-model-parallel-size {tp}")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda_available() else "gloo"
    elif args.distributed_backend == "nccl" and not cuda_available():
        raise ArgumentError("--distributed-backend nccl needs CUDA; use --distributed-backend gloo")
    if args.use_cpu_initialization is None:
        args.use_cpu_initialization = not cuda_available()
    _validate_pipeline(args)
    _validate_sequence_and_context(args)
    _validate_data_parallel_engine(args)
    args.world_size = world_size
    args.data_parallel_size = world_size // model_parallel
    _validate_experts(args)
    training.validate_batch_sizes(args, args.data_parallel_size)
    if args.virtual_pipeline_model_parallel_size is not None and args.num_microbatches % pp:
        raise ArgumentError(
            f"the interleaved pipeline schedule needs the number of microbatches ({args.num_microbatches} = "
            f"--global-batch-size / (--micro-batch-size x data-parallel size)) to be a multiple of "
            f"--pipeline-model-parallel-size {pp}")


def _validate_pipeline(args: argparse.Namespace) -> None:
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    if layers % pp:
        raise ArgumentError(f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size {pp}")
    per_stage = layers // pp
    per_virtual = args.num_layers_per_virtual_pipeline_stage
    virtual = args.num_virtual_stages_per_pipeline_rank
    if per_virtual is not None and virtual is not None:
        raise ArgumentError("give --num-layers-per-virtual-pipeline-stage or "
                            "--num-virtual-stages-per-pipeline-rank, not both")
    if per_virtual is not None:
        if per_virtual <= 0 or per_stage % per_virtual:
            raise ArgumentError(
                f"--num-layers-per-virtual-pipeline-stage {per_virtual} does not divide the {per_stage} "
                f"layers of each pipeline stage (--num-layers {layers} / "
                f"--pipeline-model-parallel-size {pp})")
        virtual = per_stage // per_virtual
    elif virtual is not None:
        if virtual <= 0 or per_stage % virtual:
            raise ArgumentError(
                f"--num-virtual-stages-per-pipeline-rank {virtual} does not divide the {per_stage} layers of "
                f"each pipeline stage (--num-layers {layers} / --pipeline-model-parallel-size {pp})")
    if virtual is not None and pp == 1:
        raise ArgumentError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
    args.virtual_pipeline_model_parallel_size = virtual if virtual is not None and virtual > 1 else None


def _validate_sequence_and_context(args: argparse.Namespace) -> None:
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and tp == 1:
        raise ArgumentError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.sequence_parallel and args.seq_length % tp:
        raise ArgumentError(f"--sequence-parallel needs --seq-length {args.seq_length} divisible by "
                            f"--tensor-model-parallel-size {tp}")
    if args.context_parallel_size > 1:
        if not cuda_available():
            raise ArgumentError("--context-parallel-size > 1 needs CUDA: megatron-core runs context-parallel "
                                "attention only in Transformer Engine; use --context-parallel-size 1 on CPU")
        if args.transformer_impl != "transformer_engine":
            raise ArgumentError("--context-parallel-size > 1 needs --transformer-impl transformer_engine")
        chunks = 2 * args.context_parallel_size  # megatron-core's load-balanced split of each sequence
        if args.seq_length % chunks:
            raise ArgumentError(f"--context-parallel-size {args.context_parallel_size} needs --seq-length "
                                f"{args.seq_length} divisible by {chunks} (twice the context-parallel size)")


def _validate_data_parallel_engine(args: argparse.Namespace) -> None:
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgumentError("--overlap-param-gather needs --use-distributed-optimizer")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise ArgumentError("--overlap-param-gather needs --overlap-grad-reduce")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size <= 0:
        raise ArgumentError("--ddp-bucket-size must be positive")


def _validate_experts(args: argparse.Namespace) -> None:
    ep = args.expert_model_parallel_size
    if args.num_experts is None:
        if ep > 1:
            raise ArgumentError("--expert-model-parallel-size > 1 needs --num-experts")
        return
    if args.num_experts % ep:
        raise ArgumentError(f"--num-experts {args.num_experts} is not divisible by "
                            f"--expert-model-parallel-size {ep}")
    # megatron-core's expert groups: tensor x expert x pipeline ranks must tile the world.
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dense_data_parallel = args.data_parallel_size * args.context_parallel_size
    if args.world_size % (tp * ep * pp) or (dense_data_parallel * tp) % (tp * ep):
        raise ArgumentError(
            f"--expert-model-parallel-size {ep} does not divide the data-parallel ranks: world size "
            f"{args.world_size} / (--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}) "
            f"must be a multiple of it")
