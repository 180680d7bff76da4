"""Parallel layout, process-group and data-parallel engine flags (Megatron-LM names and defaults)."""

from __future__ import annotations

import argparse
import math
import os
import re

from megatron_resil import batch_schedule
from megatron_resil.arguments import training
from megatron_resil.arguments.device import cuda_available
from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags, warn

TC, DDP, OC = "TransformerConfig", "DistributedDataParallelConfig", "OptimizerConfig"
FSDP = "Megatron-FSDP is not supported here; use --use-torch-fsdp2 or --use-distributed-optimizer"
WITH_FSDP = "used with --use-megatron-fsdp only (not supported here), so it changes nothing without it"

FLAGS = (
    Flag("--tensor-model-parallel-size", 1, int, to=TC),
    Flag("--pipeline-model-parallel-size", 1, int, to=TC),
    Flag("--num-layers-per-virtual-pipeline-stage", None, int,
         "interleaved pipeline schedule: layers in each virtual stage"),
    Flag("--num-virtual-stages-per-pipeline-rank", None, int,
         "interleaved pipeline schedule: virtual stages each pipeline rank holds"),
    Flag("--decoder-first-pipeline-num-layers", None, int, "layers of the first pipeline stage (uneven "
         "split; default: even)", to=TC, field="num_layers_in_first_pipeline_stage"),
    Flag("--decoder-last-pipeline-num-layers", None, int, "layers of the last pipeline stage (uneven "
         "split; default: even)", to=TC, field="num_layers_in_last_pipeline_stage"),
    Flag("--account-for-embedding-in-pipeline-split", to=TC,
         help="count the embedding as a layer when splitting layers over pipeline stages"),
    Flag("--account-for-loss-in-pipeline-split", to=TC,
         help="count the output layer and loss as a layer when splitting layers over pipeline stages"),
    Flag("--pipeline-model-parallel-layout", None, str, to=TC,
         help="the layers of each pipeline stage, e.g. \"E|(t|)*3,m|m||L\": E embedding, t transformer "
              "layer, m multi-token prediction layer, L loss; stages split by |, (..)*n repeats; more stages "
              "than --pipeline-model-parallel-size are virtual stages"),
    Flag("--microbatch-group-size-per-virtual-pipeline-stage", None, int, to=TC,
         dest="microbatch_group_size_per_vp_stage",
         help="interleaved schedule: microbatches run together on one virtual stage (default: PP size)"),
    Flag("--no-overlap-p2p-communication", True, dest="overlap_p2p_comm", to=TC,
         help="interleaved schedule: do not overlap pipeline sends and receives with compute (needs "
              "--pipeline-model-parallel-size > 2)"),
    Flag("--overlap-p2p-communication-warmup-flush", to=TC, dest="overlap_p2p_comm_warmup_flush",
         help="interleaved schedule: also overlap pipeline communication in the warm-up and flush"),
    Flag("--sequence-parallel", to=TC,
         help="split activations along the sequence across tensor-parallel ranks (TP > 1)"),
    Flag("--context-parallel-size", 1, int, "split the sequence across ranks in attention (needs "
                                           "Transformer Engine, GPU)", to=TC),
    Flag("--cp-comm-type", ["p2p"], str, nargs="+", to=TC,
         help="context-parallel communication: p2p, a2a, allgather or a2a+p2p (one, or one per layer)"),
    Flag("--hierarchical-context-parallel-sizes", None, int, nargs="+", to=TC,
         help="sizes of the context-parallel levels (with --cp-comm-type a2a+p2p)"),
    Flag("--expert-model-parallel-size", 1, int, to=TC),
    Flag("--expert-tensor-parallel-size", None, int, to=TC,
         help="tensor parallelism inside the experts (default: --tensor-model-parallel-size)"),
    Flag("--use-tp-pp-dp-mapping", help="order ranks tensor, pipeline, then data parallel "
                                        "(default: data before pipeline)"),
    Flag("--distributed-backend", None, str, choices=("nccl", "gloo"),
         help="default: nccl when CUDA is present, else gloo"),
    Flag("--distributed-timeout-minutes", 10, int),
    Flag("--disable-gloo-process-groups", True, dest="use_gloo_process_groups",
         help="do not create megatron-core's extra gloo process groups"),
    Flag("--use-cpu-initialization", None, help="initialise weights on the CPU (always so without CUDA)"),
    Flag("--use-distributed-optimizer",
         help="shard the optimizer state (and fp32 main params) across data-parallel ranks"),
    Flag("--num-distributed-optimizer-instances", 1, int, to=DDP,
         help="copies of the distributed optimizer's state across the data-parallel ranks"),
    Flag("--overlap-grad-reduce", to=DDP, help="reduce gradient buckets during the backward pass"),
    Flag("--overlap-param-gather", to=DDP,
         help="gather updated parameters during the next forward pass (distributed optimizer)"),
    Flag("--overlap-param-gather-with-optimizer-step", to=OC,
         help="start the first bucket's parameter gather during the optimizer step (interleaved schedule)"),
    Flag("--accumulate-allreduce-grads-in-fp32",
         help="keep and reduce gradients in fp32 (always so under --bf16 unless --grad-reduce-in-bf16)"),
    Flag("--grad-reduce-in-bf16", help="under --bf16, keep and reduce gradients in bf16"),
    Flag("--ddp-bucket-size", None, int, "elements per gradient bucket (default: max(40M, 1M x "
                                         "data-parallel size))", to=DDP, field="bucket_size"),
    Flag("--ddp-average-in-collective", to=DDP, field="average_in_collective",
         help="average gradients inside the collective instead of scaling before it"),
    Flag("--use-megatron-fsdp", refuse=FSDP),
    Flag("--use-torch-fsdp2", help="shard parameters, gradients and optimizer state across data-parallel "
                                   "ranks with torch's FSDP2 (fully_shard) instead of megatron-core's DDP"),
    Flag("--torch-fsdp2-no-reshard-after-forward", True, dest="torch_fsdp2_reshard_after_forward",
         help="with --use-torch-fsdp2, keep the gathered parameters from the forward pass to the backward "
              "(ZeRO-2: more memory, one all-gather less)"),
    Flag("--data-parallel-sharding-strategy", "optim_grads_params", str,
         choices=("no_shard", "optim", "optim_grads", "optim_grads_params"), help=WITH_FSDP),
    Flag("--outer-dp-sharding-strategy", "no_shard", str, choices=("no_shard", "optim"), help=WITH_FSDP),
    *(Flag(name, default, str, choices=("fp32", "bf16", "fp16", "auto"), help=WITH_FSDP)
      for name, default in (
        ("--megatron-fsdp-main-params-dtype", "fp32"), ("--megatron-fsdp-main-grads-dtype", "auto"),
        ("--megatron-fsdp-grad-comm-dtype", "auto"))),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "distributed", FLAGS)


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) <= 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be positive")


