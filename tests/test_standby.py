"""Ranks forked from a standby (megatron_resil/launch/standby.py) are the ranks to everyone outside.

The process the launcher started is the rank to torchrun, ft_launcher, Slurm and the tests: what is done
to it (SIGSTOP, SIGCONT, kill -9, SIGTERM) is done to the worker, and the worker's end is its end. A rank
the standby cannot serve imports for itself, saying why in one line; the standby serves its own user only,
and a standby that dies ends its ranks with one line. Every rank the other tests start uses the standby
their test process started (tests/conftest.py), so the rest of the suite is this feature's test too."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_resil.launch import standby
from megatron_resil.launch import standby_wire as wire
from tests import launch

pytestmark = pytest.mark.slow

LONG_RUN = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "100000", "--log-interval", "1"]


@pytest.fixture
def session_standby(_standby) -> str:
    """The standby this test process started (tests/conftest.py)."""
    if _standby is None:
        pytest.skip("the suite runs without a standby (MEGATRON_RESIL_TEST_STANDBY=0)")
    return _standby


def _wait(condition, what: str, timeout: float = 120, proc=None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None and log is not None:
            raise AssertionError(f"the run ended while waiting for {what}: {log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s" + \
            (f"\n{log.read_text()[-3000:]}" if log is not None else "")
        time.sleep(0.05)


def _start_one_rank(tmp_path: Path, value: str | None = None):
    """A one-rank torchrun run that trains until killed, its rank forked from the standby `value`
    (NAME@PID; by default the tests' one); returns (torchrun, log, client, worker)."""
    log = tmp_path / "run.log"
    proc = launch.start(LONG_RUN, nproc=1, log_path=log)
    try:
        _wait(lambda: "iteration        2/" in log.read_text(), "iteration 2", proc=proc, log=log)
        (client,) = [pid for pid in launch.children_of(proc.pid)
                     if b"LOCAL_RANK=" in Path(f"/proc/{pid}/environ").read_bytes()]
        (worker,) = launch.children_of(launch.standby_pid(value))
    except BaseException:  # never leave a run that trains until killed behind
        _kill_tree(proc, *[pid for pid in launch.children_of(proc.pid)])
        raise
    return proc, log, client, worker


def _kill_tree(proc, *pids: int) -> None:
    for pid in (proc.pid, *pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def test_stop_continue_and_kill_of_the_launchers_process_reach_the_worker(tmp_path, session_standby):
    proc, log, client, worker = _start_one_rank(tmp_path)
    try:
        # The standby's fork, not torchrun's.
        assert worker != client and launch.proc_stat(worker).parent != proc.pid
        os.kill(client, signal.SIGSTOP)
        _wait(lambda: launch.proc_stat(worker).state == "T", "the worker stopped with its client", timeout=5)
        lines = log.read_text().count("iteration ")
        time.sleep(1.0)
        assert log.read_text().count("iteration ") == lines  # stopped: it trains no further
        os.kill(client, signal.SIGCONT)
        _wait(lambda: launch.proc_stat(worker).state != "T", "the worker continued with its client",
              timeout=5)
        _wait(lambda: log.read_text().count("iteration ") > lines, "training to go on", timeout=30)
        os.kill(client, signal.SIGKILL)  # what a launcher, a rank monitor or the OOM killer does
        _wait(lambda: not launch.alive(worker), "the worker to die with its client", timeout=5)
        assert proc.wait(timeout=60) != 0  # torchrun saw its rank killed (no restarts asked for)
    finally:
        _kill_tree(proc, client, worker)
    assert "Signal 9 (SIGKILL) received by PID" in log.read_text()


def _wakeups(pid: int) -> int:
    """How often process `pid` has gone to sleep and been woken (voluntary context switches)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


def test_the_client_sleeps_while_its_worker_trains(tmp_path, session_standby):
    """A client wakes for a signal or its worker's end, nothing else: it used to read the worker's
    dispositions every 10 ms, and nine of them took a tenth of a 2-core machine."""
    proc, log, client, worker = _start_one_rank(tmp_path)
    try:
        before, lines = _wakeups(client), log.read_text().count("iteration ")
        _wait(lambda: log.read_text().count("iteration ") >= lines + 50, "50 more iterations", proc=proc,
              log=log)
        assert _wakeups(client) - before <= 2, _wakeups(client) - before
    finally:
        _kill_tree(proc, client, worker)


def test_the_workers_end_is_the_clients_a_signal_as_a_signal(tmp_path, session_standby):
    proc, log, client, worker = _start_one_rank(tmp_path)
    try:
        os.kill(worker, signal.SIGKILL)  # a fault inside the rank itself
        _wait(lambda: not launch.alive(client), "the client to end as its worker did", timeout=10)
        assert proc.wait(timeout=60) != 0
    finally:
        _kill_tree(proc, client, worker)
    assert "Signal 9 (SIGKILL) received by PID" in log.read_text()  # torchrun: killed by SIGKILL, not exit 1


def test_sigterm_is_passed_on_and_the_exit_code_comes_back(tmp_path, session_standby):
    save = tmp_path / "ckpt"
    log = tmp_path / "run.log"
    proc = launch.start([*LONG_RUN, "--save", str(save), "--save-interval", "1000", "--exit-signal-handler"],
                        nproc=1, log_path=log)
    try:
        _wait(lambda: "iteration        2/" in log.read_text(), "iteration 2", proc=proc, log=log)
        (client,) = [pid for pid in launch.children_of(proc.pid)
                     if b"LOCAL_RANK=" in Path(f"/proc/{pid}/environ").read_bytes()]
        os.kill(client, signal.SIGTERM)  # the launcher's own SIGTERM would go to it the same way
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    out = log.read_text()
    assert "exitcode  : 5" in out or "exitcode: 5" in out, out[-3000:]  # SIGNAL_SAVED, through the client
    assert (save / "latest_checkpointed_iteration.txt").exists()


def test_a_rank_with_another_import_environment_imports_for_itself(tmp_path, session_standby):
    env = {**launch.env(), "OMP_NUM_THREADS": "2"}  # torch would be set up for another thread count
    command = launch.torchrun_cmd([*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "4"], nproc=1)
    out = subprocess.run(command, env=env, cwd=launch.REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("[resil] standby:")]
    assert lines == [f"[resil] standby: {standby.ENV}={session_standby} not used: it was started with "
                     "another import-time environment (OMP_NUM_THREADS differs); this rank imports torch "
                     "itself"], out.stderr[-3000:]
    assert "iteration        4/" in out.stdout


@pytest.mark.parametrize("launcher_args,env,expected", [
    (["--nproc-per-node", "4"], {}, "1"),  # torchrun and ft_launcher set it for their ranks
    (["--nproc_per_node=2"], {}, "1"),
    (["--nproc-per-node", "1"], {}, None),
    (["--nproc-per-node", "4"], {"OMP_NUM_THREADS": "8"}, "8"),  # a value the user set is kept
    ([], {}, None),
])
def test_a_launchers_standby_gets_the_thread_count_its_ranks_get(launcher_args, env, expected):
    command = ["python", "-m", "torch.distributed.run", *launcher_args, "pretrain.py"]
    assert standby.ranks_environment(command, env).get("OMP_NUM_THREADS") == expected


def test_what_a_launcher_sets_for_each_rank_is_not_import_time_environment(monkeypatch):
    """A rank under ft_launcher (NVRx 0.7) or torchrun has these; the standby, started beside them, not."""
    before = standby.fingerprint()
    for name, value in {"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_WORKER_IDENTICAL": "1",
                        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_WORKER_SERVER_SOCKET": "/s",
                        "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"}.items():
        monkeypatch.setenv(name, value)
    assert standby.fingerprint() == before
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "error")  # read when torch is imported
    assert standby.fingerprint() != before


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user")
def test_the_standby_serves_its_own_user_only(session_standby):
    assert standby.ping(session_standby)
    child = os.fork()
    if child == 0:  # another user on the same host, who sends a ping: closed, nothing read or answered
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(30)
                sock.connect(wire.address(session_standby.partition("@")[0]))
                wire.send(sock, {"ping": True})
                wire.receive(sock)
            code = 0
        except (OSError, ValueError):  # the connection closed, or reset with the ping unread
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 3


def test_a_standby_that_dies_ends_its_ranks_with_one_line(tmp_path):
    name = f"test-dies-{os.getpid()}"
    own = subprocess.Popen([sys.executable, "-m", "megatron_resil.launch.standby", "--name", name],
                           env=launch.env(), cwd=launch.REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    value = f"{name}@{own.pid}"
    proc = None
    try:
        _wait(lambda: standby.ping(value), "the standby to start", timeout=60)
        session = os.environ.get(standby.ENV)
        os.environ[standby.ENV] = value  # launch.env() passes it to the ranks
        try:
            proc, log, client, worker = _start_one_rank(tmp_path, value)
        finally:
            if session is None:
                os.environ.pop(standby.ENV)
            else:
                os.environ[standby.ENV] = session
        own.kill()
        _wait(lambda: not launch.alive(worker) and not launch.alive(client),
              "the rank to end with its standby", timeout=10)
        assert proc.wait(timeout=60) != 0
        out = log.read_text()
        assert f"[resil] standby: the standby process that ran this rank (worker pid {worker}) is gone; " \
               "the rank ends with it; exiting with code 1" in out, out[-3000:]
    finally:
        own.kill()
        own.wait()
        if proc is not None and proc.poll() is None:
            _kill_tree(proc)


def test_an_inprocess_rank_needs_a_standby_that_imported_torch_with_its_log_level(session_standby):
    """--inprocess-restart sets torch's C++ log level before torch is imported (NVRx's store polls); the
    tests' standby imported torch without it, so it cannot serve the rank, and says why. A launcher's
    standby (RESIL_STANDBY=1) sets it as pretrain.py would (test_replica_recovery)."""
    out = launch.run_single(["--inprocess-restart", "--check-args-only", *launch.TINY_MODEL,
                             *launch.TINY_TRAINING, "--train-iters", "4"])
    assert out.returncode == 0, out.stderr[-2000:]
    why = "not used: it was started with another import-time environment (TORCH_CPP_LOG_LEVEL"
    assert why in out.stderr, out.stderr[-2000:]


def test_a_launchers_standby_imports_torch_with_the_log_level_its_inprocess_ranks_set():
    assert standby.ranks_environment(["ft_launcher", "pretrain.py", "--inprocess-restart"],
                                     {})["TORCH_CPP_LOG_LEVEL"] == "error"
    assert "TORCH_CPP_LOG_LEVEL" not in standby.ranks_environment(["ft_launcher", "pretrain.py"], {})
    kept = standby.ranks_environment(["ft_launcher", "pretrain.py", "--inprocess-restart"],
                                     {"TORCH_CPP_LOG_LEVEL": "info"})
    assert kept["TORCH_CPP_LOG_LEVEL"] == "info"  # a level the user set is kept
