"""What a checkpoint holds, in Megatron's keys: model, optimizer, opt_param_scheduler, rng_state,
iteration, args (with consumed samples), checkpoint_version, rerun_state_machine (None unless the
checkpoint was saved for the rerun state machine's exit 16 or 17; see rerun.py). Built as a sharded state
dict for dist_checkpointing; non-tensor values land in common.pt and load with torch.load(weights_only=True).
"""

from __future__ import annotations

import argparse

import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_resil import parallel, rerun
from megatron_resil.progress import TrainProgress

CHECKPOINT_VERSION = 3.0
_PLAIN = (int, float, str, bool, type(None))


def args_record(args: argparse.Namespace) -> dict:
    """The command line as plain values, so loading it needs no unpickling of arbitrary objects."""
    out = {}
    for key, value in vars(args).items():
        if isinstance(value, _PLAIN):
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
            out[key] = list(value)
    return out


def _rng_object() -> ShardedObject:
    world = dist.get_world_size() if dist.is_initialized() else 1
    # Every rank keeps its own RNG state: one shard per global rank.
    return ShardedObject("rng_state", parallel.rng_state(), (world,), (parallel.rank(),), replica_id=0)


def build_sharded_state(model, optimizer, scheduler, progress: TrainProgress, args: argparse.Namespace,
                        *, with_optimizer: bool, with_rng: bool) -> dict:
    model_state = model.sharded_state_dict()
    record = args_record(args)
    record["consumed_train_samples"] = progress.consumed_train_samples
    record["consumed_valid_samples"] = progress.consumed_valid_samples
    state = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": progress.iteration,
        "args": record,
        "model": model_state,
        "opt_param_scheduler": scheduler.state_dict(),
        "num_floating_point_operations_so_far": 0,
        "rerun_state_machine": rerun.checkpoint_state(),
    }
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(model_state)
    if with_rng:
        state["rng_state"] = _rng_object()
    return state


def restore(loaded: dict, model, optimizer, scheduler, *, load_optimizer: bool, load_rng: bool,
            finetune: bool) -> TrainProgress:
    model.load_state_dict(loaded["model"])
    if finetune:
        return TrainProgress()
    rerun.restore_state(loaded.get("rerun_state_machine"))
    if load_optimizer:
        optimizer.load_sharded_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if load_rng:
        parallel.set_rng_state(loaded["rng_state"])
    record = loaded["args"]
    return TrainProgress(
        iteration=int(loaded["iteration"]),
        consumed_train_samples=int(record.get("consumed_train_samples", 0)),
        consumed_valid_samples=int(record.get("consumed_valid_samples", 0)),
    )
