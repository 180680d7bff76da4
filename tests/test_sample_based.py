"""Sample-based training, as Megatron-LM runs it: --train-samples gives train-samples // global-batch-size
iterations, the learning-rate schedule counts samples (--lr-warmup-samples, --lr-decay-samples,
--lr-wsd-decay-samples, --lr-warmup-fraction of the decay), and the iteration and sample flags never mix.
A run interrupted by --exit-interval and resumed continues with the uninterrupted run's learning rates
and losses.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

try:
    from tests import launch  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

from megatron_resil.arguments import parse_args

# TINY_TRAINING without its warmup in iterations: these runs are given in samples.
_TRAINING = [a for i, a in enumerate(launch.TINY_TRAINING)
             if a != "--lr-warmup-iters" and launch.TINY_TRAINING[i - 1] != "--lr-warmup-iters"]
# Micro batch 2 on one rank with --global-batch-size 8: four microbatches; 100 samples are 12 iterations.
_BASE = [*launch.TINY_MODEL, *_TRAINING, "--global-batch-size", "8"]


def _args(*extra: str, world_size: int = 1):
    return parse_args([*_BASE, *extra], world_size=world_size)


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        parse_args([*_BASE, *argv], world_size=1)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain.py: error: "), lines
    return lines[0]


class _FakeOptimizer:
    """What OptimizerParamScheduler touches: the parameter groups whose lr it sets."""

    def __init__(self) -> None:
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]


def _megatron_lm_scheduler(lr_warmup_steps, lr_decay_steps, wd_incr_steps, wsd_decay_steps, style,
                           wsd_style="exponential"):
    """megatron-core's scheduler with the arguments Megatron-LM's get_optimizer_param_scheduler passes for
    a sample-based run: the sample counts as they are (TINY_TRAINING's --lr 1e-3 --min-lr 1e-4)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        _FakeOptimizer(), init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=lr_warmup_steps,
        lr_decay_steps=lr_decay_steps, lr_decay_style=style, start_wd=0.01, end_wd=0.01,
        wd_incr_steps=wd_incr_steps, wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False, wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=wsd_style)


def _lrs(scheduler, iterations: int, gbs: int) -> list[float]:
    """The learning rate after each iteration, the scheduler stepped by the global batch size."""
    out = []
    for _ in range(iterations):
        scheduler.step(increment=gbs)
        out.append(scheduler.optimizer.param_groups[0]["lr"])
    return out


# --- the command line ------------------------------------------------------------------------------

def test_train_samples_give_megatron_lms_iterations_and_the_decay_defaults_to_the_whole_run():
    args = _args("--train-samples", "100")
    assert args.train_iters == 12  # 100 // 8: the last, incomplete batch is not trained, as in Megatron-LM
    assert args.lr_decay_samples == 100 and args.lr_decay_iters is None


@pytest.mark.parametrize("flags, named", [
    (("--train-iters", "4", "--train-samples", "100"), ("--train-iters", "--train-samples")),
    (("--train-samples", "100", "--lr-decay-iters", "10"), ("--lr-decay-iters", "--train-samples")),
    (("--train-samples", "100", "--lr-warmup-iters", "2"), ("--lr-warmup-iters", "--train-samples")),
    (("--train-samples", "100", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"),
     ("--lr-wsd-decay-iters", "--train-samples")),
    (("--train-iters", "4", "--lr-decay-samples", "32"), ("--lr-decay-samples", "--train-iters")),
    (("--train-iters", "4", "--lr-warmup-samples", "8"), ("--lr-warmup-samples", "--train-iters")),
    (("--train-iters", "4", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "8"),
     ("--lr-wsd-decay-samples", "--train-iters")),
    (("--train-samples", "100", "--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "8"),
     ("--lr-warmup-fraction", "--lr-warmup-samples")),
    (("--train-iters", "4", "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "1"),
     ("--lr-warmup-fraction", "--lr-warmup-iters")),
    (("--train-samples", "100", "--lr-decay-style", "WSD"), ("WSD", "--lr-wsd-decay-samples")),
    (("--train-samples", "100", "--lr-warmup-samples", "100"), ("--lr-warmup-samples", "--lr-decay-samples")),
    (("--train-samples", "7"), ("--train-samples", "--global-batch-size")),
    ((), ("--train-iters", "--train-samples")),
])
def test_megatron_lms_rules_refuse_in_one_line_naming_both_flags(flags, named, capsys):
    line = _refused(list(flags), capsys)
    assert all(name in line for name in named), line


def test_iteration_based_runs_keep_their_schedule_in_samples_of_the_global_batch():
    from megatron_resil.optimizer import schedule_steps

    args = _args("--train-iters", "10", "--lr-warmup-iters", "2", "--lr-decay-iters", "8")
    assert schedule_steps(args) == {"lr_warmup_steps": 16, "lr_decay_steps": 64, "wd_incr_steps": 80,
                                    "wsd_decay_steps": None}


# --- the schedule ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, megatron_lm", [
    # warmup ends inside an iteration (12 samples: iteration 1.5); the cosine decays over 80 samples
    (("--train-samples", "100", "--lr-warmup-samples", "12", "--lr-decay-samples", "80"),
     dict(lr_warmup_steps=12, lr_decay_steps=80, wd_incr_steps=100, wsd_decay_steps=None, style="cosine")),
    # a fraction of the decay, which defaults to --train-samples
    (("--train-samples", "100", "--lr-warmup-fraction", "0.25", "--lr-decay-style", "linear"),
     dict(lr_warmup_steps=25.0, lr_decay_steps=100, wd_incr_steps=100, wsd_decay_steps=None, style="linear")),
    (("--train-samples", "100", "--lr-warmup-samples", "8", "--lr-decay-style", "WSD",
      "--lr-wsd-decay-samples", "40", "--lr-wsd-decay-style", "cosine"),
     dict(lr_warmup_steps=8, lr_decay_steps=100, wd_incr_steps=100, wsd_decay_steps=40, style="WSD",
          wsd_style="cosine")),
])
def test_learning_rates_at_each_sample_count_are_megatron_lms(flags, megatron_lm, capsys):
    from megatron_resil.optimizer import build_scheduler

    args = _args(*flags)
    ours = build_scheduler(_FakeOptimizer(), args)
    assert capsys.readouterr().out.splitlines() == ["setting training iterations to 12"]  # Megatron-LM's line
    expected = _lrs(_megatron_lm_scheduler(**megatron_lm), 14, 8)  # past the end: the floor holds
    assert _lrs(ours, 14, 8) == expected
    assert max(expected) <= 1e-3 and expected[-1] == pytest.approx(1e-4)


def test_warmup_and_decay_count_samples_not_iterations():
    """After 2 iterations of 8 samples, a 12-sample warmup is over and the cosine has started."""
    from megatron_resil.optimizer import build_scheduler

    args = _args("--train-samples", "100", "--lr-warmup-samples", "12", "--lr-decay-samples", "80")
    first, second = _lrs(build_scheduler(_FakeOptimizer(), args), 2, 8)
    assert first == pytest.approx(1e-3 * 8 / 12)  # in warmup: 8 of 12 samples
    # 16 samples: 4 into the 68 samples of cosine decay after the warmup
    assert second < 1e-3 and second == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 4 / 68)))


