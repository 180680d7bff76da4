"""The node-local tier (--non-persistent-ckpt-type local) under real torchrun runs: corruption of own
shards, replicas and manifests, done to the real files on disk. Node loss with replication, a corrupted
replica and a NaN written with consistent checksums (the canary) are the node-loss drill's variants
(tests/test_node_loss_drill.py); an exact resume through a replica is in tests/test_async_save.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests import launch

pytestmark = pytest.mark.slow


def _args(root: Path, iters: int, nproc: int, jump: int, extra=()) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--global-batch-size", str(2 * nproc),
            "--train-iters", str(iters), "--save", str(root / "save"), "--load", str(root / "save"),
            "--save-interval", "5", "--non-persistent-ckpt-type", "local",
            "--non-persistent-local-ckpt-dir", str(root / "local"), "--non-persistent-save-interval", "3",
            "--replication", "--replication-jump", str(jump), "--replication-factor", "2", *extra]


def _killed_after_local_save(root: Path, nproc: int, jump: int) -> dict:
    """Persistent iteration 5 and local iteration 6, then every rank is killed before iteration 9
    (so iterations 7 and 8 are the reference for the resumed run)."""
    run = launch.run(_args(root, 12, nproc, jump,
                           ["--inject-fault", "kill", "--inject-fault-iteration", "9",
                            "--inject-fault-ranks", "0"]), nproc=nproc)
    assert "successfully saved local checkpoint from iteration       6" in run.stdout, run.stdout[-3000:]
    assert (root / "save" / "iter_0000005").is_dir()
    return launch.losses(run.stdout)


@pytest.fixture(scope="module")
def two_ranks_crashed(tmp_path_factory):
    root = tmp_path_factory.mktemp("local2")
    _killed_after_local_save(root, nproc=2, jump=1)
    return root


def _copy(source: Path, tmp_path: Path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(source, root)
    return root


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _shard(root: Path, holder: int, owner: int) -> Path:
    return root / "local" / str(holder) / f"iter_0000006_{owner}_local.pt"


def _resume(root: Path) -> str:
    result = launch.run(_args(root, 9, 2, 1))
    assert result.returncode == 0, result.stdout[-3000:]
    assert sorted(launch.losses(result.stdout))[-1] == 9
    return result.stdout


@pytest.mark.compat
def test_bad_copies_are_set_aside_and_each_rank_uses_a_verified_one(two_ranks_crashed, tmp_path):
    root = _copy(two_ranks_crashed, tmp_path)
    _flip(_shard(root, holder=1, owner=1))  # rank 1's own shard: its replica on rank 0 must serve
    _truncate(_shard(root, holder=1, owner=0))  # a replica: rank 0's own copy is used
    # A crashed save's leftover must not block the next save of that iteration (it does in NVRx).
    (root / "local" / "0" / "iter_0000009_0_local.dirty.pt").write_bytes(b"torn")
    # A file named almost like a shard is not ours: passed over, never read, never removed.
    odd = root / "local" / "0" / "iter_0000006_x_local.pt"
    odd.write_bytes(b"not a shard")
    out = _resume(root)
    assert odd.read_bytes() == b"not a shard"
    assert "rank 1's copy of rank 1's shard rejected (fails its owner's checksum" in out
    assert "rank 1's copy of rank 0's shard rejected (" in out
    assert "shards fetched from replicas: rank 1 from rank 0" in out
    assert "[resil] load: accepted local iteration 6" in out
    assert sorted(p.name for p in (root / "local" / "1" / "quarantined").glob("*.pt")) == \
        ["iter_0000006_0_local.pt", "iter_0000006_1_local.pt"]
    assert "successfully saved local checkpoint from iteration       9" in out
    for rank in range(2):  # one iteration kept, own shard and the peer's copy
        names = sorted(p.name for p in (root / "local" / str(rank)).glob("iter_*_local.pt") if p != odd)
        assert names == sorted(f"iter_0000009_{owner}_local.pt" for owner in (0, 1))


@pytest.mark.compat
def test_no_verified_copy_anywhere_moves_every_rank_to_the_persistent_checkpoint(two_ranks_crashed, tmp_path):
    """Both copies of both shards are bad, four different ways: a flipped byte, a truncation, an
    unparsable manifest and a manifest for another iteration."""
    root = _copy(two_ranks_crashed, tmp_path)
    _flip(_shard(root, holder=1, owner=1))
    _truncate(_shard(root, holder=0, owner=1))
    Path(str(_shard(root, holder=0, owner=0)) + ".manifest.json").write_text("{not json")
    wrong = Path(str(_shard(root, holder=1, owner=0)) + ".manifest.json")
    wrong.write_text(json.dumps({**json.loads(wrong.read_text()), "iteration": 3}))
    which = launch.ckpt_tool("which", root / "save", "--non-persistent-local-ckpt-dir", root / "local")
    assert "would reject local iteration 6" in which.stdout, which.stdout + which.stderr
    assert "rank 0's shard has no verified copy" in which.stdout
    assert "would load persistent iteration 5" in which.stdout and which.returncode == 0
    out = _resume(root)
    assert "[resil] load: rejected local iteration 6" in out
    assert "rank 0: no verified copy of its shard (own copy: manifest unparsable" in out
    assert "manifest is for rank 0 iteration 3" in out
    assert "rank 1's copy of rank 1's shard rejected (fails its owner's checksum" in out
    assert "rank 0's copy of rank 1's shard rejected (" in out
    assert "[resil] load: accepted persistent iteration 5" in out
    # Every rank set the whole iteration aside: it is never tried again.
    for holder in (0, 1):
        kept = root / "local" / str(holder) / "quarantined"
        assert sorted(p.name for p in kept.glob("iter_0000006_*_local.pt")) == \
            ["iter_0000006_0_local.pt", "iter_0000006_1_local.pt"], holder


def test_a_shard_whose_extra_state_carries_a_pickle_moves_every_rank_to_the_persistent_checkpoint(
        two_ranks_crashed, tmp_path):
    """Rank 0's own shard rewritten with a pickle in a layer's `_extra_state` and a manifest to match
    (an attacker controls both): it passes the checksum and the weights-only load, and Transformer
    Engine would run it in set_extra_state. The local iteration is rejected naming the item, nothing
    runs, and the resume continues from the persistent checkpoint."""
    import pickle

    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from megatron_resil.checkpointing.local_tier import write_copy
    from megatron_resil.checkpointing.sealed_shard import SealedShard
    from tests.test_safe_load import _Planted
    root = _copy(two_ranks_crashed, tmp_path)
    marker = tmp_path / "code_ran"
    path = _shard(root, holder=0, owner=0)
    state = torch.load(path, weights_only=False)  # the test's own, trusted copy
    crafted = next(item for item in nested_values(state.sharded_state_dict) if "_extra_state" in item.key)
    crafted.data = torch.frombuffer(bytearray(pickle.dumps(_Planted(marker))), dtype=torch.uint8)
    shard = SealedShard.seal(state, iteration=6, owner=0)
    manifest = json.loads(Path(str(path) + ".manifest.json").read_text())
    write_copy(path, path.with_suffix(".dirty.pt"), {**manifest, **shard.meta}, shard.payload)
    out = _resume(root)
    rejected = [line for line in out.splitlines() if "[resil] load: rejected local iteration 6" in line]
    assert len(rejected) == 1 and crafted.key in rejected[0] and "system" in rejected[0], out[-3000:]
    assert "[resil] load: accepted persistent iteration 5" in out
    assert not marker.exists()