def validate(args: argparse.Namespace, world_size: int) -> None:
    _positive(args, "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
              "expert_model_parallel_size", "distributed_timeout_minutes",
              "num_distributed_optimizer_instances")
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
    args.world_size = world_size
    args.data_parallel_size = world_size // model_parallel
    _validate_data_parallel_engine(args)
    _validate_experts(args)
    training.validate_batch_sizes(args, args.data_parallel_size)
    if args.virtual_pipeline_model_parallel_size is not None:
        _validate_interleaved_microbatches(args)


def _validate_interleaved_microbatches(args: argparse.Namespace) -> None:
    """megatron-core's interleaved schedule runs the microbatches in groups of
    --microbatch-group-size-per-virtual-pipeline-stage (default: PP): a group is PP to M microbatches long,
    and the last one is whole or at least PP long. With --step-batch-size-schedule, for each of its sizes."""
    pp = args.pipeline_model_parallel_size
    group = args.microbatch_group_size_per_vp_stage or pp
    named = "--microbatch-group-size-per-virtual-pipeline-stage" if args.microbatch_group_size_per_vp_stage \
        else "--pipeline-model-parallel-size"
    sized_by = "--step-batch-size-schedule's batch size" if args.step_batch_size_schedule is not None \
        else "--global-batch-size"
    for _, batch in batch_schedule.schedule(args).steps:
        microbatches = batch_schedule.num_microbatches(args, batch)
        if not pp <= group <= microbatches or 0 < microbatches % group < pp:
            raise ArgumentError(
                f"the interleaved pipeline schedule runs the microbatches ({microbatches} = {sized_by} "
                f"{batch} / (--micro-batch-size x data-parallel size)) in groups of {named} {group}: need "
                f"--pipeline-model-parallel-size {pp} <= {group} <= {microbatches}, and a last group of "
                f"{group} or at least {pp}")


