"""One job per checkpoint directory: a second job on a held --save exits 2 naming the holder and saying
how to clear a stale lock, and writes nothing there; a lock whose holder is gone (dead pid here, an
expired lease elsewhere) is taken over with a logged reason; an attempt of the same job takes it back.
The lock record is untrusted: one that is no lock record is taken over with what is wrong with it, and
a live process is the holder only if it is the very process the record names."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from megatron_resil.checkpointing import dir_lock
from tests import launch


def _plant(directory, **holder) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    base = {"host": socket.gethostname(), "pid": 1, "started": "2026-01-01T00:00:00+0000",
            "renewed": time.time(), "slurm_job_id": None, "run_id": None}
    (directory / dir_lock.LOCK_NAME).write_text(json.dumps({**base, **holder}))


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_held_directory_refuses_a_second_holder_naming_the_first(tmp_path):
    first = dir_lock.DirectoryLock(str(tmp_path))
    assert first.acquire() is None
    holder = json.loads((tmp_path / dir_lock.LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(dir_lock.DirectoryInUse, match=rf"in use by another job \(host .*, pid {os.getpid()}"):
        dir_lock.DirectoryLock(str(tmp_path)).acquire()  # its own open file: flock refuses it


def test_a_lock_left_by_a_dead_process_here_is_taken_over_with_its_reason(tmp_path):
    _plant(tmp_path, pid=_dead_pid())
    reason = dir_lock.DirectoryLock(str(tmp_path)).acquire()
    assert reason is not None and "taken over from a job that is gone" in reason


def test_another_hosts_fresh_lease_is_respected_and_an_expired_one_taken_over(tmp_path):
    _plant(tmp_path / "fresh", host="node-elsewhere", pid=4242, renewed=time.time() - 10)
    with pytest.raises(dir_lock.DirectoryInUse, match="on another host .*node-elsewhere.*renewed 10 s ago.*"
                       rf"if that job is gone, remove {tmp_path / 'fresh' / dir_lock.LOCK_NAME}$"):
        dir_lock.DirectoryLock(str(tmp_path / "fresh")).acquire()
    expired = time.time() - dir_lock.LEASE_SECS - 60
    _plant(tmp_path / "stale", host="node-elsewhere", pid=4242, renewed=expired)
    reason = dir_lock.DirectoryLock(str(tmp_path / "stale")).acquire()
    assert reason is not None and "lease expired 60 s ago" in reason


def test_a_requeued_attempt_of_the_same_slurm_job_takes_it_back(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    _plant(tmp_path, host="node-elsewhere", pid=4242, slurm_job_id="777")  # fresh lease, same job
    reason = dir_lock.DirectoryLock(str(tmp_path)).acquire()
    assert reason is not None and "taken back from an earlier attempt of this job" in reason


def _start_ticks(pid: int) -> int:
    return launch.proc_stat(pid).start_ticks


def _cmdline(pid: int) -> bytes:
    """Once exec has set it up: Popen returns a moment before."""
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
        if command or time.monotonic() > deadline:
            return command
        time.sleep(0.01)


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


@pytest.fixture
def held_locks():
    """lock_run_directories keeps what it locks and what it took over in the module: give them back."""
    yield
    for lock in dir_lock._held:
        lock.release()
    dir_lock._held.clear()
    dir_lock._pending_records.clear()


MALFORMED = {
    "pid 0": (json.dumps({"host": socket.gethostname(), "pid": 0, "renewed": 0.0, "started": "x"}),
              "pid 0 is not a process id"),
    "pid -1": (json.dumps({"host": socket.gethostname(), "pid": -1, "renewed": 0.0, "started": "x"}),
               "pid -1 is not a process id"),
    "pid 2**70": (json.dumps({"host": socket.gethostname(), "pid": 2**70, "renewed": 0.0, "started": "x"}),
                  f"pid {2**70} is not a process id"),
    "renewed yesterday": (json.dumps({"host": "node-elsewhere", "pid": 4242, "renewed": "yesterday",
                                      "started": "x"}), "renewed 'yesterday' is not a time"),
    "renewed in the future": (json.dumps({"host": "node-elsewhere", "pid": 4242, "started": "x",
                                          "renewed": 4e9}), "s in the future"),
    "garbage": ("\x00\x01 not json {", "not JSON"),
    "a JSON list": (json.dumps([1, 2, 3]), "[1, 2, 3] is not a JSON object"),
    "a huge record": (json.dumps({"host": "h" * 2_000_000, "pid": 4242}), "over 4096 bytes"),
    "deep nesting": ("[" * 4000, "not JSON"),
    "a host with a newline": (json.dumps({"host": "node\nforged", "pid": 4242, "renewed": time.time(),
                                          "started": "x"}), "host 'node\\nforged' is not a short printable"),
}


@pytest.mark.parametrize("content, reason", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_lock_record_is_taken_over_with_one_logged_line_saying_why(tmp_path, capsys, held_locks,
                                                                               content, reason):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / dir_lock.LOCK_NAME).write_text(content)
    dir_lock.lock_run_directories(SimpleNamespace(save=str(save), non_persistent_ckpt_type=None))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and reason in lines[0], lines
    assert lines[0].startswith(f"[resil] lock: {save}: taken over from a job that left a malformed lock")
    assert json.loads((save / dir_lock.LOCK_NAME).read_text())["pid"] == os.getpid()  # ours now


def test_a_lease_a_little_ahead_of_our_clock_is_skew_and_respected(tmp_path):
    _plant(tmp_path, host="node-elsewhere", pid=4242, renewed=time.time() + 30)
    with pytest.raises(dir_lock.DirectoryInUse, match="on another host .*renewed 0 s ago"):
        dir_lock.DirectoryLock(str(tmp_path)).acquire()


def test_an_unrelated_live_process_naming_the_directory_is_not_taken_for_the_holder(tmp_path):
    save = tmp_path / "ckpt"
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", str(save)])
    try:
        assert str(save).encode() in _cmdline(unrelated.pid)  # what the old check took for the holder's mark
        _plant(save, pid=unrelated.pid)  # as an earlier version wrote it: no start time
        reason = dir_lock.DirectoryLock(str(save)).acquire()
        assert reason is not None and "taken over from a job that is gone" in reason
        assert f"pid {unrelated.pid} is alive but holds no lock" in reason

        other = tmp_path / "other"
        _plant(other, pid=unrelated.pid, boot_id=_boot_id(), start_ticks=_start_ticks(unrelated.pid) + 1)
        reason = dir_lock.DirectoryLock(str(other)).acquire()
        assert reason is not None and f"pid {unrelated.pid} is now another process" in reason

        _plant(tmp_path / "rebooted", pid=unrelated.pid, boot_id="an-earlier-boot",
               start_ticks=_start_ticks(unrelated.pid))
        reason = dir_lock.DirectoryLock(str(tmp_path / "rebooted")).acquire()
        assert reason is not None and "written before this host last booted" in reason
        assert unrelated.poll() is None
    finally:
        unrelated.kill()
        unrelated.wait()


def test_the_very_process_a_record_names_is_refused_even_if_its_flock_is_gone(tmp_path):
    """Its lock file replaced under it (a copy of the directory synced over it, say): the process the
    record names, by pid, start time and boot, is alive, so the directory is still its."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _plant(tmp_path, pid=holder.pid, boot_id=_boot_id(), start_ticks=_start_ticks(holder.pid))
        with pytest.raises(dir_lock.DirectoryInUse, match=rf"pid {holder.pid}, .*alive though it holds no "
                           rf"flock.*; if that job is gone, remove {tmp_path / dir_lock.LOCK_NAME}$"):
            dir_lock.DirectoryLock(str(tmp_path)).acquire()
    finally:
        holder.kill()
        holder.wait()
    reason = dir_lock.DirectoryLock(str(tmp_path)).acquire()
    assert reason is not None and "no such process" in reason


