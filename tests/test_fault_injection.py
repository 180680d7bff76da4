"""--inject-fault strikes deterministically, once per job: the restarted job resumes and completes."""

from __future__ import annotations

import json

import pytest

from megatron_resil.checkpointing import layout
from tests import launch

pytestmark = pytest.mark.slow


def _args(save, iters: int, *fault) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(iters),
            "--save", str(save), "--load", str(save), "--save-interval", "2", *fault]


@pytest.mark.cold
def test_killed_rank_restart_does_not_repeat_the_fault_and_completes(tmp_path):
    args = _args(tmp_path / "ckpt", 5, "--inject-fault", "kill", "--inject-fault-iteration", "3",
                 "--inject-fault-ranks", "1")
    crashed = launch.run(args)
    assert crashed.returncode != 0
    assert "[resil] fault: injecting kill on rank 1 before iteration 3" in crashed.stdout
    assert "exitcode  : -9" in crashed.stdout
    restarted = launch.run(args)  # the same command, as a restart would issue it
    assert restarted.returncode == 0, restarted.stdout[-3000:]
    assert "injecting" not in restarted.stdout
    assert "at iteration 2" in restarted.stdout
    assert sorted(launch.losses(restarted.stdout)) == [3, 4, 5]
    assert _forked(tmp_path / "ckpt") == [False, False]  # the cold tier: both runs imported for themselves


def _forked(save) -> list[bool]:
    """Whether each run's ranks were forked from a standby, from its restart-phases record."""
    events = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines()]
    return [e["details"]["standby"] for e in events if e["event"] == "restart_phases"]


def test_crash_in_the_middle_of_a_save_publishes_nothing_and_the_restart_recovers(tmp_path):
    root = tmp_path / "ckpt"
    args = _args(root, 6, "--inject-fault", "crash-mid-save", "--inject-fault-iteration", "3")
    crashed = launch.run(args)
    assert crashed.returncode != 0
    assert "injecting crash-mid-save on rank 0 in the save of iteration 4" in crashed.stdout
    assert layout.published_iterations(str(root)) == [2]
    assert layout.leftovers(str(root))["staging"], "the unpublished save is left as a staging dir"
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    restarted = launch.run(args)
    assert restarted.returncode == 0, restarted.stdout[-3000:]
    assert "[resil] cleanup: removed" in restarted.stdout
    assert "at iteration 2" in restarted.stdout
    assert layout.published_iterations(str(root)) == [6, 4, 2]


def test_nan_loss_and_exception_strike_at_the_chosen_iteration(tmp_path):
    nan = launch.run([*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "3",
                      "--inject-fault", "nan-loss", "--inject-fault-iteration", "2", "--inject-fault-repeat",
                      # Without this the rerun state machine stops the run on the NaN (tests/test_rerun.py).
                      "--no-check-for-nan-in-loss-and-grad"])
    assert nan.returncode == 0, nan.stdout[-3000:]
    losses = launch.losses(nan.stdout)
    assert losses[1][0] != "NAN" and losses[2][0] == "NAN"  # Python formats nan with E as NAN

    failed = launch.run(_args(tmp_path / "ckpt", 4, "--inject-fault", "exception",
                              "--inject-fault-iteration", "2"))
    assert failed.returncode != 0
    assert "RuntimeError: injected fault: exception on rank 0 at iteration 2" in failed.stdout
