"""Megatron-format training and validation logs: the iteration line (with Megatron-LM's optional fields:
throughput, num zeros, params norm), its timers (--timing-log-level), TensorBoard scalars under
Megatron-LM's names, and Weights & Biases; plus tokens/s (ours) at the end of the line."""

from __future__ import annotations

import argparse
import math
import os
import time
from datetime import datetime

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.timers import Timers
from megatron.core.transformer.module import param_is_not_shared
from torch.distributed.tensor import DTensor

from megatron_resil import events, parallel

# Megatron-LM's timers per --timing-log-level (megatron-core's schedules, DDP and optimizer time them too).
TIMERS = {1: ["forward-backward", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
              "all-grads-sync", "params-all-gather", "optimizer-copy-to-main-grad",
              "optimizer-unscale-and-check-inf",
              "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
              "optimizer-copy-main-to-model-params", "optimizer"],
          2: ["batch-generator", "forward-compute", "backward-compute", "forward-recv", "forward-send",
              "backward-recv", "backward-send", "forward-send-forward-recv", "forward-send-backward-recv",
              "backward-send-forward-recv", "backward-send-backward-recv",
              "forward-backward-send-forward-backward-recv"]}


def json_safe(value: float) -> float | str:
    """A float strict JSON readers accept: NaN and Inf become the strings "nan", "inf", "-inf" (not null,
    so a log still tells a NaN loss from an overflow; json.dumps would write bare NaN, which is not JSON)."""
    return value if math.isfinite(value) else str(value)


def timers_for(args: argparse.Namespace) -> Timers | None:
    """megatron-core's timers at --timing-log-level (None at level 0: the iteration time is ours)."""
    return Timers(args.timing_log_level, args.timing_log_option) if args.timing_log_level > 0 else None