def test_a_live_holder_in_another_process_is_refused_and_its_lock_taken_over_once_it_is_killed(tmp_path):
    script = ("import sys, time; from megatron_resil.checkpointing import dir_lock; "
              "dir_lock.DirectoryLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=launch.REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(dir_lock.DirectoryInUse) as refused:
            dir_lock.DirectoryLock(str(tmp_path)).acquire()
        message = str(refused.value)
        assert "\n" not in message
        assert f"in use by another job (host {socket.gethostname()}, pid {holder.pid}," in message
        assert message.endswith(f"; if that job is gone, remove {tmp_path / dir_lock.LOCK_NAME}")
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    reason = dir_lock.DirectoryLock(str(tmp_path)).acquire()
    assert reason is not None and f"taken over from a job that is gone (host {socket.gethostname()}, pid " \
        f"{holder.pid}" in reason and "no such process" in reason


@pytest.mark.slow
def test_a_second_job_on_the_same_save_exits_2_and_the_first_finishes_untouched(tmp_path):
    save = tmp_path / "ckpt"
    log_a = tmp_path / "a.log"
    args = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--save", str(save), "--load", str(save),
            "--save-interval", "2", "--log-interval", "1"]
    job_a = launch.start([*args, "--train-iters", "100000"], log_path=log_a)
    try:
        deadline = time.monotonic() + 120
        while "successfully saved checkpoint from iteration       2" not in log_a.read_text():
            assert job_a.poll() is None and time.monotonic() < deadline, log_a.read_text()[-3000:]
            time.sleep(0.2)
        starts_before = (save / "events.jsonl").read_text().count('"event": "start"')

        job_b = launch.run([*args, "--train-iters", "4"])
        out = job_b.stdout
        root_cause = re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", out, re.DOTALL)
        assert root_cause and int(root_cause.group(1)) == 2, out[-3000:]
        # `in`, not startswith: under load the other rank's output can land at the start of the line.
        refusal = [line for line in out.splitlines() if "[resil] exit:" in line]
        said = "\n".join(line for line in out.splitlines() if "[resil" in line)
        assert len(refusal) == 1 and f"{save} is in use by another job" in refusal[0], said or out[-3000:]
        holder = json.loads((save / dir_lock.LOCK_NAME).read_text())
        assert f"pid {holder['pid']}" in refusal[0]
        assert job_a.poll() is None  # the first job trains on
        starts_after = (save / "events.jsonl").read_text().count('"event": "start"')
        assert starts_after == starts_before  # B wrote nothing there
    finally:
        _kill_tree(job_a)

    # The first job is gone (SIGKILL, its lock with it): the next one takes the directory over, says why,
    # and resumes from what the first one saved.
    job_c = launch.run([*args, "--train-iters", "3"])
    assert job_c.returncode == 0, job_c.stdout[-3000:]
    assert f"[resil] lock: {save}: taken over from a job that is gone" in job_c.stdout
    assert "successfully loaded checkpoint" in job_c.stdout


def _kill_tree(proc) -> None:
    for pid in {proc.pid} | launch.descendants_of(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    time.sleep(1.0)
