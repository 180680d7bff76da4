"""Warm reserves under in-process restart (--inprocess-active-world-size below the world size): a rank's
process killed with SIGKILL, rank 0's included, costs the job nothing but the restart. Under
scripts/run_local.sh (our ft_launcher) the other processes go on, a reserve takes the lost rank's place in
the same job step, and the run finishes with exactly the losses of a run that was never interrupted.

Real processes on loopback: run_local.sh with 3 processes, 2 training and 1 reserve, no in-job restart and
no requeue allowed (so only the in-process layer can have saved the run); gloo, a tiny GPT.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_resil.arguments import parse_args
from megatron_resil.events import EVENT_LOG_NAME

try:
    from tests import launch  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

RUN_LOCAL = launch.REPO / "scripts" / "run_local.sh"
# Timeouts that leave a loaded 2-core host room (a kill is found by NVRx's monitor process, not by these).
_INPROCESS = ["--inprocess-restart", "--inprocess-active-world-size", "2", "--inprocess-granularity", "rank",
              "--inprocess-heartbeat-interval", "5", "--inprocess-heartbeat-timeout", "60",
              "--inprocess-soft-timeout", "60", "--inprocess-hard-timeout", "90",
              "--inprocess-barrier-timeout", "180", "--inprocess-completion-timeout", "180"]


def _args(save: Path, *extra: str) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "10", "--save", str(save),
            "--load", str(save), "--save-interval", "4", *extra]


def _events(save: Path) -> list[dict]:
    path = save / EVENT_LOG_NAME
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.compat
def test_a_reserve_takes_the_place_of_rank_0_killed_and_the_run_ends_as_if_uninterrupted(tmp_path):
    save, log = tmp_path / "ckpt", tmp_path / "run.log"
    env = {**launch.env(standby=False), "NPROC_PER_NODE": "3", "MAX_RESTARTS": "0", "MAX_REQUEUES": "0",
           "RESIL_PYTHON": sys.executable}
    with open(log, "w") as out:
        run = subprocess.Popen(["bash", str(RUN_LOCAL), *_args(save, *_INPROCESS)], env=env, cwd=launch.REPO,
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Rank 0 trains past the first checkpoint; then its process (the store host, were ranks hosting
        # the stores) is killed.
        while "iteration        6/" not in log.read_text():
            assert run.poll() is None, log.read_text()[-4000:]
            time.sleep(0.2)  # polling the log for the event
        [setup] = [e for e in _events(save) if e["event"] == "inprocess"]
        assert setup["reserves"] == 1 and len(setup["pids"]) == 2, setup
        assert "stores hosted by the launcher" in setup["message"], setup["message"]
        lost = setup["pids"][0]
        os.kill(lost, signal.SIGKILL)
        code = run.wait(timeout=600)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    out = log.read_text()
    assert code == 0, out[-6000:]

    # The launcher left the others running, and said so once; it restarted nothing itself.
    assert out.count(f"[resil] ft_launcher: rank 0 (pid {lost}) was killed (exit code -9)") == 1, out[-6000:]
    # One in-process restart, which names the lost process first and the reserve now in its place.
    restarts = [line for line in out.splitlines() if line.startswith("[resil] restart:")]
    assert len(restarts) == 1, restarts
    assert restarts[0].startswith("[resil] restart: in-process restart 1 of at most 3: rank 0 ended (its "
                                  "process is gone)"), restarts[0]
    events = _events(save)
    [restart] = [e for e in events if e["event"] == "restart"]
    reserve, survivor = restart["pids"]
    assert survivor == setup["pids"][1] and reserve not in setup["pids"], (setup, restart)
    assert f"the reserve process {reserve} takes rank 0's place (process {lost} is lost)" in restarts[0]
    assert 0 in restart["failed_ranks"]

    # Resumed from the checkpoint of iteration 4 and finished, with the uninterrupted run's losses.
    after = out.split(restarts[0], 1)[1]
    assert [e["iteration"] for e in events if e["event"] == "loaded"] == [4]
    assert sorted(launch.losses(after)) == [5, 6, 7, 8, 9, 10]
    assert [e["iteration"] for e in events if e["event"] == "finished"] == [10]
    reference = launch.run(_args(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stdout[-4000:]
    expected = launch.losses(reference.stdout)
    assert launch.losses(after) == {i: expected[i] for i in range(5, 11)}


def _parse(*extra: str, world_size: int):
    return parse_args([*launch.TINY_MODEL, "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
                       "--mock-data", *extra], world_size=world_size)


def test_reserves_leave_the_training_world_at_the_active_size():
    args = _parse("--inprocess-restart", "--inprocess-active-world-size", "2", world_size=3)
    assert (args.world_size, args.data_parallel_size, args.inprocess_active_world_size) == (2, 2, 2)
    args = _parse("--inprocess-restart", world_size=3)
    assert (args.world_size, args.inprocess_active_world_size) == (3, 3)


@pytest.mark.parametrize("size", ["0", "4"])
def test_an_active_world_size_outside_the_world_is_one_line_and_exit_2(size, capsys):
    with pytest.raises(SystemExit) as stop:
        _parse("--inprocess-restart", "--inprocess-active-world-size", size, world_size=3)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].endswith(f"--inprocess-active-world-size {size}: give at least 1 and at most the world "
                              "size (3); the ranks beyond it wait as warm reserves"), lines
