"""megatron-core's data-parallel engine from the command line: model chunks wrapped in its
DistributedDataParallel (or, with --use-torch-fsdp2, its TorchFullyShardedDataParallel: torch's FSDP2), its
optimizer (Adam, the distributed optimizer with --use-distributed-optimizer, fp16 loss scaling, chained
with the experts' optimizer under MoE; Muon, layer-wise distributed with --use-distributed-optimizer) and
Megatron's LR scheduler, wired into the pipeline schedules' hooks as Megatron-LM wires them.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import get_model_config

from megatron_resil import events
from megatron_resil.arguments import FLAGS
from megatron_resil.arguments.flag_table import config_fields, config_kwargs


def ddp_config(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """The table rows that go to it (overlaps, bucket size, optimizer instances), and the rest."""
    extra = {"fp8_param_gather": args.fp8_param_gather} \
        if "fp8_param_gather" in config_fields("DistributedDataParallelConfig") else {}
    return DistributedDataParallelConfig(
        **config_kwargs(args, FLAGS, "DistributedDataParallelConfig"),
        # Under --bf16 true unless --grad-reduce-in-bf16, as Megatron-LM decides (arguments/distributed.py).
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # Megatron-LM's check of each rank's gradients before they are reduced, through the rerun state
        # machine (rerun.py turns it off while the post-load canary watches).
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        **extra,
    )


def wrap_in_ddp(chunks: list[MegatronModule], args: argparse.Namespace) -> list[DistributedDataParallel]:
    config = get_model_config(chunks[0])
    if args.use_torch_fsdp2:
        # As Megatron-LM: FSDP2 takes only whether to reshard after the forward pass from the DDP settings
        # (the flag checks keep one chunk: no pipeline parallelism).
        settings = TorchFullyShardedDataParallelConfig(
            reshard_after_forward=args.torch_fsdp2_reshard_after_forward)
        return [TorchFullyShardedDataParallel(config, settings, chunk) for chunk in chunks]
    ddp = ddp_config(args)
    layouts = [None] * len(chunks)
    if args.use_layer_wise_distributed_optimizer and args.use_layer_wise_param_layout:
        layouts = layer_wise_param_layouts(chunks, ddp)
    # As Megatron-LM: only the first chunk's buffers are split into buckets (none of them with
    # --overlap-param-gather-with-optimizer-step); the others' gradients are reduced in one piece, when their
    # last backward ends.
    every_chunk_whole = args.overlap_param_gather_with_optimizer_step
    return [DistributedDataParallel(config, ddp, chunk, disable_bucketing=index > 0 or every_chunk_whole,
                                    **({"full_param_layout": layout} if layout is not None else {}))
            for index, (chunk, layout) in enumerate(zip(chunks, layouts, strict=True))]


def layer_wise_param_layouts(chunks: list[MegatronModule], ddp: DistributedDataParallelConfig) -> list:
    """Muon with --use-distributed-optimizer, as Megatron-LM's wrap_model_chunks_with_ddp lays it out
    (unless --no-use-layer-wise-param-layout): each chunk's Muon-managed matrices in buffers whose
    data-parallel shards hold whole parameters (Newton-Schulz needs the whole matrix), the other
    parameters in the distributed optimizer's byte-sharded buffers; DDP reduce-scatters both. The
    bucket size is the one DDP will use (its default, none without --overlap-grad-reduce, and none for
    chunks after the first or on later pipeline stages)."""
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer,
        tag_params_for_buffer_routing,
    )

    ddp.use_distributed_optimizer = True  # the reduce-scatter into shards, and the buffers' padding
    tag_params_for_buffer_routing(chunks)
    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    bucket_size = ddp.bucket_size if ddp.bucket_size is not None else max(40_000_000, 1_000_000 * dp_size)
    if not ddp.overlap_grad_reduce or parallel_state.get_pipeline_model_parallel_rank() > 0:
        bucket_size = None
    return [LayerWiseDistributedOptimizer.compute_full_param_layout(
                [p for p in chunk.parameters() if p.requires_grad], bucket_size if index == 0 else None,
                dp_size, ddp,
                expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size())
            for index, chunk in enumerate(chunks)]


def optimizer_config(args: argparse.Namespace, timers=None) -> OptimizerConfig:
    """The table rows that go to it (learning rates, Adam's, SGD's and Muon's settings, loss scaling,
    counting the zeros in the gradients), and the rest."""
    # megatron-core 0.19's field; an older one is refused --optimizer muon (arguments/training.py).
    layer_wise = {"use_layer_wise_distributed_optimizer": args.use_layer_wise_distributed_optimizer} \
        if "use_layer_wise_distributed_optimizer" in config_fields("OptimizerConfig") else {}
    return OptimizerConfig(
        **config_kwargs(args, FLAGS, "OptimizerConfig"),
        **layer_wise,
        optimizer=args.optimizer,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        timers=timers,
    )


def build_optimizer(chunks: list[DistributedDataParallel], args: argparse.Namespace,
                    timers=None) -> MegatronOptimizer:
    """megatron-core's optimizer for the chunks, and the schedules' hooks set as Megatron-LM sets them;
    `timers`: megatron-core's Timers that time its steps (--timing-log-level), or None."""
    config = get_model_config(chunks[0])
    optimizer_settings = optimizer_config(args, timers)
    optimizer = get_megatron_optimizer(optimizer_settings, chunks,
                                       **_mup_overrides(optimizer_settings, config),
                                       use_gloo_process_groups=args.use_gloo_process_groups)
    one_or_list = (lambda fns: fns[0]) if len(chunks) == 1 else list
    config.no_sync_func = one_or_list([chunk.no_sync for chunk in chunks])
    if args.overlap_grad_reduce:
        config.grad_sync_func = one_or_list([chunk.start_grad_sync for chunk in chunks])
    if args.overlap_param_gather:
        config.param_sync_func = one_or_list([chunk.start_param_sync for chunk in chunks])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return optimizer


