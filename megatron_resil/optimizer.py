"""AdamW with Megatron's semantics on every backend: data-parallel gradient averaging, a
tensor-parallel-aware global grad norm, clipping, fp32 main params under --bf16, and a sharded
optimizer state that torch_dist can save and reload under the same parallel layout.

megatron-core's own optimizers and DDP allocate on CUDA throughout; this one runs on CPU and GPU alike.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


class Optimizer:
    def __init__(self, model: torch.nn.Module, args: argparse.Namespace) -> None:
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        # Under bf16 the optimizer updates fp32 copies; otherwise the params themselves.
        self.mixed_precision = any(p.dtype != torch.float32 for p in self.model_params)
        if self.mixed_precision:
            self.main_params = [p.detach().clone().float().requires_grad_() for p in self.model_params]
        else:
            self.main_params = self.model_params
        decay = [p for p in self.main_params if p.dim() > 1]
        no_decay = [p for p in self.main_params if p.dim() <= 1]  # biases and norms, as in Megatron
        self.adam = torch.optim.AdamW(
            [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
            lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
            weight_decay=args.weight_decay)
        self.clip_grad = args.clip_grad
        # Called first thing in step(), before its first collective: where a rank's own work of the
        # iteration ends for the straggler detector (straggler.py). None: nothing to call.
        self.before_step: Callable[[], None] | None = None

    @property
    def param_groups(self) -> list[dict]:
        return self.adam.param_groups

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None

    def own_work_done(self) -> None:
        """This rank's own work for the iteration ends here, before any collective (the straggler
        timing's end point; later calls in the same iteration are no-ops there)."""
        if self.before_step is not None:
            self.before_step()

    def step(self) -> float:
        """Average gradients over data-parallel ranks, clip, update. Returns the global grad norm."""
        self.own_work_done()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model_params]
        dp_group = parallel_state.get_data_parallel_group()
        if dist.get_world_size(dp_group) > 1:
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=dp_group)
            flat /= dist.get_world_size(dp_group)
            grads = list(_unflatten_dense_tensors(flat, grads))
        for main, grad in zip(self.main_params, grads, strict=True):
            main.grad = grad.float() if self.mixed_precision else grad
        grad_norm = self._global_grad_norm()
        if self.clip_grad > 0 and math.isfinite(grad_norm):
            coeff = self.clip_grad / (grad_norm + 1e-6)
            if coeff < 1.0:
                for p in self.main_params:
                    p.grad.mul_(coeff)
        self.adam.step()
        if self.mixed_precision:
            with torch.no_grad():
                for model_p, main_p in zip(self.model_params, self.main_params, strict=True):
                    model_p.copy_(main_p)
        return grad_norm

    def _global_grad_norm(self) -> float:
        # Params replicated across tensor-parallel ranks are counted once, as Megatron does.
        squares = [p.grad.float().pow(2).sum() for p in self.main_params
                   if param_is_not_tensor_parallel_duplicate(p) or _is_duplicate_owner()]
        local = torch.stack(squares).sum() if squares else torch.zeros((), device=self.main_params[0].device)
        mp_group = parallel_state.get_model_parallel_group()
        if dist.get_world_size(mp_group) > 1:
            dist.all_reduce(local, group=mp_group)
        return float(local.sqrt())

    def _ensure_state(self) -> None:
        """Create zero Adam state so a load has tensors to fill (a fresh optimizer has none)."""
        for p in self.main_params:
            state = self.adam.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                for key in _ADAM_KEYS:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def sharded_state_dict(self, model_sharded_state_dict: dict) -> dict:
        self._ensure_state()
        id_to_sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.model_params)
        state = {}
        for idx, main in enumerate(self.main_params):
            per_param = {key: make_sharded_optimizer_tensor(
                id_to_sharded[idx], self.adam.state[main][key], prefix=f"optimizer.state.{key}")
                for key in _ADAM_KEYS}
            if self.mixed_precision:
                per_param["fp32_param"] = make_sharded_optimizer_tensor(
                    id_to_sharded[idx], main.detach(), prefix="optimizer.state.fp32_param")
            state[idx] = per_param
        step = float(self.adam.state[self.main_params[0]]["step"])
        return {"state": state, "step": step}

    def load_sharded_state_dict(self, loaded: dict) -> None:
        with torch.no_grad():
            for idx, main in enumerate(self.main_params):
                state = self.adam.state[main]
                for key in _ADAM_KEYS:
                    state[key].copy_(loaded["state"][idx][key])
                state["step"] = torch.tensor(float(loaded["step"]), dtype=torch.float32)
                if self.mixed_precision:
                    main.copy_(loaded["state"][idx]["fp32_param"])
                    self.model_params[idx].copy_(main)


def _is_duplicate_owner() -> bool:
    return parallel_state.get_tensor_model_parallel_rank() == 0


def build_scheduler(optimizer: Optimizer, args: argparse.Namespace) -> OptimizerParamScheduler:
    """Megatron's scheduler, stepped in samples as Megatron-LM does for iteration-based runs."""
    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
        wsd_decay_steps=(args.lr_wsd_decay_iters * gbs) if args.lr_wsd_decay_iters else None,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )
