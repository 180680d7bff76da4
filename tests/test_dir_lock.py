"""One job per checkpoint directory: a second job on a held --save exits 2 naming the holder and writes
nothing there; a lock whose holder is gone (dead pid here, an expired lease elsewhere) is taken over
with a logged reason; an attempt of the same job takes it back."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time

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
    with pytest.raises(dir_lock.DirectoryInUse, match="on another host .*node-elsewhere.*renewed 10 s ago"):
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
        refusal = [line for line in out.splitlines() if line.startswith("[resil] exit:")]
        assert len(refusal) == 1 and f"{save} is in use by another job" in refusal[0], out[-3000:]
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
    pids = {proc.pid}
    for _ in range(3):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError):
                    continue
                if ppid in pids:
                    pids.add(int(entry))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    time.sleep(1.0)
