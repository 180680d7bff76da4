"""--async-save under real torchrun runs: checkpoints written in the background are published
atomically and resume exactly; a worker that is stopped (stuck) or killed mid-run is detected within
bounded time, its save dropped, and training goes on with the next save. On storage held up for real (a FUSE
file system that stalls the writes of one save until the test lets them go): the local tier's files are all
sealed, replicated and written by the workers, and a save that comes due while the previous one is still
being written is skipped or waits, as --async-save-when-busy says, and says so once."""

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
from tests import flaky_fs, launch

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
        assert set(e["blocking_parts"]) == {"prepare", "plan", "copy", "copy_wait", "wait", "finalize"}, e
        assert math.isclose(e["blocking_seconds"], sum(e["blocking_parts"].values()), abs_tol=0.01), e
        assert 0 < e["blocking_seconds"] <= e["seconds"] and e["worker_cpu_seconds"] > 0, e
        assert e["worker_write_seconds"] > 0, e
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


# ---- storage that cannot keep up: writes held on a FUSE file system ----------------------------------------

BUSY_LINE = "is due while the async save"


def _held_run(tmp_path: Path, args: list[str], nproc: int) -> tuple[str, list[dict], list[dict], str]:
    """Run with the local tier on a FUSE mount whose writes of iteration 2's files are held until the run says
    that a save came due while they were. Returns (output, event log, writers, the FUSE log)."""
    if (why := flaky_fs.unavailable()) is not None:
        pytest.skip(f"no FUSE here: {why}")
    source, mnt, release = tmp_path / "local_source", tmp_path / "local", tmp_path / "release"
    writers, fuse_log, out = tmp_path / "writers.jsonl", tmp_path / "flaky_fs.log", tmp_path / "run.log"
    source.mkdir()
    fuse = flaky_fs.mount(source, mnt, ["--writable", "--stall-writes", "iter_0000002_", "--release",
                                        str(release), "--record-writers", str(writers)], fuse_log)
    try:
        proc = launch.start([*args, "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir",
                             str(mnt)], nproc=nproc, log_path=out)
        try:
            deadline = time.monotonic() + 240  # only a guard: the test waits for the line
            while BUSY_LINE not in out.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            release.touch()
            assert proc.wait(timeout=240) == 0, out.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        flaky_fs.unmount(fuse, mnt)
    log = [json.loads(line) for line in (tmp_path / "save" / "events.jsonl").read_text().splitlines()]
    written = [json.loads(line) for line in writers.read_text().splitlines()] if writers.exists() else []
    return out.read_text(), log, written, fuse_log.read_text()


def _stalled_args(tmp_path: Path, iters: int, save_interval: int, extra=()) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(iters), "--save",
            str(tmp_path / "save"), "--save-interval", str(save_interval),
            "--non-persistent-save-interval", "2", "--async-save", *extra]


@pytest.fixture(scope="module")
def held_and_skipped(tmp_path_factory):
    """2 ranks, local saves every 2 iterations replicated to the other rank, in the background; the writes of
    iteration 2 held until the save due at 4 has been decided: with --async-save-when-busy skip."""
    tmp_path = tmp_path_factory.mktemp("held")
    args = _stalled_args(tmp_path, 5, 100, ["--async-save-when-busy", "skip", "--replication",
                                            "--replication-jump", "1", "--replication-factor", "2"])
    return _held_run(tmp_path, args, 2)


def test_the_local_tiers_files_are_sealed_replicated_and_written_by_the_worker_not_the_trainer(
        held_and_skipped):
    """The trainer's share of a local async save is the staging: every file of the local tier (each rank's own
    shard and its peer's replica, their manifests) is created and written by the ranks' checkpoint workers,
    whose event-log phases hold the serialising, checksumming and replication."""
    out, log, written, _ = held_and_skipped
    files = [w for w in written if w["path"].endswith((".pt", ".json")) or ".tmp." in w["path"]]
    shards = {w["path"] for w in files if w["path"].endswith("_local.pt")}
    expected = {f"/{rank}/iter_0000002_{owner}_local.pt" for rank in (0, 1) for owner in (0, 1)}
    assert shards == expected, written
    assert {w["comm"] for w in files} == {WORKER_COMM}, [w for w in files if w["comm"] != WORKER_COMM]
    assert len({w["pid"] for w in files}) == 2  # one worker per rank
    local = [e for e in log if e["event"] == "save_published" and e["tier"] == "local"]
    assert [e["iteration"] for e in local] == [2] and local[0]["asynchronous"], local
    for phase in ("serialize", "checksum", "replicate", "write"):
        assert local[0][f"worker_{phase}_seconds"] >= 0, local[0]
    trainer_parts = {"prepare", "plan", "copy", "copy_wait", "wait", "finalize"}  # staging, nothing else
    assert set(local[0]["blocking_parts"]) == trainer_parts, local[0]


def test_a_save_due_while_the_previous_is_still_being_written_is_skipped_and_said_once(held_and_skipped):
    out, log, _, fuse_log = held_and_skipped
    assert "flaky_fs: stalling writes of /0/" in fuse_log and "flaky_fs: stalling writes of /1/" in fuse_log
    said = [line for line in out.splitlines() if BUSY_LINE in line]
    assert len(said) == 1, said
    assert said[0].startswith("[resil] save: the local save of iteration 4 is due while the async save of "
                              "local iteration 2 is still being written (in the background for "), said
    assert "saves are due every 2 iterations" in said[0], said
    assert "skipping this save (--async-save-when-busy skip)" in said[0], said
    busy = [e for e in log if e["event"] == "save_busy"]
    assert [(e["iteration"], e["busy_iteration"], e["action"]) for e in busy] == [(4, 2, "skip")], busy
    assert busy[0]["writing_seconds"] > 0 and busy[0]["interval"] == 2
    started = [(e["tier"], e["iteration"]) for e in log if e["event"] == "save_started"]
    assert ("local", 4) not in started and ("local", 2) in started, started
    assert "successfully saved local checkpoint from iteration       2" in out


def test_a_save_due_while_the_previous_is_still_being_written_waits_for_it_by_default(tmp_path):
    """One rank: the local save of iteration 2 is held; the persistent save due at 3 waits for it, says so
    once, then saves; both are published, in that order."""
    out, log, _, _ = _held_run(tmp_path, _stalled_args(tmp_path, 4, 3), 1)
    said = [line for line in out.splitlines() if BUSY_LINE in line]
    assert len(said) == 1 and said[0].startswith(
        "[resil] save: the persistent save of iteration 3 is due while the async save of local iteration 2 "
        "is still being written"), said
    assert "waiting for it (--async-save-when-busy wait;" in said[0], said
    busy = [e for e in log if e["event"] == "save_busy"]  # later ones may find a save of 3 still writing
    assert (busy[0]["tier"], busy[0]["iteration"], busy[0]["busy_iteration"]) == ("persistent", 3, 2), busy
    assert {e["action"] for e in busy} == {"wait"}, busy
    order = [(e["event"], e["tier"], e["iteration"]) for e in log
             if e["event"] in ("save_started", "save_published")]
    assert order.index(("save_published", "local", 2)) < order.index(("save_started", "persistent", 3)), order
    assert ("save_published", "persistent", 3) in order
