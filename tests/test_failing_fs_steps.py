"""A file-system step that fails on one rank ends in a logged line, never in the other ranks waiting for
it: rank 0's start-up cleanup of leftovers, rank 0's retention, and one rank's local-tier cleanup each
meet a real OSError (a leftover that is a directory where a file is expected, a checkpoint directory
that is a mount point and cannot be renamed, a leftover shard that is a mount point and cannot be
unlinked); the run logs each, keeps what it could not remove, trains on and finishes."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests import launch

pytestmark = pytest.mark.slow


def _args(save, local, iters: int, *extra: str) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(iters), "--save", str(save),
            "--load", str(save), "--save-interval", "2", "--non-persistent-ckpt-type", "local",
            "--non-persistent-local-ckpt-dir", str(local), "--non-persistent-save-interval", "3", *extra]


def _bind_mount_on_itself(path) -> None:
    """`path` becomes a mount point: rename and unlink of it fail with EBUSY, as on a busy filesystem."""
    done = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root): {done.stderr.strip()}")


def test_cleanup_and_retention_failures_on_one_rank_are_logged_and_the_run_finishes(tmp_path):
    save, local = tmp_path / "ckpt", tmp_path / "local"
    first = launch.run(_args(save, local, 4))
    assert first.returncode == 0, first.stdout[-3000:]
    assert (save / "iter_0000002").is_dir() and (save / "iter_0000004").is_dir()
    # Rank 0's start-up cleanup: an interrupted tracker update's temp file that is a directory.
    (save / ".latest_checkpointed_iteration.txt.tmp.abc123").mkdir()
    # Rank 1's local-tier cleanup: a leftover shard of an interrupted save that cannot be unlinked.
    dirty = local / "1" / "iter_0000009_1_local.pt.dirty"
    dirty.write_bytes(b"half a shard")
    mounts = [dirty, save / "iter_0000002"]
    try:
        _bind_mount_on_itself(dirty)
        # Rank 0's retention: iter_0000002 is due for deletion but cannot be renamed out of the way.
        _bind_mount_on_itself(save / "iter_0000002")
        second = launch.run(_args(save, local, 8, "--ckpt-keep-last", "1"))
    finally:
        for path in mounts:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
    out = second.stdout
    assert second.returncode == 0, out[-4000:]
    assert "Traceback" not in out
    assert "[resil] cleanup: could not remove" in out and ".tmp.abc123 (interrupted tracker update)" in out
    assert ("[resil] cleanup: local tier: left 1 leftover(s) in place (never loaded): rank 1: "
            "could not remove") in out
    assert f"[resil] retention: could not delete {save / 'iter_0000002'}" in out and "; kept" in out
    assert f"[resil] retention: deleted {save / 'iter_0000004'}" in out  # the rest of retention went on
    assert sorted(launch.losses(out)) == [5, 6, 7, 8]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert (save / "iter_0000002").is_dir() and not (save / "iter_0000004").exists()
    shutil.rmtree(save / ".latest_checkpointed_iteration.txt.tmp.abc123")
