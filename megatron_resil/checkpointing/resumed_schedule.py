"""A resumed run's learning-rate schedule against the one its checkpoint saved: megatron-core's scheduler
compares them as it loads (OptimizerParamScheduler.load_state_dict, an assertion where they differ) and
Megatron-LM's load_checkpoint puts this run's learning rates back under --override-opt_param-scheduler.
Here a difference with neither flag to settle it is found before anything is loaded, and said in one line
naming both values and both flags (exit 2)."""

from __future__ import annotations

from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


class ScheduleMismatch(Exception):
    """A resume whose command-line schedule differs from the checkpoint's, with neither flag to say which
    one wins (Megatron-LM stops there with an assertion); the message is one line naming both."""


# What megatron-core's OptimizerParamScheduler.load_state_dict compares (_check_and_set), in its order: our
# name, the attribute, and the keys older checkpoints kept it under. The weight-decay rows only where the
# checkpoint holds them.
_COMPARED = (
    ("max lr", "max_lr", ("start_lr", "max_lr")),
    ("min lr", "min_lr", ("min_lr",)),
    ("warmup steps", "lr_warmup_steps", ("warmup_iter", "warmup_steps", "lr_warmup_steps")),
    ("decay steps", "lr_decay_steps", ("end_iter", "decay_steps", "lr_decay_steps")),
    ("decay style", "lr_decay_style", ("decay_style", "lr_decay_style")),
    ("start weight decay", "start_wd", ("start_wd",)),
    ("end weight decay", "end_wd", ("end_wd",)),
    ("weight-decay steps", "wd_incr_steps", ("wd_incr_steps",)),
    ("weight-decay style", "wd_incr_style", ("wd_incr_style",)),
)


def check_resumed_schedule(scheduler: OptimizerParamScheduler, saved: dict) -> None:
    """Raise ScheduleMismatch when this run's schedule differs from the checkpoint's `saved` scheduler state
    and neither --override-opt_param-scheduler nor --use-checkpoint-opt_param-scheduler says which one wins.
    Steps count samples (the scheduler steps by the global batch size)."""
    if scheduler.override_opt_param_scheduler or scheduler.use_checkpoint_opt_param_scheduler:
        return
    differences = []
    for name, attribute, keys in _COMPARED:
        key = next((k for k in keys if k in saved), None)
        if key is None:
            continue
        ours = getattr(scheduler, attribute)
        if ours != saved[key]:
            differences.append(f"{name} {saved[key]} in the checkpoint, {ours} on this command line")
    if differences:
        raise ScheduleMismatch(
            "the learning-rate schedule differs from the checkpoint's (" + "; ".join(differences)
            + "; steps in samples): give --override-opt_param-scheduler to train with this command line's "
            "schedule or --use-checkpoint-opt_param-scheduler to keep the checkpoint's, as Megatron-LM asks")


def apply_overridden_schedule(optimizer: MegatronOptimizer, scheduler: OptimizerParamScheduler,
                              runtime_lrs: list[tuple], consumed_train_samples: int) -> None:
    """After a load under --override-opt_param-scheduler, as Megatron-LM does: the optimizer state brought
    back the checkpoint's max and min learning rates in each parameter group (`runtime_lrs`: this run's,
    taken before the load), and the scheduler counts from the samples consumed."""
    for group, (max_lr, min_lr) in zip(optimizer.param_groups, runtime_lrs, strict=True):
        if max_lr is not None:
            group["max_lr"] = max_lr
        if min_lr is not None:
            group["min_lr"] = min_lr
    scheduler.step(increment=consumed_train_samples - scheduler.num_steps)  # to the samples consumed
