"""Megatron-LM's --step-batch-size-schedule and --eval-global-batch-size: the global batch size steps up
at the consumed-token thresholds, the number of microbatches follows, the run's length in --train-samples
walks the schedule, the learning rate counts the samples each step consumed, the iteration line logs the
step's size, a checkpoint is saved where the size changes, and a run resumed from before the change
continues exactly as the uninterrupted one. Evaluation takes --eval-global-batch-size samples per
iteration. Our own code (megatron_resil/batch_schedule.py), so both lanes run it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

try:
    from tests import launch  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

from megatron_resil.arguments import parse_args
from megatron_resil.batch_schedule import BatchSizeSchedule
from megatron_resil.data import _num_samples

# TINY_TRAINING without its warmup in iterations: these runs are given in samples. Micro batch 2.
_TRAINING = [a for i, a in enumerate(launch.TINY_TRAINING)
             if a != "--lr-warmup-iters" and launch.TINY_TRAINING[i - 1] != "--lr-warmup-iters"]
# --seq-length 32: 384 tokens are 12 samples. Global batches of 4 until 12 samples, then of 8.
_SCHEDULE = ["--step-batch-size-schedule", "0:4 384:8"]
_BASE = [*launch.TINY_MODEL, *_TRAINING]


def _args(*extra: str, world_size: int = 2):
    return parse_args([*_BASE, *extra], world_size=world_size)


def _refused(argv: list[str], capsys, world_size: int = 2) -> str:
    with pytest.raises(SystemExit) as stop:
        parse_args([*_BASE, *argv], world_size=world_size)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain.py: error: "), lines
    return lines[0]


# --- the schedule and the command line ------------------------------------------------------------

def test_thresholds_are_tokens_with_suffixes_turned_into_samples_by_the_sequence_length():
    """The release configs' schedule at --seq-length 4096, as megatron-core 0.19 parses it."""
    schedule = BatchSizeSchedule.parse("0:384 200B:768 400B:1152", seq_length=4096)
    assert schedule.steps == ((0, 384), (200 * 10**9 // 4096, 768), (400 * 10**9 // 4096, 1152))
    assert [schedule.at(n) for n in (0, 48828124, 48828125, 97656250)] == [384, 384, 768, 1152]
    assert BatchSizeSchedule.parse("1.5K:8,0:4", seq_length=1).steps == ((0, 4), (1500, 8))


def test_train_samples_walk_the_schedule_as_megatron_lms_update_train_iters():
    """36 samples: three steps of 4 (to 12 samples), then three of 8; the last step may overshoot."""
    args = _args("--train-samples", "36", *_SCHEDULE)
    assert args.train_iters == 6
    assert _args("--train-samples", "37", *_SCHEDULE).train_iters == 7
    # As Megatron-LM: --global-batch-size keeps its default, micro batch x data-parallel size, and
    # evaluation uses it unless --eval-global-batch-size says otherwise.
    assert args.global_batch_size == 4 and args.eval_global_batch_size == 4 and args.num_microbatches == 1


def test_datasets_are_sized_by_the_schedule_and_the_evaluation_batch():
    args = _args("--train-iters", "5", "--eval-interval", "2", "--eval-iters", "3",
                 "--eval-global-batch-size", "8", *_SCHEDULE)
    # Five steps: 4 + 4 + 4 + 8 + 8 samples; three evaluations (at 2, 4 and the end) of 3 x 8 samples.
    assert _num_samples(args) == (28, 72)


@pytest.mark.parametrize("flags, named", [
    (["--global-batch-size", "8"], "give --step-batch-size-schedule or --global-batch-size, not both"),
    (["--step-batch-size-schedule", "0:8 384:4"], "the batch size goes down from 8 to 4"),
    (["--step-batch-size-schedule", "0:4 384:6"], "batch size 6 is not divisible by --micro-batch-size 2 "
                                                  "x data-parallel size 2"),
    (["--step-batch-size-schedule", "384:4"], "the first entry must start at 0"),
    (["--step-batch-size-schedule", "0:4 40:8 50:12"], "two entries start at sample 1"),
    (["--step-batch-size-schedule", "0:4 384"], "entry '384' is not THRESHOLD:BATCH_SIZE"),
    (["--eval-global-batch-size", "6"], "--eval-global-batch-size 6 is not divisible by --micro-batch-size"),
    (["--rampup-batch-size", "4", "4", "100"], "give the ramp as --step-batch-size-schedule"),
])
def test_bad_schedules_are_refused_in_one_line(flags, named, capsys):
    schedule = _SCHEDULE if "--global-batch-size" in flags else []
    assert named in _refused(["--train-iters", "4", *schedule, *flags], capsys)


def test_the_interleaved_schedule_is_checked_at_every_size(capsys):
    """PP=2 interleaved on two ranks: 2 microbatches are enough, the schedule's first size gives one."""
    pp = ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
          "--num-layers-per-virtual-pipeline-stage", "1", "--train-iters", "4"]
    assert _args(*pp, "--step-batch-size-schedule", "0:4 384:8").num_microbatches == 2
    assert "(1 = --step-batch-size-schedule's batch size 2 /" in \
        _refused([*pp, "--step-batch-size-schedule", "0:2 384:8"], capsys)


# --- a real run, its change-point checkpoint, and a resume across the change ------------------------

_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \|.*?learning rate: (\S+) \|"
                   r" global batch size:\s+(\d+) \| lm loss: (\S+) \|.*?grad norm: (\S+) \|")