def _validate_pipeline(args: argparse.Namespace) -> None:
    """Megatron-LM's checks of how layers split over pipeline stages and virtual stages: evenly, with the
    embedding and the loss counted as layers if asked, or unevenly with given first and last stages."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    uneven = first is not None or last is not None
    counted = layers + args.account_for_embedding_in_pipeline_split + args.account_for_loss_in_pipeline_split
    if uneven and counted != layers:
        raise ArgumentError("--decoder-first/last-pipeline-num-layers and --account-for-embedding/loss-in-"
                            "pipeline-split are two ways to split the layers; pick one")
    per_virtual = args.num_layers_per_virtual_pipeline_stage
    virtual = args.num_virtual_stages_per_pipeline_rank
    if per_virtual is not None and virtual is not None:
        raise ArgumentError("give --num-layers-per-virtual-pipeline-stage or "
                            "--num-virtual-stages-per-pipeline-rank, not both")
    if args.pipeline_model_parallel_layout is not None:
        if per_virtual is not None or virtual is not None or uneven or counted != layers:
            raise ArgumentError("--pipeline-model-parallel-layout gives the whole split: drop "
                                "--num-layers-per-virtual-pipeline-stage, "
                                "--num-virtual-stages-per-pipeline-rank, --decoder-first/last-pipeline-num-"
                                "layers and --account-for-embedding/loss-in-pipeline-split")
        virtual = _layout_virtual_stages(args)
    else:
        virtual = _virtual_stages(args, counted, uneven)
    if virtual is not None and pp == 1:
        raise ArgumentError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
    args.virtual_pipeline_model_parallel_size = virtual if virtual is not None and virtual > 1 else None
    if uneven:
        _validate_uneven_stages(args, first, last)
    if args.virtual_pipeline_model_parallel_size is None:
        args.overlap_p2p_comm = False  # Megatron-LM: only the interleaved schedule overlaps p2p
    elif not args.overlap_p2p_comm and pp <= 2:
        # Two batched sends to the same peer get crossed (Megatron-LM #750): Megatron-LM refuses it too.
        raise ArgumentError("--no-overlap-p2p-communication with the interleaved schedule needs "
                            f"--pipeline-model-parallel-size > 2, not {pp}")
    if args.overlap_p2p_comm_warmup_flush and not args.overlap_p2p_comm:
        raise ArgumentError("--overlap-p2p-communication-warmup-flush needs the interleaved schedule with "
                            "p2p overlap (virtual stages, without --no-overlap-p2p-communication)")


def _virtual_stages(args: argparse.Namespace, counted: int, uneven: bool) -> int | None:
    """The virtual stages per pipeline rank the flags ask for (None: no interleaving), the layers split
    evenly or with given first and last stages."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    per_virtual = args.num_layers_per_virtual_pipeline_stage
    virtual = args.num_virtual_stages_per_pipeline_rank
    if not uneven and counted % pp:
        what = f"--num-layers {layers}" + (f" (+ embedding and loss: {counted})" if counted != layers else "")
        raise ArgumentError(f"{what} is not divisible by --pipeline-model-parallel-size {pp}")
    per_stage = counted // pp
    if per_virtual is not None:
        if uneven:
            raise ArgumentError("with --decoder-first/last-pipeline-num-layers, give virtual stages with "
                                "--num-virtual-stages-per-pipeline-rank (as in Megatron-LM)")
        if per_virtual <= 0 or per_stage % per_virtual:
            raise ArgumentError(
                f"--num-layers-per-virtual-pipeline-stage {per_virtual} does not divide the {per_stage} "
                f"layers of each pipeline stage (--num-layers {layers} / "
                f"--pipeline-model-parallel-size {pp})")
        return per_stage // per_virtual
    if virtual is not None and (virtual <= 0 or (not uneven and per_stage % virtual)):
        raise ArgumentError(
            f"--num-virtual-stages-per-pipeline-rank {virtual} does not divide the {per_stage} layers of "
            f"each pipeline stage (--num-layers {layers} / --pipeline-model-parallel-size {pp})")
    return virtual


