"""What a resume takes from a checkpoint, as Megatron-LM's load_checkpoint decides it.

The schedule: a command line whose schedule differs from the checkpoint's (a longer --train-iters) stops
before training with exit 2 and one line naming both, unless --override-opt_param-scheduler (this command
line's) or --use-checkpoint-opt_param-scheduler (the checkpoint's) says which wins. Weights without the
optimizer state (--no-load-optim, --finetune, a `release` checkpoint) under bf16: the optimizer's fp32
main parameters are reloaded from the loaded weights, so the first step does not write the random initial
ones back over them. A `release` tracker gives the weights only, at iteration 0. The FLOP counter and
skipped_train_samples are saved and come back.

The fast tests check the decisions on the state; the slow ones run torchrun on a bf16 checkpoint of 4
iterations (6 launches in all). Their first step after a load without the scheduler state runs at
learning rate 0 (the warmup starts at --lr-warmup-init 0), so the weights it saves must be the loaded ones,
bit for bit.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from megatron_resil import exit_codes
from megatron_resil.arguments import parse_args
from megatron_resil.checkpointing import state
from megatron_resil.checkpointing.resumed_schedule import ScheduleMismatch, check_resumed_schedule
from megatron_resil.checkpointing.safe_load import CommonLoadWeightsOnly
from megatron_resil.model import padded_vocab_size
from megatron_resil.optimizer import build_scheduler
from megatron_resil.tokenizer import build_tokenizer
from megatron_resil.train_log import floating_point_operations
from tests import launch

TRACKER = "latest_checkpointed_iteration.txt"
OVERRIDE, USE_CHECKPOINT = "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"
# The tiny job without the choice of schedule the other tests' jobs make (tests/launch.py).
BASE = [*launch.TINY_MODEL, *(flag for flag in launch.TINY_TRAINING if flag != USE_CHECKPOINT), "--bf16"]


class _Optimizer:
    """What the scheduler and restore touch of megatron-core's optimizer; records what restore asks."""

    def __init__(self) -> None:
        self.param_groups = [{"params": [], "max_lr": 1e-3, "min_lr": 1e-4}]
        self.calls: list[str] = []

    def reload_model_params(self) -> None:
        self.calls.append("reload_model_params")

    def load_state_dict(self, saved) -> None:
        self.calls.append("load_state_dict")
        self.param_groups = [dict(group) for group in saved["param_groups"]]


def _args(*extra: str, world_size: int = 1) -> argparse.Namespace:
    args = parse_args([*BASE, *extra], world_size=world_size)
    args.padded_vocab_size = padded_vocab_size(build_tokenizer(args).vocab_size, args)  # as build_engine
    return args


def _scheduler(*extra: str, optimizer: _Optimizer | None = None):
    return build_scheduler(optimizer or _Optimizer(), _args(*extra))


# ---- fast: the decisions ------------------------------------------------------------------------

def test_a_longer_run_without_either_flag_is_one_line_naming_both_values_and_both_flags():
    saved = _scheduler("--train-iters", "4").state_dict()
    with pytest.raises(ScheduleMismatch) as refused:
        check_resumed_schedule(_scheduler("--train-iters", "6"), saved)
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    # --lr-decay-iters defaults to --train-iters; steps are samples (global batch 2 on one rank).
    assert "decay steps 8 in the checkpoint, 12 on this command line" in message
    assert "weight-decay steps 8 in the checkpoint, 12 on this command line" in message
    assert OVERRIDE in message and USE_CHECKPOINT in message
    check_resumed_schedule(_scheduler("--train-iters", "4"), saved)  # the same schedule resumes


@pytest.mark.parametrize(("flag", "decay_steps"), [(OVERRIDE, 12), (USE_CHECKPOINT, 8)])
def test_either_flag_settles_which_schedule_the_resume_follows(flag, decay_steps):
    saved = _scheduler("--train-iters", "4").state_dict()
    resumed = _scheduler("--train-iters", "6", flag)
    check_resumed_schedule(resumed, saved)
    resumed.load_state_dict(saved)
    assert resumed.lr_decay_steps == decay_steps


