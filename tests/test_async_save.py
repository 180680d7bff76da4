"""--async-save under real torchrun runs: checkpoints written in the background are published
atomically and resume exactly; a worker that is stopped (stuck) or killed mid-run is detected within
bounded time, its save dropped, and training goes on with the next save."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from megatron_resil.checkpointing import layout
from megatron_resil.checkpointing.tracker import write_tracker
from tests import launch

pytestmark = pytest.mark.slow

WORKER_COMM = "resil-ckpt-wkr"
ITERS_AROUND_A_STRIKE = 30


def _args(root: Path, iters: int, extra=()) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(iters), "--save", str(root),
            "--load", str(root), "--save-interval", "2", "--async-save", "--use-persistent-ckpt-worker",
            *extra]


def _verify(root: Path) -> subprocess.CompletedProcess:
    return launch.ckpt_tool("verify", root)


def test_async_checkpoints_are_published_atomically_and_resume_exactly(tmp_path):
    """Persistent saves at 2, 4, 6 and global non-persistent ones at 1, 3, 5, all in the background."""
    root, np_dir = tmp_path / "ckpt", tmp_path / "np"
    non_persistent = ["--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir", str(np_dir),
                      "--non-persistent-save-interval", "1"]
    full = launch.run(_args(root, 6, non_persistent))
    assert full.returncode == 0, full.stdout[-3000:]
    for iteration in (2, 4, 6):
        assert f"successfully saved checkpoint from iteration {iteration:7d}" in full.stdout
    decisions = "\n".join(line for line in full.stdout.splitlines() if "[resil]" in line)
    for iteration in (1, 3, 5):
        assert f"successfully saved non-persistent checkpoint from iteration {iteration:7d}" in full.stdout, \
            decisions
    assert layout.published_iterations(str(root)) == [6, 4, 2]
    assert layout.published_iterations(str(np_dir)) == [5]  # only the newest is kept
    # Each background save says what it cost the trainer, by part, and what its write cost the worker.
    published = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()
                 if '"save_published"' in line]
    background = [e for e in published if e.get("asynchronous")]
    assert {e["iteration"] for e in background} == {1, 2, 3, 4, 5, 6}, published
    for e in background:
        assert set(e["blocking_parts"]) == {"prepare", "stage", "wait", "finalize"}, e
        assert math.isclose(e["blocking_seconds"], sum(e["blocking_parts"].values()), abs_tol=0.01), e
        assert 0 < e["blocking_seconds"] <= e["seconds"] and e["worker_cpu_seconds"] > 0, e
    assert not any(layout.leftovers(str(root)).values()) and not any(layout.leftovers(str(np_dir)).values())
    check = _verify(root)
    assert check.returncode == 0 and check.stdout.count(": ok (sizes and checksums") == 3, check.stdout
    assert _verify(np_dir).returncode == 0
    # Resume from the background-written iteration 4: the loss curve continues exactly.
    shutil.rmtree(root / "iter_0000006")
    shutil.rmtree(np_dir)
    write_tracker(str(root), 4)
    resumed = launch.run(_args(root, 6))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "[resil] load: accepted persistent iteration 4" in resumed.stdout
    reference, again = launch.losses(full.stdout), launch.losses(resumed.stdout)
    assert again[5] == reference[5] and again[6] == reference[6]


def _comm(pid) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _parent(pid) -> int | None:
    found = launch.proc_stat(pid)
    return None if found is None else found.parent


def _descends_from(pid: int, ancestor: int) -> bool:
    for _ in range(8):
        pid = _parent(pid)
        if pid is None or pid <= 1:
            return False
        if pid == ancestor:
            return True
    return False


def _workers(launched_by: int | None = None) -> list[int]:
    """The async workers: named processes whose parent is a trainer (megatron-core's writers, which
    a worker forks, inherit its name); only those of the run `launched_by` started, when given (another
    test's run may have workers of its own on this machine; a rank forked from the tests' standby, and so
    its workers, descend from that standby, which serves only this test process)."""
    found = []
    standby = launch.standby_pid()  # a rank forked from the tests' standby descends from it
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or _comm(entry) != WORKER_COMM:
            continue
        parent = _parent(entry)
        if parent is None or _comm(parent) == WORKER_COMM:
            continue
        if launched_by is None or _descends_from(int(entry), launched_by) or \
                (standby is not None and _descends_from(int(entry), standby)):
            found.append(int(entry))
    return found


def _strike_workers(proc: subprocess.Popen, signals: list[int], struck: list) -> None:
    """Send each signal in turn to a worker that appeared after the previous strike: the first to
    one of the workers that start with training, the next to the fresh worker that replaced it."""
    seen = set(_workers(proc.pid))
    deadline = time.monotonic() + 180
    for sig in signals:
        while time.monotonic() < deadline and proc.poll() is None:
            new = [pid for pid in _workers(proc.pid) if pid not in seen]
            if new:
                time.sleep(2.0)  # a few iterations in: a save is in flight or about to be
                seen |= set(_workers(proc.pid))
                os.kill(new[0], sig)
                struck.append(new[0])
                break
            time.sleep(0.05)


@pytest.mark.parametrize("sig,expected", [
    (signal.SIGSTOP, "--async-save-timeout-secs 8 and was killed"),  # before or after its start-up
    (signal.SIGKILL, "died, exit code -9"),
], ids=["stuck-worker", "killed-worker"])
def test_a_stuck_or_dead_worker_is_reported_and_training_continues(tmp_path, sig, expected):
    root = tmp_path / "ckpt"
    log = tmp_path / "run.log"
    # Slow iterations (9 s of training), so that the worker, whose start-up on a loaded machine takes
    # seconds, is struck while saves keep coming after the strike.
    slow = ["--async-save-timeout-secs", "8", "--inject-fault", "slow", "--inject-fault-iteration", "1",
            "--inject-fault-slow-secs", "0.3"]
    proc = launch.start(_args(root, ITERS_AROUND_A_STRIKE, slow), log_path=log)
    struck: list[int] = []
    striker = threading.Thread(target=_strike_workers, args=(proc, [sig], struck))
    striker.start()
    try:
        assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        striker.join()
        if proc.poll() is None:
            proc.kill()
        for pid in struck:  # never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    out = log.read_text()
    assert struck, "no async worker appeared"
    reported = [line for line in out.splitlines() if line.startswith("[resil] save: async")]
    assert reported and any(expected in line or "had died, exit code -9" in line for line in reported), \
        out[-3000:]
    # Later saves went through a fresh worker; everything published is complete.
    assert f"successfully saved checkpoint from iteration {ITERS_AROUND_A_STRIKE:7d}" in out
    published = layout.published_iterations(str(root))
    assert published[0] == ITERS_AROUND_A_STRIKE and len(published) >= 2, published
    assert _verify(root).returncode == 0
    assert not any(layout.leftovers(str(root)).values())


@pytest.mark.parametrize("kind", ["local"])  # global: see the first test
def test_async_non_persistent_saves_resume_exactly(tmp_path, kind):
    """Non-persistent saves every iteration, written in the background; the newest one (iteration
    5) is resumed from, through a replica for a lost rank directory in the local tier."""
    root, np_dir = tmp_path / "ckpt", tmp_path / kind
    tier = (["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", str(np_dir),
             "--replication", "--replication-jump", "1", "--replication-factor", "2"] if kind == "local" else
            ["--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir", str(np_dir)])
    extra = [*tier, "--non-persistent-save-interval", "1"]
    args = _args(root, 6, extra)
    args[args.index("--save-interval") + 1] = "6"  # persistent at 6: non-persistent at 1 to 5
    full = launch.run(args)
    assert full.returncode == 0, full.stdout[-3000:]
    assert f"successfully saved {kind if kind == 'local' else 'non-persistent'} checkpoint from " \
           "iteration       5" in full.stdout, full.stdout[-3000:]
    assert "[resil] save: async" not in full.stdout  # no failure reported
    check = launch.ckpt_tool("which", root, f"--non-persistent-{kind}-ckpt-dir", np_dir)
    assert check.returncode == 0, check.stdout + check.stderr
    shutil.rmtree(root)  # only the non-persistent tier is left to resume from
    if kind == "local":
        shutil.rmtree(np_dir / "1")  # and rank 1's shard only as rank 0's replica of it
    resumed = launch.run(args)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"[resil] load: accepted {kind if kind == 'local' else 'non-persistent'} iteration 5" \
        in resumed.stdout, resumed.stdout[-3000:]
    assert launch.losses(resumed.stdout)[6] == launch.losses(full.stdout)[6]