def _layout_virtual_stages(args: argparse.Namespace) -> int | None:
    """Megatron-LM's checks of --pipeline-model-parallel-layout, parsed as megatron-core's
    PipelineParallelLayerLayout.parse_str_to_list does (commas cosmetic, "(..)*n" and "x*n" repeat, stages
    split by "|"); megatron-core checks the rest (where E, L and m stand) when it builds the config.
    The virtual stages per pipeline rank (None: one stage per rank)."""
    layout, pp = args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size
    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda match: match.group(1) * int(match.group(2)), text)
    stages = text.split("|")
    unknown = sorted(set(text) - set("EtmL|"))
    if unknown:
        raise ArgumentError(f"--pipeline-model-parallel-layout {layout}: unknown layer {' '.join(unknown)}; "
                            "use E (embedding), t (transformer layer), m (multi-token prediction), L (loss)")
    if len(stages) % pp:
        raise ArgumentError(f"--pipeline-model-parallel-layout {layout} has {len(stages)} stages, not a "
                            f"multiple of --pipeline-model-parallel-size {pp}")
    if text.count("t") != args.num_layers:
        raise ArgumentError(f"--pipeline-model-parallel-layout {layout} places {text.count('t')} transformer "
                            f"layers, not --num-layers {args.num_layers}")
    return len(stages) // pp if len(stages) > pp else None


def _validate_uneven_stages(args: argparse.Namespace, first: int | None, last: int | None) -> None:
    """megatron-core's TransformerConfig checks, in one line each: the middle stages split the rest evenly."""
    middle_layers, middle_stages = args.num_layers, args.pipeline_model_parallel_size
    virtual = args.virtual_pipeline_model_parallel_size or 1
    for flag, count in (("--decoder-first-pipeline-num-layers", first),
                        ("--decoder-last-pipeline-num-layers", last)):
        if count is None:
            continue
        if count <= 0 or count % virtual:
            raise ArgumentError(f"{flag} {count} must be positive and divisible by the {virtual} virtual "
                                "stages")
        middle_layers -= count
        middle_stages -= 1
    if bool(middle_layers > 0) != bool(middle_stages > 0) or middle_layers < 0 or \
            (middle_stages and middle_layers % (middle_stages * virtual)):
        raise ArgumentError(f"--num-layers {args.num_layers} minus the first and last stages' layers leaves "
                            f"{middle_layers} for {middle_stages} middle pipeline stages (x {virtual} "
                            "virtual): "
                            "they must split evenly")


def _validate_sequence_and_context(args: argparse.Namespace) -> None:
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and tp == 1:
        # Megatron-LM's adjustment, and its warning, word for word.
        warn("Disabling sequence parallelism because tensor model parallelism is disabled")
        args.sequence_parallel = False
    if args.sequence_parallel and args.seq_length % tp:
        raise ArgumentError(f"--sequence-parallel needs --seq-length {args.seq_length} divisible by "
                            f"--tensor-model-parallel-size {tp}")
    if len(args.cp_comm_type) == 1:
        args.cp_comm_type = args.cp_comm_type[0]
    if args.hierarchical_context_parallel_sizes and \
            math.prod(args.hierarchical_context_parallel_sizes) != args.context_parallel_size:
        raise ArgumentError(f"--hierarchical-context-parallel-sizes "
                            f"{' '.join(map(str, args.hierarchical_context_parallel_sizes))} must multiply "
                            "to "
                            f"--context-parallel-size {args.context_parallel_size}")
    if "a2a+p2p" in args.cp_comm_type and not args.hierarchical_context_parallel_sizes:
        raise ArgumentError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes")
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


def _validate_overlap_with_optimizer_step(args: argparse.Namespace) -> None:
    """Megatron-LM's conditions, in its order."""
    flag = "--overlap-param-gather-with-optimizer-step"
    if not args.use_distributed_optimizer:
        raise ArgumentError(f"{flag} needs --use-distributed-optimizer")
    if not args.overlap_param_gather:
        raise ArgumentError(f"{flag} needs --overlap-param-gather")
    if args.virtual_pipeline_model_parallel_size is None:
        raise ArgumentError(f"{flag} needs the interleaved pipeline schedule (--num-layers-per-virtual-"
                            "pipeline-stage or --num-virtual-stages-per-pipeline-rank)")
    if args.ckpt_format != "torch":
        # Megatron-LM refuses it with every distributed checkpoint format, so with all of ours.
        raise ArgumentError(f"{flag} is not supported with distributed checkpointing (as in Megatron-LM, "
                            "which allows it with --ckpt-format torch only): add --ckpt-format torch")


