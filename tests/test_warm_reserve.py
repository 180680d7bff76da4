"""Warm reserves under in-process restart (--inprocess-active-world-size below the world size): a rank's
process killed with SIGKILL (rank 0's included) or stopped with SIGSTOP costs the job nothing but the
restart. Under
scripts/run_local.sh (our ft_launcher) the other processes go on, a reserve takes the lost rank's place in
the same job step, and the run finishes with exactly the losses of a run that was never interrupted.

Real processes on loopback: run_local.sh with 3 processes, 2 training and 1 reserve, no in-job restart and
no requeue allowed (so only the in-process layer can have saved the run); gloo, a tiny GPT.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from megatron_resil import exit_codes
from megatron_resil.arguments import parse_args
from megatron_resil.checkpointing import layout
from megatron_resil.rank_process import children_of

try:
    from tests import launch, reserves  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch
    import reserves

def _run(save: Path, log: Path, max_restarts: int, fault: list[str], stop_hung: int | None = None) -> str:
    """The run with `fault` injected at iteration 7 (after the checkpoint of 4, before that of 8: every way
    resumes from 4), to its end, which must be a success; its output. `stop_hung`: once the hang injected
    in that rank has struck, its process is stopped with SIGSTOP."""
    with reserves.running(save, log, max_restarts, [*fault, "--inject-fault-iteration", "7"]) as run:
        if stop_hung is not None:
            reserves.wait_for(run, log, f"[resil] fault: injecting hang on rank {stop_hung} ")
            [setup] = [e for e in reserves.events(save) if e["event"] == "inprocess"]
            os.kill(setup["pids"][stop_hung], signal.SIGSTOP)
        code = run.wait(timeout=600)
    out = log.read_text()
    assert code == 0, out[-6000:]
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The losses of the same run with nothing lost (torchrun, 2 ranks)."""
    reference = launch.run(reserves.args(tmp_path_factory.mktemp("uninterrupted") / "ckpt"))
    assert reference.returncode == 0, reference.stdout[-4000:]
    return launch.losses(reference.stdout)


@pytest.mark.slow
@pytest.mark.compat
def test_a_reserve_takes_the_place_of_rank_0_killed_and_the_run_ends_as_if_uninterrupted(uninterrupted,
                                                                                        tmp_path):
    # Rank 0's process kills itself with SIGKILL; it would be the stores' host, were the ranks hosting them.
    save = tmp_path / "ckpt"
    out = _run(save, tmp_path / "run.log", 0, ["--inject-fault", "kill", "--inject-fault-ranks", "0"])
    events = reserves.events(save)
    [setup] = [e for e in events if e["event"] == "inprocess"]
    assert setup["reserves"] == 1 and len(setup["pids"]) == 2, setup
    assert "stores hosted by the launcher" in setup["message"], setup["message"]
    lost = setup["pids"][0]

    # The launcher left the others running, and said so once; it restarted nothing itself (no restarts
    # allowed).
    assert out.count(f"[resil] ft_launcher: rank 0 (pid {lost}) was killed (exit code -9)") == 1, out[-6000:]
    # One in-process restart, which names the lost process first and the reserve now in its place.
    restarts = [line for line in out.splitlines() if line.startswith("[resil] restart:")]
    assert len(restarts) == 1, restarts
    assert restarts[0].startswith("[resil] restart: in-process restart 1 of at most 3: rank 0 ended (its "
                                  "process is gone)"), restarts[0]
    [restart] = [e for e in events if e["event"] == "restart"]
    [reserve] = set(restart["pids"]) - set(setup["pids"])
    assert restart["pids"] == [reserve, setup["pids"][1]], (setup, restart)
    assert f"the reserve process {reserve} takes rank 0's place (process {lost} is lost)" in restarts[0]
    assert restart["failed_ranks"][0] == 0

    # Resumed from the checkpoint of iteration 4 and finished, with the uninterrupted run's losses.
    after = out.split(restarts[0], 1)[1]
    assert [e["iteration"] for e in events if e["event"] == "loaded"] == [4]
    assert [e["iteration"] for e in events if e["event"] == "finished"] == [10]
    assert launch.losses(after) == {i: uninterrupted[i] for i in range(5, 11)}


@pytest.mark.slow
@pytest.mark.compat
def test_a_stopped_rank_is_terminated_and_its_place_taken_and_the_run_ends_as_if_uninterrupted(uninterrupted,
                                                                                             tmp_path):
    """SIGSTOP of rank 1's process: no progress for the soft timeout, and NVRx terminates it at its hard
    timeout. On gloo no collective can be aborted, so rank 0, blocked in one with the stopped rank, makes no
    progress either until the stopped one is gone, and NVRx terminates it too when its own hard timeout
    comes first. Either way the place is taken: by the reserve (in-process, the usual case), or with both
    gone by the launcher's in-job restart; and the run ends as if uninterrupted."""
    save = tmp_path / "ckpt"
    fault = ["--inject-fault", "hang", "--inject-fault-ranks", "1",
             "--inprocess-soft-timeout", "15", "--inprocess-hard-timeout", "30"]
    out = _run(save, tmp_path / "run.log", 1, fault, stop_hung=1)
    # The launcher's in-job restart (both ranks gone) sets the in-process layer up again: the first setup.
    setup = [e for e in reserves.events(save) if e["event"] == "inprocess"][0]
    stopped = setup["pids"][1]
    assert out.count(f"[resil] ft_launcher: rank 1 (pid {stopped}) was killed") == 1, out[-6000:]
    restarts = [line for line in out.splitlines() if line.startswith("[resil] restart:")]
    assert restarts and ("rank 1 made no progress for --inprocess-soft-timeout 15 s" in restarts[0]
                         or "worker group restart 1 of at most 1" in restarts[-1]), restarts
    after = out.split(restarts[-1], 1)[1]
    assert launch.losses(after) == {i: uninterrupted[i] for i in range(5, 11)}
    assert [e["iteration"] for e in reserves.events(save) if e["event"] == "finished"] == [10]