def params_l2_norm(chunks: list, bf16: bool) -> float:
    """Megatron-LM's calc_params_l2_norm: every weight counted once (tensor-parallel copies and shared
    embeddings skipped), the distributed optimizer's fp32 shards where they exist under bf16, summed over
    the data-parallel ranks for those shards and over the model-parallel ranks (experts over theirs).
    Under --use-torch-fsdp2 each rank's shards of the weights are summed over the data-parallel ranks too,
    so the norm is the whole model's, as without FSDP2 (Megatron-LM's counts only the local shards).
    Collective on every rank."""
    dense, dense_sharded, expert, expert_sharded = [], [], [], []
    for chunk in chunks:
        for param in chunk.parameters():
            if not param_is_not_tensor_parallel_duplicate(param):
                continue
            is_expert = not getattr(param, "allreduce", True)
            if not is_expert and not param_is_not_shared(param):
                continue
            data, sharded = param.data.float(), False
            if isinstance(param, DTensor):  # --use-torch-fsdp2: this rank's shard of the weight
                data, sharded = param.to_local().float(), True
            elif bf16 and hasattr(param, "main_param"):
                sharded = getattr(param, "main_param_sharded", False)
                data = param.main_param
                if data is None:
                    continue
            ((expert_sharded if sharded else expert) if is_expert else
             (dense_sharded if sharded else dense)).append(data)

    def norm_2(tensors: list) -> torch.Tensor:
        total = torch.zeros(1, dtype=torch.float32, device=parallel.device())
        for tensor in tensors:
            total += tensor.float().pow(2).sum()
        return total

    dense_2, expert_2 = norm_2(dense), norm_2(expert)
    sharded_2, expert_sharded_2 = norm_2(dense_sharded), norm_2(expert_sharded)
    dist.all_reduce(sharded_2, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    dist.all_reduce(expert_sharded_2, group=parallel_state.get_expert_data_parallel_group())
    dense_2 += sharded_2
    expert_2 += expert_sharded_2
    dense_group = parallel_state.get_model_parallel_group()
    expert_group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
    if dist.get_process_group_ranks(dense_group) == dist.get_process_group_ranks(expert_group):
        dense_2 += expert_2
        dist.all_reduce(dense_2, group=dense_group)
    else:
        dist.all_reduce(dense_2, group=dense_group)
        dist.all_reduce(expert_2, group=expert_group)
        dense_2 += expert_2
    return float(dense_2.item()) ** 0.5


def floating_point_operations(args: argparse.Namespace, batch_size: int) -> float:
    """Megatron-LM's num_floating_point_operations for one global batch (forward and backward) of the models
    built here: dense or MoE layers, grouped-query or multi-latent attention (gated delta net in the layers
    --linear-attention-freq gives it), multi-token prediction."""
    tokens = batch_size * args.seq_length
    if args.num_experts is None:
        dense_layers, moe_layers, routed, last_is_moe = args.num_layers, 0, 0, 0
    else:
        pattern = args.moe_layer_freq if isinstance(args.moe_layer_freq, list) else \
            [1 if i % args.moe_layer_freq == 0 else 0 for i in range(args.num_layers)]
        moe_layers = sum(pattern)
        dense_layers, routed, last_is_moe = args.num_layers - moe_layers, args.moe_router_topk, pattern[-1]
    mtp = args.mtp_num_layers or 0
    moe_layers += last_is_moe * mtp
    dense_layers += (1 - last_is_moe) * mtp
    layers = args.num_layers + mtp
    moe_ffn = args.moe_ffn_hidden_size if args.moe_ffn_hidden_size is not None else args.ffn_hidden_size
    shared_ffn = args.moe_shared_expert_intermediate_size or 0
    fwd_bwd, fma = 3, 2
    ffn_expansion = 3 if args.swiglu else 2
    h, heads = args.hidden_size, args.num_attention_heads
    if args.multi_latent_attention:
        qk = args.qk_head_dim + args.qk_pos_emb_head_dim
        q_term = h * heads * qk if args.q_lora_rank is None else args.q_lora_rank * (h + heads * qk + 1)
        kv_term = args.kv_lora_rank * (h + heads * (args.qk_head_dim + args.v_head_dim) + 1)
        attention = fwd_bwd * fma * (q_term + kv_term
                                     + h * args.qk_pos_emb_head_dim + heads * args.v_head_dim * h)
        attention_core = fwd_bwd * fma * (heads * qk / 2 + heads * args.v_head_dim / 2)
    else:
        query = args.kv_channels * heads
        key_value = 2 * args.kv_channels * args.num_query_groups
        gate = query if args.attention_output_gate else 0
        attention = fwd_bwd * fma * (h * (query + key_value + gate) + query * h)
        attention_core = fwd_bwd * fma * query / 2 * 2
    linear_layers, linear_attention = _gated_delta_net(args, layers)
    full_layers = layers - linear_layers
    return (tokens * (fwd_bwd * fma * h * (args.ffn_hidden_size * ffn_expansion * dense_layers
                                           + moe_ffn * routed * ffn_expansion * moe_layers
                                           + shared_ffn * ffn_expansion * moe_layers)
                      + attention * full_layers + linear_attention * linear_layers
                      + fwd_bwd * fma * mtp * (3 * h + 2 * h * h)
                      + fwd_bwd * fma * h * args.padded_vocab_size * (mtp + 1))
            + batch_size * args.seq_length * args.seq_length * attention_core * full_layers)


def _gated_delta_net(args: argparse.Namespace, layers: int) -> tuple[int, float]:
    """How many of the layers (multi-token prediction's counted, as Megatron-LM counts them) are gated delta
    net, and the FLOPs of one per token: projections, convolution and the delta rule, no L^2 term."""
    variant = args.experimental_attention_variant
    if variant not in ("gdn", "gdn2", "gated_delta_net"):
        return 0, 0.0
    freq = args.linear_attention_freq
    pattern = freq if isinstance(freq, list) else [0 if (i + 1) % freq == 0 else 1 for i in range(layers)]
    qk = args.linear_key_head_dim * args.linear_num_key_heads
    v = args.linear_value_head_dim * args.linear_num_value_heads
    in_proj = 4 * qk + 3 * v if variant == "gdn2" else 2 * qk + 2 * v + 2 * args.linear_num_value_heads
    per_token = (args.hidden_size * in_proj + args.linear_conv_kernel_dim * (2 * qk + v)
                 + args.linear_num_value_heads * args.linear_value_head_dim ** 2 * 4  # KK^T, VK^T, S, SQ
                 + args.hidden_size * v)
    return sum(pattern), 3 * 2 * per_token


class _Writers:
    """TensorBoard on rank 0 (where the iteration line is printed); Weights & Biases, as Megatron-LM, on the
    last rank (which holds the same reported values: training.StepReport)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.tensorboard = self.wandb = None
        # Megatron-LM logs the per-step and validation scalars to W&B inside its TensorBoard block: only
        # with --tensorboard-dir. The timers, throughput and multi-token prediction losses go there anyway.
        self.wandb_scalars = args.tensorboard_dir is not None
        if parallel.is_rank0() and args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir,
                                             max_queue=args.tensorboard_queue_size)
        if args.wandb_project and parallel.rank() == args.world_size - 1:
            self.wandb = _wandb_run(args)

    def scalar(self, name: str, value: float, iteration: int, samples: int | None = None,
               wandb: bool | None = None) -> None:
        """`name` at the iteration, and `name vs samples` at the consumed samples, as Megatron-LM writes;
        to W&B as well where Megatron-LM logs it there (`wandb`; default: with --tensorboard-dir)."""
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(name, value, iteration)
            if samples is not None:
                self.tensorboard.add_scalar(f"{name} vs samples", value, samples)
        if self.wandb is not None and (self.wandb_scalars if wandb is None else wandb):
            self.wandb.log({name: value}, step=iteration)

    def wandb_only(self, name: str, value: float, iteration: int) -> None:
        """A value Megatron-LM logs to W&B alone (not TensorBoard), with the per-step scalars."""
        if self.wandb is not None and self.wandb_scalars:
            self.wandb.log({name: value}, step=iteration)

    def wandb_module(self):
        """The wandb module where this rank logs to W&B (its current run is ours), else None."""
        if self.wandb is None:
            return None
        import wandb

        return wandb

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _wandb_run(args: argparse.Namespace):
    """Megatron-LM's wandb.init: files under --wandb-save-dir (default <save>/wandb), the run named
    --wandb-exp-name in --wandb-project (and --wandb-entity), every argument as its config, plus the Slurm
    job's name. wandb itself reads WANDB_MODE (offline, disabled), WANDB_API_KEY, WANDB_DIR and the rest."""
    import wandb

    save_dir = args.wandb_save_dir or os.path.join(args.save, "wandb")
    os.makedirs(save_dir, exist_ok=True)
    kwargs = {"dir": save_dir, "name": args.wandb_exp_name, "project": args.wandb_project,
              "config": vars(args)}
    if args.wandb_entity:
        kwargs["entity"] = args.wandb_entity
    run = wandb.init(**kwargs)
    run.config.update({"slurm_job_name": os.getenv("SLURM_JOB_NAME", "N/A")})
    return run


class TrainLogger:
    def __init__(self, args: argparse.Namespace, timers: Timers | None = None) -> None:
        self.args = args
        self.timers = timers
        self.skipped_in_interval = 0  # steps the fp16 loss scaler skipped since the last log line
        self.interval_start = time.perf_counter()
        self.iterations_in_interval = 0
        self.samples_in_interval = 0
        self.writers = _Writers(args)
        self.memory = args.log_memory_to_tensorboard and torch.cuda.is_available()
        self.timer_names = [name for level in (1, 2) if args.timing_log_level >= level
                            for name in TIMERS[level]]

    def restart_interval(self) -> None:
        """Time spent in eval or checkpointing is not charged to training iterations."""
        self.interval_start = time.perf_counter()
        self.iterations_in_interval = 0
        self.samples_in_interval = 0

    def training_step(self, iteration: int, consumed_samples: int, lr: float, report) -> None:
        """`report`: training.StepReport (loss, grad norm, auxiliary losses, loss scale, zeros in the
        gradients, weights' norm, the step's global batch size)."""
        args, loss, grad_norm, batch_size = self.args, report.loss, report.grad_norm, report.global_batch_size
        self.iterations_in_interval += 1
        self.samples_in_interval += batch_size
        self.skipped_in_interval += 0 if report.updated else 1
        if iteration % args.tensorboard_log_interval == 0:
            self._scalars(iteration, consumed_samples, lr, report)
        if iteration % args.log_interval:
            return
        elapsed = time.perf_counter() - self.interval_start
        per_iteration = elapsed / max(self.iterations_in_interval, 1)
        tokens = self.samples_in_interval * args.seq_length
        tokens_per_s = tokens / max(elapsed, 1e-9)
        line = (f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
                f" iteration {iteration:8d}/{args.train_iters:8d} |"
                f" consumed samples: {consumed_samples:12d} |"
                f" elapsed time per iteration (ms): {1000.0 * per_iteration:.1f} |")
        if args.log_timers_to_tensorboard:
            self.writers.scalar("iteration-time", per_iteration, iteration, wandb=True)
        if args.log_throughput:
            throughput = floating_point_operations(args, batch_size) / (
                max(per_iteration, 1e-9) * 10**12 * args.world_size)
            line += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
            if args.log_timers_to_tensorboard:
                self.writers.scalar("throughput", throughput, iteration, wandb=True)
        line += (f" learning rate: {lr:.6E} |"
                 f" global batch size: {batch_size:5d} |"
                 f" lm loss: {loss:.6E} |"
                 + "".join(f" {name}: {value:.6E} |" for name, value in report.moe_losses.items())
                 + f" loss scale: {report.loss_scale:.1f} |"
                 f" grad norm: {grad_norm:.3f} |")
        if report.num_zeros is not None:
            line += f" num zeros: {report.num_zeros} |"
        if report.params_norm is not None:
            line += f" params norm: {report.params_norm:.3f} |"
        line += (f" number of skipped iterations: {self.skipped_in_interval:3d} |"
                 f" tokens per second: {tokens_per_s:.1f} |")
        if parallel.is_rank0():
            print(line, flush=True)
        self._log_timers(iteration)
        # The run timeline (tools/timeline.py) plots these against wall time: one short line per interval.
        events.record("progress", iteration=iteration, loss=json_safe(loss), grad_norm=json_safe(grad_norm))
        self.restart_interval()
        self.skipped_in_interval = 0

    def _scalars(self, iteration: int, samples: int, lr: float, report) -> None:
        """Megatron-LM's TensorBoard scalars of a step, under its names."""
        args, write = self.args, self.writers.scalar
        self.writers.wandb_only("samples vs steps", samples, iteration)
        write("learning-rate", lr, iteration, samples)
        write("batch-size", report.global_batch_size, iteration, samples)
        write("lm loss", report.loss, iteration, samples)
        for name, value in report.moe_losses.items():  # megatron-core logs MTP's to W&B in any case
            write(name, value, iteration, wandb=True if name.startswith("mtp_") else None)
        if args.log_loss_scale_to_tensorboard:
            write("loss-scale", report.loss_scale, iteration, samples)
        if args.log_world_size_to_tensorboard:
            write("world-size", args.world_size, iteration, samples)
        write("grad-norm", report.grad_norm, iteration, samples)
        if report.num_zeros is not None:
            write("num-zeros", report.num_zeros, iteration, samples)
        if report.params_norm is not None:
            write("params-norm", report.params_norm, iteration, samples)
        if self.memory:
            stats = torch.cuda.memory_stats()
            write("mem-reserved-bytes", stats["reserved_bytes.all.current"], iteration, wandb=False)
            write("mem-allocated-bytes", stats["allocated_bytes.all.current"], iteration, wandb=False)
            write("mem-max-allocated-bytes", stats["allocated_bytes.all.peak"], iteration, wandb=False)
            write("mem-allocated-count", stats["allocation.all.current"], iteration, wandb=False)

    def _log_timers(self, iteration: int) -> None:
        """Megatron-LM's timer block (min and max over ranks, ms per iteration). Collective: every rank."""
        if self.timers is None or not self.timer_names:
            return
        interval = self.args.log_interval
        if self.args.log_timers_to_tensorboard:
            self.timers.write(self.timer_names, self.writers.tensorboard, iteration, normalizer=interval,
                              reset=False)
            if self.args.wandb_project:  # megatron-core's Timers.write logs to W&B given the wandb module
                self.timers.write(self.timer_names, self.writers.wandb_module(), iteration,
                                  normalizer=interval, reset=False)
        text = self.timers.get_all_timers_string(self.timer_names, normalizer=interval, reset=True,
                                                 barrier=False)
        if text and parallel.is_rank0():
            print(text, flush=True)

    def validation(self, iteration: int, loss: float, consumed_samples: int | None = None) -> None:
        ppl = math.exp(min(20.0, loss))
        text = (f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} |"
                f" lm loss PPL: {ppl:.6E} | ")
        self.writers.scalar("lm loss validation", loss, iteration, consumed_samples)
        if self.args.log_validation_ppl_to_tensorboard:
            self.writers.scalar("lm loss validation ppl", ppl, iteration, consumed_samples, wandb=False)
        if parallel.is_rank0():
            bar = "-" * len(text)
            print(f"{bar}\n{text}\n{bar}", flush=True)

    def close(self) -> None:
        self.writers.close()