def _validate_data_parallel_engine(args: argparse.Namespace) -> None:
    if args.use_torch_fsdp2:
        _validate_torch_fsdp2(args)
    if args.overlap_param_gather and not (args.use_distributed_optimizer
                                          or args.use_layer_wise_distributed_optimizer):
        raise ArgumentError("--overlap-param-gather needs --use-distributed-optimizer")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise ArgumentError("--overlap-param-gather needs --overlap-grad-reduce")
    if args.overlap_param_gather_with_optimizer_step:
        _validate_overlap_with_optimizer_step(args)
    if args.ddp_bucket_size is not None and args.ddp_bucket_size <= 0:
        raise ArgumentError("--ddp-bucket-size must be positive")
    if args.num_distributed_optimizer_instances > 1:
        if not args.use_distributed_optimizer:
            raise ArgumentError("--num-distributed-optimizer-instances needs --use-distributed-optimizer")
        if args.data_parallel_size % args.num_distributed_optimizer_instances:
            raise ArgumentError(f"--num-distributed-optimizer-instances "
                                f"{args.num_distributed_optimizer_instances} does not divide the "
                                "data-parallel "
                                f"size {args.data_parallel_size}")
    # Megatron-LM: under bf16, gradients are kept and reduced in fp32 unless --grad-reduce-in-bf16.
    if args.grad_reduce_in_bf16:
        if not args.bf16:
            raise ArgumentError("--grad-reduce-in-bf16 needs --bf16")
        args.accumulate_allreduce_grads_in_fp32 = False
    elif args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True


def _validate_experts(args: argparse.Namespace) -> None:
    ep = args.expert_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    etp = args.expert_tensor_parallel_size
    if etp <= 0:
        raise ArgumentError("--expert-tensor-parallel-size must be positive")
    if args.num_experts is None:
        if ep > 1:
            raise ArgumentError("--expert-model-parallel-size > 1 needs --num-experts")
        return
    if args.num_experts % ep:
        raise ArgumentError(f"--num-experts {args.num_experts} is not divisible by "
                            f"--expert-model-parallel-size {ep}")
    # megatron-core's expert groups: expert-tensor x expert x pipeline ranks must tile the world.
    pp = args.pipeline_model_parallel_size
    if args.world_size % (etp * ep * pp):
        raise ArgumentError(
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} x "
            f"--pipeline-model-parallel-size {pp} does not divide the world size {args.world_size}")


def _validate_torch_fsdp2(args: argparse.Namespace) -> None:
    """Megatron-LM's checks of --use-torch-fsdp2, in its order and with its reasons."""
    fsdp2 = "--use-torch-fsdp2"
    for refused, reason in (
            (args.pipeline_model_parallel_size != 1, "is not supported with pipeline parallelism; use "
                                                     "--pipeline-model-parallel-size 1"),
            (args.expert_model_parallel_size != 1, "is not supported with expert parallelism; use "
                                                   "--expert-model-parallel-size 1"),
            (args.use_distributed_optimizer, "shards the optimizer state itself: drop "
                                             "--use-distributed-optimizer"),
            (args.gradient_accumulation_fusion, "is not supported with gradient accumulation fusion: add "
                                                "--no-gradient-accumulation-fusion"),
            (args.ckpt_format != "torch_dist", f"needs --ckpt-format torch_dist, not {args.ckpt_format} "
                                               "(Megatron-LM also takes torch_dcp, not supported here)"),
            (not args.untie_embeddings_and_output_weights, "needs --untie-embeddings-and-output-weights"),
            (args.fp16, "is not supported with --fp16 (as in Megatron-LM); use --bf16"),
            (os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1",
             "needs CUDA_DEVICE_MAX_CONNECTIONS unset or larger than 1, not 1")):
        if refused:
            raise ArgumentError(f"{fsdp2} {reason}")
