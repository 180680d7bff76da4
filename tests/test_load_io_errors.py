"""An I/O error while reading a checkpoint is the storage's, not the checkpoint's, until it persists:
every rank tries the candidate again together (after 1 s and 3 s); an error that goes away costs a
retry and nothing else, one that stays makes the loader skip the candidate without quarantining it and
load the next one. The errors are real EIOs from a FUSE filesystem (tests/flaky_fs.py) the checkpoint
is read through."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests import flaky_fs, launch

pytestmark = pytest.mark.slow


def _args(load, save, iters: int) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(iters), "--load", str(load),
            "--save", str(save), "--save-interval", "2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """iter_0000002 and iter_0000004, tracker at 4."""
    if (why := flaky_fs.unavailable()) is not None:
        pytest.skip(f"no FUSE here: {why}")
    root = tmp_path_factory.mktemp("trained") / "ckpt"
    result = launch.run(_args(root, root, 4))
    assert result.returncode == 0, result.stdout[-3000:]
    return root


def _mount_flaky(source, mountpoint, match: str, fail_reads: int, log):
    mountpoint.mkdir()
    proc = subprocess.Popen([sys.executable, flaky_fs.__file__, str(source), str(mountpoint), "--match", match,
                             "--fail-reads", str(fail_reads)], stderr=open(log, "w"))
    deadline = time.monotonic() + 30
    while not os.path.ismount(mountpoint):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return proc


def _unmount(proc, mountpoint) -> None:
    subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.mark.parametrize("fail_reads", [2, -1], ids=["transient", "persistent"])
def test_io_errors_on_load_are_retried_then_the_candidate_is_skipped_never_quarantined(trained, tmp_path,
                                                                                       fail_reads):
    mnt, save, fuse_log = tmp_path / "mnt", tmp_path / "ckpt", tmp_path / "flaky_fs.log"
    proc = _mount_flaky(trained, mnt, "/iter_0000004/__1_0.distcp", fail_reads, fuse_log)
    try:
        result = launch.run(_args(mnt, save, 6))
    finally:
        _unmount(proc, mnt)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert "Traceback" not in out
    eios = fuse_log.read_text().count("flaky_fs: EIO on read of /iter_0000004/__1_0.distcp")
    retries = [line for line in out.splitlines() if line.startswith("[resil] load: I/O error while")]
    assert retries and "OSError: [Errno 5] Input/output error" in retries[0], retries
    if fail_reads > 0:  # gone after a retry: the newest checkpoint is loaded after all
        assert eios == fail_reads
        assert 1 <= len(retries) <= 2
        assert "[resil] load: accepted persistent iteration 4" in out
        assert sorted(launch.losses(out)) == [5, 6]
    else:  # still there after three attempts: skipped, and the older one is loaded
        assert len(retries) == 2 and "attempt 3 of 3" in retries[1]
        assert f"[resil] load: skipped persistent iteration 4 ({mnt / 'iter_0000004'}): I/O errors persisted " \
               "through 3 attempts" in out
        assert "not quarantined" in out and "rejected" not in out
        assert "[resil] load: accepted persistent iteration 2" in out
        assert sorted(launch.losses(out)) == [3, 4, 5, 6]
    assert sorted(p.name for p in trained.iterdir() if p.name.startswith("iter_")) == ["iter_0000002",
                                                                                       "iter_0000004"]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
