"""The global non-persistent tier (--non-persistent-ckpt-type global): frequent saves that keep only
the newest, tried before an older persistent checkpoint on resume and skipped when they fail
verification."""

from __future__ import annotations

import shutil

import pytest

from megatron_resil.checkpointing.tracker import write_tracker
from tests import launch

pytestmark = pytest.mark.slow


def _args(save, iters: int) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(iters),
            "--save", str(save), "--load", str(save), "--save-interval", "4",
            "--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "2"]


@pytest.fixture(scope="module")
def crashed_after_a_non_persistent_save(tmp_path_factory):
    """Persistent iter 4, non-persistent iter 6, as a run killed after iteration 6 leaves them."""
    root = tmp_path_factory.mktemp("np") / "ckpt"
    full = launch.run(_args(root, 6))
    assert full.returncode == 0, full.stdout[-3000:]
    assert "successfully saved non-persistent checkpoint from iteration       2" in full.stdout
    # Only the newest non-persistent checkpoint is kept.
    assert sorted(p.name for p in (root / "non_persistent").glob("iter_*")) == ["iter_0000006"]
    # The final persistent save of iteration 6 never happened in the crash being simulated.
    shutil.rmtree(root / "iter_0000006")
    write_tracker(str(root), 4)
    return root, launch.losses(full.stdout)


@pytest.mark.compat
def test_resume_prefers_the_newer_non_persistent_checkpoint(crashed_after_a_non_persistent_save, tmp_path):
    source, _ = crashed_after_a_non_persistent_save
    root = tmp_path / "ckpt"
    shutil.copytree(source, root)
    result = launch.run(_args(root, 8))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[resil] load: accepted non-persistent iteration 6" in result.stdout
    assert "at iteration 6 (non-persistent tier" in result.stdout
    assert sorted(launch.losses(result.stdout)) == [7, 8]


@pytest.mark.compat
def test_a_corrupt_non_persistent_checkpoint_falls_back_to_the_persistent_one(
        crashed_after_a_non_persistent_save, tmp_path):
    source, reference = crashed_after_a_non_persistent_save
    root = tmp_path / "ckpt"
    shutil.copytree(source, root)
    shard = root / "non_persistent" / "iter_0000006" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    result = launch.run(_args(root, 6))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[resil] load: rejected non-persistent iteration 6" in result.stdout
    assert "fails its checksum" in result.stdout
    assert "[resil] load: accepted persistent iteration 4" in result.stdout
    assert list((root / "non_persistent").glob("iter_0000006.quarantined.checksum.*"))
    # Recomputed from the persistent checkpoint, iterations 5 and 6 match the original run exactly.
    resumed = launch.losses(result.stdout)
    assert {it: resumed[it] for it in (5, 6)} == {it: reference[it] for it in (5, 6)}