def _checkpoint(model: torch.nn.Module, scheduler_state: dict) -> dict:
    """A loaded checkpoint as restore sees it, with Megatron-LM's counters set."""
    record = argparse.Namespace(consumed_train_samples=8, consumed_valid_samples=0, skipped_train_samples=6)
    return {"model": {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}, "args": record,
            "iteration": 4, "num_floating_point_operations_so_far": 3.5e12, "rerun_state_machine": None,
            "opt_param_scheduler": scheduler_state,
            "optimizer": {"param_groups": [{"params": [], "max_lr": 2e-3, "min_lr": 0.0}]}}


def _restore(loaded: dict, model, optimizer, scheduler, **how) -> state.TrainProgress:
    return state.restore(loaded, [model], optimizer, scheduler, load_rng=False, half_precision=True,
                         **{"load_optimizer": True, "finetune": False, **how})


@pytest.mark.parametrize("how", [{"load_optimizer": False}, {"finetune": True}, {"release": True}],
                         ids=["no-load-optim", "finetune", "release"])
def test_weights_without_optimizer_state_reload_the_main_params_under_bf16(how):
    model, optimizer = torch.nn.Linear(2, 2), _Optimizer()
    scheduler = _scheduler("--train-iters", "6", optimizer=optimizer)
    progress = _restore(_checkpoint(model, {}), model, optimizer, scheduler, **how)
    assert optimizer.calls == ["reload_model_params"]
    assert torch.all(model.weight == 0.5)
    assert scheduler.num_steps == 0  # Megatron-LM loads the scheduler only with the optimizer
    assert progress.floating_point_operations_so_far == 3.5e12  # kept even by --finetune, as Megatron-LM
    where = (progress.iteration, progress.consumed_train_samples, progress.skipped_train_samples)
    if "load_optimizer" in how:  # the iteration and the counters come back
        assert where == (4, 8, 6)
    else:  # weights only, at iteration 0
        assert where == (0, 0, 0)


def test_a_schedule_mismatch_is_refused_before_anything_is_applied():
    model, optimizer = torch.nn.Linear(2, 2), _Optimizer()
    before = model.weight.detach().clone()
    loaded = _checkpoint(model, _scheduler("--train-iters", "4").state_dict())
    with pytest.raises(ScheduleMismatch):
        _restore(loaded, model, optimizer, _scheduler("--train-iters", "6", optimizer=optimizer))
    assert optimizer.calls == [] and torch.equal(model.weight, before)


def test_override_keeps_this_command_lines_learning_rates_over_the_optimizer_states():
    """Megatron-LM: the optimizer state brings back the checkpoint's max and min lr in each parameter group;
    --override-opt_param-scheduler puts this run's back, and counts the schedule from the samples consumed."""
    model, optimizer = torch.nn.Linear(2, 2), _Optimizer()
    scheduler = _scheduler("--train-iters", "6", OVERRIDE, optimizer=optimizer)
    progress = _restore(_checkpoint(model, _scheduler("--train-iters", "4").state_dict()), model, optimizer,
                        scheduler)
    assert optimizer.calls == ["load_state_dict"]
    assert (optimizer.param_groups[0]["max_lr"], optimizer.param_groups[0]["min_lr"]) == (1e-3, 1e-4)
    assert scheduler.num_steps == progress.consumed_train_samples == 8
    assert scheduler.lr_decay_steps == 12


# ---- slow: real runs on a bf16 checkpoint --------------------------------------------------------

def _run(args: list[str]):
    result = launch.run(args)
    return result, result.stdout


def _run_ok(args: list[str]) -> str:
    result, out = _run(args)
    assert result.returncode == 0, f"run failed ({result.returncode}):\n{out[-6000:]}"
    return out


def _iter_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def _flops_per_iteration() -> float:
    args = _args("--train-iters", "4", world_size=2)
    return floating_point_operations(args, args.global_batch_size)


def _lr_at(out: str, iteration: int) -> str:
    return re.search(rf"iteration\s+{iteration}/.*? learning rate: (\S+) \|", out).group(1)