def _mup_overrides(settings: OptimizerConfig, model_config) -> dict:
    """Under --use-mup, as Megatron-LM's setup_model_and_optimizer: megatron-core's standard parameter groups
    (no weight decay on biases and norms, --decoupled-lr) plus its MuP groups, whose learning rates (and
    Adam's epsilon) are scaled by the width multiplier. megatron-core 0.19 has them; the flag check
    refused --use-mup on a megatron-core without."""
    if not getattr(model_config, "use_mup", False):
        return {}
    from megatron.core.optimizer import get_mup_config_overrides, get_standard_config_overrides

    return {"config_overrides": {**get_standard_config_overrides(settings),
                                 **get_mup_config_overrides(settings, model_config.mup_width_mult,
                                                            settings.optimizer)}}


def before_grad_finalize(chunks: list[DistributedDataParallel], callback: Callable[[], None]) -> None:
    """Call `callback` when this rank's forward and backward work of a step is done, before it waits for
    its peers' gradients (the straggler timing's end point)."""
    config = get_model_config(chunks[0])
    finalize = config.finalize_model_grads_func

    def finalize_after_callback(*args, **kwargs):
        callback()
        return finalize(*args, **kwargs)

    config.finalize_model_grads_func = finalize_after_callback


@contextlib.contextmanager
def params_in_sync(chunks: list[DistributedDataParallel], args: argparse.Namespace) -> Iterator[None]:
    """With --overlap-param-gather, the distributed optimizer's updated parameters reach the model only
    as the next forward pass gathers them. A checkpoint or an evaluation in between must see them:
    gather now, and let the next training step overlap again."""
    if not args.overlap_param_gather:
        yield
        return
    for chunk in chunks:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in chunks:
            chunk.enable_forward_pre_hook()


def learning_rate(optimizer: MegatronOptimizer) -> float:
    """The learning rate Megatron-LM logs: the first group on the default schedule (not one --decoupled-lr
    or MuP scales), where megatron-core marks them."""
    groups = optimizer.param_groups
    return next((group["lr"] for group in groups if group.get("default_config")), groups[0]["lr"])


def schedule_steps(args: argparse.Namespace) -> dict[str, float | None]:
    """The scheduler's step counts as Megatron-LM's get_optimizer_param_scheduler gives them: in samples
    (the scheduler steps by the global batch size), from the iteration flags times the global batch size,
    or from the sample flags as they are with --train-samples. --lr-warmup-fraction is a fraction of the
    decay."""
    if args.train_samples is None:
        gbs = args.global_batch_size
        decay, total, warmup = args.lr_decay_iters * gbs, args.train_iters * gbs, args.lr_warmup_iters * gbs
        wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
    else:
        decay, total, warmup = args.lr_decay_samples, args.train_samples, args.lr_warmup_samples
        wsd = args.lr_wsd_decay_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return {"lr_warmup_steps": warmup, "lr_decay_steps": decay, "wd_incr_steps": total,
            "wsd_decay_steps": wsd}


def build_scheduler(optimizer: MegatronOptimizer, args: argparse.Namespace) -> OptimizerParamScheduler:
    """Megatron's scheduler, stepped in samples as Megatron-LM steps it. On resume the schedule must match
    the checkpoint's (checkpointing/resumed_schedule.py), unless --use-checkpoint-opt_param-scheduler takes
    the checkpoint's or --override-opt_param-scheduler this command line's."""
    if args.train_samples is not None:  # said where Megatron-LM says it, as the scheduler is built
        events.print_rank_0(f"setting training iterations to {args.train_iters}")
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_style="constant",
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        **schedule_steps(args),
    )