def _steps(output: str) -> dict[int, tuple[str, ...]]:
    """iteration -> (train iterations, consumed samples, learning rate, global batch size, loss, grad
    norm), as printed."""
    return {int(m.group(1)): m.group(2, 3, 4, 5, 6, 7) for m in _LINE.finditer(output)}


def _run_ok(args: list[str]) -> str:
    result = launch.run(args)
    assert result.returncode == 0, f"run failed ({result.returncode}):\n{result.stdout[-6000:]}"
    return result.stdout


def _common_state(checkpoint: Path) -> dict:
    from megatron_resil import patches
    from megatron_resil.checkpointing.safe_load import CommonLoadWeightsOnly

    patches.install(quiet=True)  # megatron-core 0.19 reads the common state through DCP, as pretrain.py
    return CommonLoadWeightsOnly().load_common(checkpoint)


@pytest.mark.slow
def test_the_batch_size_steps_up_and_a_resume_across_the_change_continues_exactly(tmp_path):
    """Two data-parallel ranks, micro batch 2: 36 samples in steps of 4 then 8 (one microbatch per rank,
    then two), a warmup of 8 samples and a cosine decay over the run, evaluation every 3 iterations on 8
    samples. One job runs through, saving every 2 iterations and where the size changes (after iteration
    3); its twin resumes from a copy of iteration 2, before the change."""
    from tests.test_resume import TRACKER, _assert_checkpoints_identical, _iter_dir

    common = [*_BASE, *_SCHEDULE, "--train-samples", "36", "--lr-warmup-samples", "8", "--save-interval", "2",
              "--eval-interval", "3", "--eval-global-batch-size", "8"]
    whole, twin = tmp_path / "whole", tmp_path / "twin"
    whole_out = _run_ok([*common, "--save", str(whole), "--load", str(whole)])
    twin.mkdir()
    shutil.copytree(_iter_dir(whole, 2), _iter_dir(twin, 2))
    (twin / TRACKER).write_text("2\n")
    resumed_out = _run_ok([*common, "--save", str(twin), "--load", str(twin)])

    assert "setting training iterations to 6" in whole_out
    steps = _steps(whole_out)
    assert [(steps[i][1], steps[i][3]) for i in range(1, 7)] == [
        ("4", "4"), ("8", "4"), ("12", "4"), ("20", "8"), ("28", "8"), ("36", "8")], whole_out[-3000:]
    assert float(steps[1][2]) == pytest.approx(1e-3 * 4 / 8, rel=1e-6)  # warmup counts samples
    assert float(steps[6][2]) == pytest.approx(1e-4, rel=1e-6)  # the decay ends with the 36th sample
    assert "global batch size 4 -> 8 at 12 consumed samples (--step-batch-size-schedule): 2 microbatches " \
           "per step" in whole_out
    # Saved where the size changes (iteration 3 is no save interval), with the samples consumed so far.
    assert _common_state(_iter_dir(whole, 3))["args"].consumed_train_samples == 12
    final = _common_state(_iter_dir(whole, 6))["args"]
    assert (final.consumed_train_samples, final.consumed_valid_samples) == (36, 2 * 8)

    resumed = _steps(resumed_out)
    assert sorted(resumed) == [3, 4, 5, 6] and "at iteration 2" in resumed_out
    assert {i: steps[i] for i in resumed} == resumed  # sizes, samples, rates, losses, grad norms, as printed
    _assert_checkpoints_identical(_iter_dir(whole, 6), _iter_dir(twin, 6), tmp_path / "scratch")