@pytest.mark.slow
@pytest.mark.compat
def test_with_more_ranks_lost_than_reserves_in_process_restarts_end_and_the_launcher_restarts_every_rank(
        uninterrupted, tmp_path):
    """The ladder: both training ranks' processes are killed and one reserve is left, so the in-process
    layer gives up (exit code 10, said once: the state is sound, processes are missing) and the launcher's
    in-job restart starts every rank again; the run finishes as if uninterrupted. With
    --enable-ft-package, as Megatron-LM nests the in-process restarts inside ft_launcher's."""
    save = tmp_path / "ckpt"
    out = _run(save, tmp_path / "run.log", 1, ["--inject-fault", "kill", "--inject-fault-ranks", "0,1",
                                                "--enable-ft-package"])
    [setup] = [e for e in reserves.events(save) if e["event"] == "inprocess"][:1]
    assert "nested inside ft_launcher's in-job restart (--enable-ft-package)" in setup["message"], setup
    ended = [line for line in out.splitlines() if line.startswith("[resil] inprocess: no warm reserve left")]
    assert len(ended) == 1 and "exiting with code 10" in ended[0], out[-6000:]
    # No rank ends in a traceback (torch's error handler prefixes each line with the rank); NVRx 0.7 logs
    # tracebacks of its own NVML probes at start-up on a host without a GPU, which are not failures.
    assert not re.search(r"\[rank\d+\]: Traceback", out), out[-6000:]
    # ft_launcher's in-job restart, after the in-process layer's
    restarts = [line for line in out.splitlines() if line.startswith("[resil] restart:")]
    assert restarts[-1].startswith("[resil] restart: worker group restart 1 of at most 1"), restarts
    exits = [e["exit_code"] for e in reserves.events(save) if e["event"] == "exit"]
    assert exits == [exit_codes.RESERVES_USED_UP], exits  # then the restarted ranks finished
    assert [e["iteration"] for e in reserves.events(save) if e["event"] == "finished"] == [10]
    assert launch.losses(out.split(restarts[-1], 1)[1]) == {i: uninterrupted[i] for i in range(5, 11)}


def _processes_of_run(save: Path) -> set[int]:
    """Every live process whose command line names the run's save directory: its ranks, reserves
    included (the launcher's names it too, as pretrain.py's argument)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if str(save).encode() in command and state not in ("Z", "X"):
                found.add(int(entry.name))
    return found


# From iteration 6 on, each iteration takes 2 s more: the run is still training when the fault comes.
_SLOW = ["--train-iters", "30", "--inject-fault", "slow", "--inject-fault-iteration", "6",
         "--inject-fault-slow-secs", "2", "--exit-signal-handler"]


@pytest.mark.slow
@pytest.mark.compat
def test_a_preemption_saves_at_once_and_the_reserve_waits_for_the_save(tmp_path):
    """SIGTERM to the job (Slurm's warning signal, forwarded to every process, the reserve's included):
    the training ranks save and exit 5, as without reserves. The reserve catches it too and waits: dying
    of it, it made NVRx restart the training ranks in the middle of their save, which was lost."""
    save, log = tmp_path / "ckpt", tmp_path / "run.log"
    with reserves.running(save, log, 0, _SLOW) as run:
        reserves.wait_for(run, log, "[resil] fault: injecting slow")
        os.kill(run.pid, signal.SIGTERM)
        run.wait(timeout=300)
    out = log.read_text()
    said = re.findall(r"\[resil\] exit: SIGTERM received \(on at least one rank\) by iteration (\d+); "
                      r"saving and exiting with code 5", out)
    assert len(said) == 1, out[-6000:]
    assert not [line for line in out.splitlines() if line.startswith("[resil] restart:")], out[-6000:]
    assert layout.published_iterations(str(save))[0] == int(said[0]), out[-6000:]
    exits = [e["exit_code"] for e in reserves.events(save) if e["event"] == "exit"]
    assert exits == [exit_codes.SIGNAL_SAVED], exits
    assert not _left_of_run(save)


@pytest.mark.slow
def test_a_launcher_killed_takes_the_reserves_with_the_ranks(tmp_path):
    """kill -9 of ft_launcher: every rank, the reserve included, notices and ends (exit code 9), and
    nothing of the run is left. The reserve, outside the training loop, used to outlive it."""
    save, log = tmp_path / "ckpt", tmp_path / "run.log"
    with reserves.running(save, log, 0, _SLOW) as run:
        reserves.wait_for(run, log, "[resil] fault: injecting slow")
        [setup] = [e for e in reserves.events(save) if e["event"] == "inprocess"]
        [launcher] = [pid for pid in children_of(run.pid) if b"ft_launcher" in _command(pid)]
        workers = {pid for pid in children_of(launcher) if b"ft_launcher" not in _command(pid)}
        [reserve] = workers - set(setup["pids"])
        os.kill(launcher, signal.SIGKILL)
        run.wait(timeout=300)
        left = _left_of_run(save)  # each process watches its launcher every 0.5 s
    assert not left, (left, reserve, log.read_text()[-6000:])
    assert "exiting with code 9" in log.read_text(), log.read_text()[-6000:]


def _left_of_run(save: Path) -> set[int]:
    """The run's processes still alive once they have had a while to end (the bound is only there for a
    failure to show)."""
    deadline = time.monotonic() + 120
    while (left := _processes_of_run(save)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _command(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


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
