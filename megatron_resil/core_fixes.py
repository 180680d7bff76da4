"""Workarounds for megatron-core 0.16.1 bugs that strike on any device, each applied only where the bug is
present (checked by feature, so a release that fixes it is left alone). CPU-only accommodations live in
cpu_compat.py."""

from __future__ import annotations

import functools

import torch

_applied = False


def apply() -> None:
    global _applied
    if not _applied:
        _router_gemm_without_transformer_engine()
        _distributed_optimizer_on_torch_adam()
        _destroy_model_parallel_forgets_no_group()
        _distributed_optimizer_padding_saved_as_zeros()
        _applied = True


def _router_gemm_without_transformer_engine() -> None:
    """moe_utils' router GEMM tests `te_general_gemm is not None`, but the name is only bound when
    Transformer Engine imports: without TE every MoE forward raises NameError."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _distributed_optimizer_on_torch_adam() -> None:
    """Without Apex or Transformer Engine the distributed optimizer wraps torch's Adam, whose per-parameter
    `step` it mishandles twice:
    - `state_dict()` asserts that every parameter has one step count, which fails before the first step
      (no state at all): so a checkpoint cannot be loaded into a fresh optimizer. Empty, it reports 0.
    - `load_state_dict()` gives every parameter the same `step` tensor (torch's Adam then increments it
      once per parameter at each step), and then overwrites it with the template's step while copying the
      loaded tensors in: after a resume Adam's bias correction restarts from 0. Each parameter gets its
      own tensor holding the step the checkpoint records in its param groups.
    - loading the fully reshardable format copies every per-parameter state key from the checkpoint,
      which holds no `step` (it lives in the param groups): KeyError. The step is left to the above."""
    from megatron.core.optimizer import distrib_optimizer

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return
    optimizer_class = distrib_optimizer.DistributedOptimizer
    state_dict, load_state_dict = optimizer_class.state_dict, optimizer_class.load_state_dict

    @functools.wraps(state_dict)
    def state_dict_before_first_step(self):
        if self.optimizer.state:
            return state_dict(self)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for param in params:
            self.optimizer.state[param] = {"step": torch.tensor(0.0)}
        try:
            return state_dict(self)
        finally:
            self.optimizer.state.clear()

    @functools.wraps(load_state_dict)
    def load_state_dict_with_own_steps(self, saved):
        load_state_dict(self, saved)
        steps = {group.get("step") for group in saved.get("optimizer", {}).get("param_groups", [])} - {None}
        if len(steps) != 1:
            return
        (step,) = steps
        for param_state in self.optimizer.state.values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = torch.tensor(float(step), dtype=param_state["step"].dtype)

    set_states = optimizer_class._set_main_param_and_optimizer_states

    @functools.wraps(set_states)
    def set_states_but_step(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            own_step = self.optimizer.state.get(main_param, {}).get("step")
            if own_step is not None:
                tensors = {**tensors, "step": own_step}  # copied onto itself: unchanged
        return set_states(self, model_param, tensors)

    optimizer_class.state_dict = state_dict_before_first_step
    optimizer_class.load_state_dict = load_state_dict_with_own_steps
    optimizer_class._set_main_param_and_optimizer_states = set_states_but_step


def _destroy_model_parallel_forgets_no_group() -> None:
    """`parallel_state.destroy_model_parallel()` resets most of its group globals but not all of them
    (0.16.1 keeps `_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP` and its gloo twin, which DDP reduces
    gradients over). A group still referenced is never destroyed, so after a failure on gloo its peers
    stay blocked in their collectives (in-process restart relies on dropping them); and the next
    initialisation would find stale groups. Afterwards, every process-group global left is reset."""
    from megatron.core import parallel_state

    destroy = parallel_state.destroy_model_parallel

    @functools.wraps(destroy)
    def destroy_every_group() -> None:
        destroy()
        for name, value in list(vars(parallel_state).items()):
            if not (name.startswith("_") and name.isupper()):
                continue
            if isinstance(value, dict) and _holds_process_group(list(value.values())):
                value.clear()
            elif _holds_process_group(value):
                setattr(parallel_state, name, None)

    parallel_state.destroy_model_parallel = destroy_every_group


def _holds_process_group(value) -> bool:
    if isinstance(value, torch.distributed.ProcessGroup):
        return True
    if isinstance(value, (list, tuple)):
        return any(isinstance(item, torch.distributed.ProcessGroup) for item in value)
    return False


def _distributed_optimizer_padding_saved_as_zeros() -> None:
    """The distributed optimizer's dp_reshardable checkpoint stores each gradient bucket whole, with the
    padding between parameters taken from `torch.empty`: whatever bytes that memory held. Two saves of
    the same state then differ (and so do their checksums), and garbage is written to disk. The padding
    is saved as zeros; loading discards it either way."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor
    from megatron.core.optimizer import distrib_optimizer

    optimizer_class = distrib_optimizer.DistributedOptimizer
    sharded_param_state = getattr(optimizer_class, "sharded_param_state_dp_reshardable", None)
    if sharded_param_state is None:
        return

    @functools.wraps(sharded_param_state)
    def with_zeroed_padding(self, *args, **kwargs):
        state = sharded_param_state(self, *args, **kwargs)
        for key, per_dtype in state.items():
            if not isinstance(key, int):
                continue  # per_bucket_numel and the like
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        padding = entry.get("padding")
                        if isinstance(padding, LocalNonpersistentObject) and padding.obj is True:
                            for value in entry.values():
                                if isinstance(value, ShardedTensor) and value.data is not None:
                                    value.data.zero_()
        return state

    optimizer_class.sharded_param_state_dp_reshardable = with_zeroed_padding
