"""Warm reserves under in-process restart (--inprocess-active-world-size below the world size): a rank's
process killed with SIGKILL, rank 0's included, costs the job nothing but the restart. Under
scripts/run_local.sh (our ft_launcher) the other processes go on, a reserve takes the lost rank's place in
the same job step, and the run finishes with exactly the losses of a run that was never interrupted.

Real processes on loopback: run_local.sh with 3 processes, 2 training and 1 reserve, no in-job restart and
no requeue allowed (so only the in-process layer can have saved the run); gloo, a tiny GPT.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_resil import exit_codes
from megatron_resil.arguments import parse_args
from megatron_resil.events import EVENT_LOG_NAME
from megatron_resil.rank_process import descendants_of

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


@contextlib.contextmanager
def _running(save: Path, log: Path, max_restarts: int) -> Iterator[subprocess.Popen]:
    """run_local.sh with 3 processes, 2 of them training; on the way out (a failed assertion), it and every
    process below it are killed: the workers are in sessions of their own."""
    env = {**launch.env(standby=False), "NPROC_PER_NODE": "3", "MAX_RESTARTS": str(max_restarts),
           "MAX_REQUEUES": "0", "RESIL_PYTHON": sys.executable}
    with open(log, "w") as out:
        run = subprocess.Popen(["bash", str(RUN_LOCAL), *_args(save, *_INPROCESS)], env=env, cwd=launch.REPO,
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield run
    finally:
        for pid in {run.pid} | descendants_of(run.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run.wait()


def _wait_for(run: subprocess.Popen, log: Path, text: str, after: str | None = None) -> None:
    """Until `text` is in the log (after the first `after`), polling it: the event, however long it takes."""
    while text not in (log.read_text() if after is None else log.read_text().partition(after)[2]):
        assert run.poll() is None, log.read_text()[-4000:]
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.compat
def test_a_reserve_takes_the_place_of_rank_0_killed_and_the_run_ends_as_if_uninterrupted(tmp_path):
    save, log = tmp_path / "ckpt", tmp_path / "run.log"
    with _running(save, log, max_restarts=0) as run:
        # Rank 0 trains past the first checkpoint; then its process (the store host, were ranks hosting the
        # stores) is killed.
        _wait_for(run, log, "iteration        6/")
        [setup] = [e for e in _events(save) if e["event"] == "inprocess"]
        assert setup["reserves"] == 1 and len(setup["pids"]) == 2, setup
        assert "stores hosted by the launcher" in setup["message"], setup["message"]
        lost = setup["pids"][0]
        os.kill(lost, signal.SIGKILL)
        code = run.wait(timeout=600)
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


@pytest.mark.slow
@pytest.mark.compat
def test_with_the_reserves_used_up_the_next_lost_rank_ends_in_process_restarts_and_the_launcher_restarts(
        tmp_path):
    """The ladder: a reserve takes the first lost rank's place; at the second loss none is left, so the
    in-process layer gives up (exit code 10, said once: the state is sound, only a process is missing) and
    the launcher's in-job restart starts every rank again; the run finishes."""
    save, log = tmp_path / "ckpt", tmp_path / "run.log"
    with _running(save, log, max_restarts=1) as run:
        _wait_for(run, log, "iteration        6/")
        [setup] = [e for e in _events(save) if e["event"] == "inprocess"]
        os.kill(setup["pids"][0], signal.SIGKILL)
        _wait_for(run, log, "iteration        6/", after="[resil] restart: in-process restart 1")
        [restart] = [e for e in _events(save) if e["event"] == "restart"]
        os.kill(restart["pids"][1], signal.SIGKILL)  # rank 1: the process that trained from the start
        code = run.wait(timeout=600)
    out = log.read_text()
    assert code == 0, out[-6000:]
    ended = [line for line in out.splitlines() if line.startswith("[resil] inprocess: no warm reserve left")]
    assert len(ended) == 1 and "exiting with code 10" in ended[0], out[-6000:]
    assert "the last failure: rank 1 ended (its process is gone)" in ended[0], ended[0]
    # No rank ends in a traceback (torch's error handler prefixes each line with the rank); NVRx 0.7 logs
    # tracebacks of its own NVML probes at start-up on a host without a GPU, which are not failures.
    assert not re.search(r"\[rank\d+\]: Traceback", out), out[-6000:]
    # ft_launcher's in-job restart, after the in-process layer's
    assert out.count("[resil] restart: worker group restart 1 of at most 1") == 1, out[-6000:]
    exits = [e["exit_code"] for e in _events(save) if e["event"] == "exit"]
    assert exits == [exit_codes.RESERVES_USED_UP], exits  # then the restarted ranks finished
    assert [e["iteration"] for e in _events(save) if e["event"] == "finished"] == [10]


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