def test_datasets_are_sized_in_samples_as_in_megatron_lm():
    from megatron_resil.data import _num_samples

    args = _args("--train-samples", "100", "--eval-interval", "5", "--eval-iters", "2")
    # train: the samples as given; validation: (12 // 5 + 1) evaluations of 2 global batches
    assert _num_samples(args) == (100, 3 * 2 * 8)


# --- a real run, interrupted and resumed -----------------------------------------------------------

_LR_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \|.*?learning rate: (\S+) \|"
                      r".*?lm loss: (\S+) \|")


def _steps(output: str) -> dict[int, tuple[str, str, str, str]]:
    """iteration -> (train iterations, consumed samples, learning rate, lm loss), as printed."""
    return {int(m.group(1)): m.group(2, 3, 4, 5) for m in _LR_LINE.finditer(output)}


def _run_ok(args: list[str]) -> str:
    result = launch.run(args)
    assert result.returncode == 0, f"run failed ({result.returncode}):\n{result.stdout[-6000:]}"
    return result.stdout


@pytest.mark.slow
def test_a_sample_based_run_interrupted_and_resumed_continues_with_the_same_rates_and_losses(tmp_path):
    """Two data-parallel ranks, 60 samples in global batches of 8 (7 iterations), a 12-sample warmup
    ending inside iteration 2 and a 44-sample cosine decay that reaches --min-lr before the end. One job
    runs through; its twin stops at --exit-interval 3 and resumes from its checkpoint."""
    common = [*_BASE, "--train-samples", "60", "--lr-warmup-samples", "12", "--lr-decay-samples", "44",
              "--save-interval", "2"]
    whole, twin = tmp_path / "whole", tmp_path / "twin"
    whole_out = _run_ok([*common, "--save", str(whole), "--load", str(whole)])
    first_out = _run_ok([*common, "--save", str(twin), "--load", str(twin), "--exit-interval", "3"])
    resumed_out = _run_ok([*common, "--save", str(twin), "--load", str(twin)])

    assert "setting training iterations to 7" in whole_out
    expected = _steps(whole_out)
    assert sorted(expected) == list(range(1, 8))
    assert [expected[i][:2] for i in (1, 7)] == [("7", "8"), ("7", "56")]
    assert float(expected[1][2]) == pytest.approx(1e-3 * 8 / 12, rel=1e-6)  # warmup, in samples
    assert float(expected[6][2]) == pytest.approx(1e-4, rel=1e-6)  # 48 samples: past the decay
    assert sorted(_steps(first_out)) == [1, 2, 3]
    assert "successfully saved checkpoint from iteration       3" in first_out
    resumed = _steps(resumed_out)
    assert sorted(resumed) == [4, 5, 6, 7]
    assert {i: expected[i] for i in resumed} == resumed  # rates, losses and consumed samples, as printed
    assert "at iteration 3" in resumed_out and Path(twin, "iter_0000007").is_dir()