def _expected_lr(iteration: int, *flags: str) -> str:
    args = _args(*flags, world_size=2)
    optimizer = _Optimizer()
    scheduler = build_scheduler(optimizer, args)
    scheduler.step(increment=iteration * args.global_batch_size)
    return f"{optimizer.param_groups[0]['lr']:.6E}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """4 iterations under bf16 on 2 ranks, saved at 4."""
    root = tmp_path_factory.mktemp("trained") / "ckpt"
    _run_ok([*BASE, "--train-iters", "4", "--save", str(root)])
    assert (root / TRACKER).read_text().strip() == "4"
    return root


@pytest.mark.slow
def test_bf16_no_load_optim_trains_on_from_the_loaded_weights(trained, tmp_path):
    out = _run_ok([*BASE, "--train-iters", "5", "--load", str(trained), "--no-load-optim",
                   "--save", str(tmp_path / "after")])
    assert "training from iteration 4 to 5" in out
    # Step 5 ran at learning rate 0: it must have left the loaded weights as they were.
    assert launch.differing_tensors(_iter_dir(trained, 4), _iter_dir(tmp_path / "after", 5), tmp_path) == []


@pytest.mark.slow
def test_a_release_tracker_loads_the_weights_only_at_iteration_0(trained, tmp_path):
    release = tmp_path / "release_ckpt"
    shutil.copytree(_iter_dir(trained, 4), release / "release")
    (release / TRACKER).write_text("release\n")
    out = _run_ok([*BASE, "--train-iters", "1", "--lr-decay-iters", "4", "--load", str(release),
                   "--save", str(tmp_path / "after")])
    assert f"successfully loaded checkpoint from {release} [ t 1/1, p 1/1 ] at iteration 0 " in out
    assert "training from iteration 0 to 1" in out
    # No optimizer or scheduler state: step 1 at learning rate 0 kept the released weights (bf16 included).
    assert launch.differing_tensors(_iter_dir(trained, 4), _iter_dir(tmp_path / "after", 1), tmp_path) == []


def _checkpoint_files(root: Path) -> list:
    """The checkpoints and the tracker, with their sizes and times (not the event log or the lock)."""
    return sorted((p.relative_to(root), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in [root / TRACKER, *root.glob("iter_*/**/*")] if p.is_file())


@pytest.mark.slow
def test_a_longer_run_with_neither_flag_stops_before_training_with_exit_2(trained):
    before = _checkpoint_files(trained)
    result, out = _run([*BASE, "--train-iters", "6", "--load", str(trained), "--save", str(trained)])
    root_cause = re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", out, re.DOTALL)
    assert result.returncode != 0 and root_cause, out[-3000:]
    assert int(root_cause.group(1)) == exit_codes.BAD_ARGUMENTS, out[-3000:]
    said = [line for line in out.splitlines() if "opt_param-scheduler" in line]
    assert len(said) == 1 and said[0].startswith("[resil] exit: "), said
    assert "decay steps 16 in the checkpoint, 24 on this command line" in said[0]  # global batch 4
    assert OVERRIDE in said[0] and USE_CHECKPOINT in said[0]
    assert not re.search(r"\[rank\d+\]: Traceback", out), "ranks must exit, not crash"
    assert " iteration        5/" not in out
    assert _checkpoint_files(trained) == before  # the checkpoint and its tracker untouched
    exits = [json.loads(line) for line in (trained / "events.jsonl").read_text().splitlines()
             if '"exit"' in line]
    assert exits[-1]["exit_code"] == exit_codes.BAD_ARGUMENTS and exits[-1]["message"] in said[0]


@pytest.mark.slow
def test_override_trains_with_the_new_schedule_and_carries_the_flop_counter(trained, tmp_path):
    out = _run_ok([*BASE, "--train-iters", "6", "--load", str(trained), OVERRIDE,
                   "--save", str(tmp_path / "b")])
    assert _lr_at(out, 5) == _expected_lr(5, "--train-iters", "6")
    assert _lr_at(out, 5) != _expected_lr(5, "--train-iters", "4")
    # Saved as Megatron-LM saves them: the FLOPs of every iteration so far (4 loaded + 2 trained here),
    # and skipped_train_samples in the args.
    per_iteration = _flops_per_iteration()
    for root, iteration in ((trained, 4), (tmp_path / "b", 6)):
        common = CommonLoadWeightsOnly().load_common(_iter_dir(root, iteration))
        assert common["num_floating_point_operations_so_far"] == pytest.approx(iteration * per_iteration)
        assert common["args"].skipped_train_samples == 0


@pytest.mark.slow
def test_use_checkpoint_opt_param_scheduler_keeps_the_checkpoints_schedule(trained):
    out = _run_ok([*BASE, "--train-iters", "6", "--load", str(trained), USE_CHECKPOINT])
    assert _lr_at(out, 5) == _expected_lr(5, "--train-iters", "4") == "1.000000E-04"  # past its decay
