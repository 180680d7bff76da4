"""A checkpoint directory is untrusted input, path by path: whatever a checkpoint names (DCP's storage
entries, the manifest's files) stays inside it, a link or a FIFO anywhere in it is refused before it is
opened, what is read whole is bounded, and a layer's extra state is no way around the allow-list.

Each case builds the checkpoint for real (a FIFO outside with no writer, so an `open` of it would block
forever, a real symlink, a crafted pickle) and checks that verification refuses it by name, quickly."""

from __future__ import annotations

import io
import os
import pickle
import resource
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests import launch
from tests.test_safe_load import (
    V0_1,
    _metadata,
    _Planted,
    checkpoints_of_iterations_1_to_4,
    replace_byte_item,
)

ITERATION = 2


def _verify(ckpt: Path, timeout: float = 20.0) -> str | None:
    """GlobalTier.verify of `ckpt` (rank 0 of 1), in a thread, so a read that blocks fails the test
    instead of hanging it."""
    from megatron_resil.checkpointing.global_tier import GlobalTier
    from megatron_resil.checkpointing.tier import TierCandidate
    found: dict = {}

    def run():
        found["reason"] = GlobalTier(str(ckpt.parent)).verify(
            TierCandidate("persistent", ITERATION, str(ckpt)))
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), f"verifying {ckpt} blocked"
    return found["reason"]


@pytest.fixture
def checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt" / f"iter_{ITERATION:07d}"
    shutil.copytree(V0_1, ckpt)
    return ckpt


def _point_item_at(ckpt: Path, relative_path: str, tensors: bool = True) -> str:
    """Rewrites .metadata so every item of one .distcp file (the last by name holding tensor items, or
    byte items) is read from `relative_path`, and drops the manifest: a checkpoint "written by
    Megatron-LM". Returns the file's name: how many files a rank writes differs (two each with
    megatron-core 0.16, one with 0.19)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    metadata = _metadata(ckpt)
    chosen = [(index, info) for index, info in metadata.storage_data.items()
              if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata) != tensors]
    file = max(info.relative_path for _, info in chosen)
    for index, info in chosen:
        if info.relative_path == file:
            metadata.storage_data[index] = _StorageInfo(relative_path, info.offset, info.length,
                                                        info.transform_descriptors)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    (ckpt / "resil_manifest.json").unlink()
    return file


def test_an_untouched_checkpoint_verifies(checkpoint):
    assert _verify(checkpoint) is None


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_a_storage_entry_pointing_at_a_fifo_outside_is_refused_without_opening_it(checkpoint, tmp_path, how):
    fifo = tmp_path / "outside.fifo"
    os.mkfifo(fifo)  # no writer: opening it for reading would block forever
    named = str(fifo) if how == "absolute" else "../../outside.fifo"
    _point_item_at(checkpoint, named)
    reason = _verify(checkpoint)
    assert reason is not None and named in reason and "not a path inside it" in reason, reason


def test_outside_bytes_do_not_pass_even_with_a_manifest_regenerated_over_them(checkpoint, tmp_path):
    """An attacker who can write the checkpoint can write its manifest too."""
    from megatron_resil.checkpointing.manifest import write_manifest
    other = tmp_path / "other"
    shutil.copytree(V0_1, other)
    _point_item_at(checkpoint, "../../other/__1_1.distcp")
    write_manifest(str(checkpoint), ITERATION, "torch_dist")
    reason = _verify(checkpoint)
    assert reason is not None and "../../other/__1_1.distcp" in reason, reason


def test_a_manifest_naming_a_file_outside_is_refused(checkpoint, tmp_path):
    import json
    (tmp_path / "secret").write_text("another team's shard")
    manifest = json.loads((checkpoint / "resil_manifest.json").read_text())
    manifest["files"]["../../secret"] = {"size": 20, "crc32": 0}
    (checkpoint / "resil_manifest.json").write_text(json.dumps(manifest))
    reason = _verify(checkpoint)
    assert reason is not None and "../../secret" in reason and "not a path inside it" in reason, reason


@pytest.mark.parametrize("name", ["common.pt", "__0_0.distcp"])
def test_a_fifo_inside_is_refused_by_verify_and_by_ckpt_verify(checkpoint, name):
    (checkpoint / name).unlink()
    os.mkfifo(checkpoint / name)
    reason = _verify(checkpoint)
    assert reason is not None and f"a FIFO, {name}" in reason, reason
    tool = subprocess.run([sys.executable, "-m", "megatron_resil.tools.ckpt", "verify",
                           str(checkpoint.parent)],
                          env=launch.env(), cwd=launch.REPO, capture_output=True, text=True, timeout=60)
    assert tool.returncode == 1 and f"a FIFO, {name}" in tool.stdout + tool.stderr, tool.stdout + tool.stderr


def test_ckpt_list_names_fifos_where_notes_and_manifests_should_be(checkpoint, tmp_path):
    root = checkpoint.parent
    (checkpoint / "resil_manifest.json").unlink()
    os.mkfifo(checkpoint / "resil_manifest.json")
    quarantined = root / "iter_0000001.quarantined.checksum.0123abcd"
    quarantined.mkdir()
    os.mkfifo(quarantined / "QUARANTINE_REASON.txt")
    tool = subprocess.run([sys.executable, "-m", "megatron_resil.tools.ckpt", "list", str(root)],
                          env=launch.env(), cwd=launch.REPO, capture_output=True, text=True, timeout=60)
    assert tool.returncode == 0, tool.stdout + tool.stderr
    assert "QUARANTINE_REASON.txt is a FIFO" in tool.stdout, tool.stdout


def test_an_iteration_directory_that_is_a_link_is_refused_and_quarantine_renames_only_the_link(tmp_path):
    from megatron_resil.checkpointing import layout
    from megatron_resil.checkpointing.global_tier import GlobalTier
    from megatron_resil.checkpointing.tier import TierCandidate
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(V0_1, elsewhere)
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / f"iter_{ITERATION:07d}").symlink_to(elsewhere)
    assert _verify(root / f"iter_{ITERATION:07d}") is not None
    tier = GlobalTier(str(root))
    candidate = TierCandidate("persistent", ITERATION, str(root / f"iter_{ITERATION:07d}"))
    reason = tier.verify(candidate)
    assert "is a symlink to" in reason, reason
    tier.quarantine(candidate, reason)
    (moved,) = layout.quarantined(str(root))
    assert os.path.islink(moved) and ".quarantined.link." in moved
    assert sorted(os.listdir(elsewhere)) == sorted(os.listdir(V0_1))  # nothing written into the target


def test_a_link_deep_inside_is_refused(checkpoint, tmp_path):
    (checkpoint / "a" / "b").mkdir(parents=True)
    (checkpoint / "a" / "b" / "c").symlink_to(tmp_path)
    reason = _verify(checkpoint)
    assert reason is not None and "a symlink, a/b/c" in reason, reason


def test_a_tree_deeper_than_any_checkpoint_is_refused(checkpoint):
    deep = checkpoint
    for _ in range(40):
        deep = deep / "d"
    deep.mkdir(parents=True)
    reason = _verify(checkpoint)
    assert reason is not None and "directories deep" in reason, reason


def _plant_common(ckpt: Path, value) -> None:
    import torch
    common = torch.load(ckpt / "common.pt", weights_only=False)  # the test's own, trusted copy
    common["planted"] = value
    torch.save(common, ckpt / "common.pt")
    (ckpt / "resil_manifest.json").unlink()


class _ActsOnBuild:
    """Unpickles as a call of `target(*args)`: a registered class whose constructor acts."""

    def __init__(self, target, args) -> None:
        self.target, self.args = target, args

    def __reduce__(self):
        return self.target, self.args


def test_registered_classes_whose_construction_acts_are_not_admitted(checkpoint):
    from torch.distributed.device_mesh import DeviceMesh
    _plant_common(checkpoint, _ActsOnBuild(DeviceMesh, ("cpu", [0])))
    reason = _verify(checkpoint)  # before, the constructor ran: it tried to start a process group
    assert reason is not None and "common.pt" in reason and "refused without running it" in reason, reason


def test_bytesio_is_not_admitted_in_common_pt(checkpoint):
    _plant_common(checkpoint, io.BytesIO(b"bytes for someone's torch.load"))
    reason = _verify(checkpoint)
    assert reason is not None and "BytesIO" in reason, reason


def _plant_extra_state(ckpt: Path, value) -> str:
    """Replaces a layer's `_extra_state` byte item with torch.save(value), keeping .metadata in step."""
    index, _ = replace_byte_item(ckpt, lambda fqn: "._extra_state" in fqn, value)
    (ckpt / "resil_manifest.json").unlink(missing_ok=True)
    return index.fqn


def _as_uint8(data: bytes):
    import torch
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@pytest.mark.parametrize("form", ["pickle-in-tensor", "torch-save-in-bytesio"])
def test_extra_state_carrying_a_pickle_is_refused_and_never_runs(checkpoint, tmp_path, form):
    """Transformer Engine unpickles these bytes with plain pickle.loads (or torch.load of a BytesIO)."""
    import torch
    marker = tmp_path / "code_ran"
    if form == "pickle-in-tensor":
        value = [_as_uint8(pickle.dumps(_Planted(marker)))]
    else:
        inner = io.BytesIO()
        torch.save(_Planted(marker), inner)
        value = [io.BytesIO(inner.getvalue())]
    fqn = _plant_extra_state(checkpoint, value)
    reason = _verify(checkpoint)
    assert reason is not None and fqn in reason and "system" in reason, reason
    assert not marker.exists()


def test_a_genuine_transformer_engine_extra_state_still_verifies(checkpoint):
    """What TE 2.x writes: pickle.dumps of a dict of fp8 scaling tensors and numbers, as a uint8 tensor."""
    import torch
    state = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(16, 3), "scale_bwd": torch.ones(2),
             "amax_history_bwd": torch.zeros(16, 2), "global_fp8_buffer_pos_fwd": 0, "extra_fp8_variables":
             {"num_gemms": 1, "first_module": True}}
    _plant_extra_state(checkpoint, [_as_uint8(pickle.dumps(state))])
    assert _verify(checkpoint) is None


def _local_candidate(root: Path, extra_state, where: str = "sharded"):
    """A local tier (rank 0 of 1) holding one sealed shard of iteration 6 with a consistent manifest (an
    attacker rewrites both), one layer's `_extra_state` being `extra_state`, as a sharded object (how
    megatron-core saves it) or in the shard's common part under the same key."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from megatron_resil.checkpointing.local_tier import LocalTier, write_copy
    from megatron_resil.checkpointing.sealed_shard import SealedShard
    key = "decoder.layers.mlp.linear_fc1._extra_state"
    model = {"decoder.layers.mlp.linear_fc1.weight": ShardedTensor.from_rank_offsets(
        "decoder.layers.mlp.linear_fc1.weight", torch.ones(4, 2))}
    common = {"iteration": 6}
    if where == "sharded":
        model[key] = ShardedObject(key, extra_state, (1,), (0,))
    else:
        common["model"] = {key: extra_state}
    state = MCoreTensorAwareStateDict(common=common, sharded_state_dict={"model": model})
    shard = SealedShard.seal(state, iteration=6, owner=0)
    shard.meta["layout"] = ""
    tier = LocalTier(str(root))
    tier.my_dir.mkdir(parents=True)
    write_copy(tier.my_dir / "iter_0000006_0_local.pt", tier.my_dir / "iter_0000006_0_local.dirty.pt",
               shard.meta, shard.payload)
    (candidate,) = tier.candidates()
    return tier, candidate


@pytest.mark.parametrize("where", ["sharded", "common"])
def test_a_local_shard_whose_extra_state_carries_a_pickle_is_rejected_and_never_runs(tmp_path, where):
    """The local tier's shards are unpickled weights-only, which admits a uint8 tensor; the pickle inside
    would run when Transformer Engine's set_extra_state reads it, after the candidate was accepted."""
    marker = tmp_path / "code_ran"
    tier, candidate = _local_candidate(tmp_path / "local", _as_uint8(pickle.dumps(_Planted(marker))), where)
    reason = tier.verify(candidate)
    assert reason is not None and "linear_fc1._extra_state" in reason and "system" in reason, reason
    assert not marker.exists()


def test_a_local_shard_with_a_genuine_transformer_engine_extra_state_verifies(tmp_path):
    import torch
    state = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(16, 3),
             "global_fp8_buffer_pos_fwd": 0}
    tier, candidate = _local_candidate(tmp_path / "local", _as_uint8(pickle.dumps(state)))
    assert tier.verify(candidate) is None


def test_an_oversized_metadata_is_refused_without_reading_it(checkpoint):
    """A 1.5 GiB sparse .metadata: before, every rank read all of it into memory first."""
    with open(checkpoint / ".metadata", "r+b") as f:
        f.truncate(3 << 29)
    (checkpoint / "resil_manifest.json").unlink()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reason = _verify(checkpoint)
    grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert reason is not None and "refused without reading it" in reason, reason
    assert grew_kib < 256 * 1024, f"resident memory grew by {grew_kib} KiB"
    from megatron_resil.checkpointing.global_tier import _slug
    assert _slug(reason) == "oversized"


def test_removing_a_leftover_of_any_depth_follows_no_link(tmp_path):
    """A `.tmp_iter_*` 1,500 directories deep ended start-up cleanup with RecursionError on every restart."""
    from megatron_resil.checkpointing.untrusted import remove_tree
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not ours to delete")
    leftover = tmp_path / ".tmp_iter_0000004_0123456789ab"
    leftover.mkdir()
    fd = os.open(leftover, os.O_RDONLY)
    try:
        for _ in range(1500):  # by file descriptor: the full path would pass PATH_MAX
            os.mkdir("d", dir_fd=fd)
            (fd, parent) = (os.open("d", os.O_RDONLY, dir_fd=fd), fd)
            os.close(parent)
        os.symlink(str(outside), "link", dir_fd=fd)
        with open(os.open("file", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as f:
            f.write("x")
    finally:
        os.close(fd)
    remove_tree(str(leftover))
    assert not leftover.exists()
    assert (outside / "keep").read_text() == "not ours to delete"


@pytest.mark.slow
def test_a_resume_falls_back_past_each_crafted_checkpoint_and_says_why(tmp_path):
    """The newest checkpoint's .metadata reads a shard from a FIFO outside (no writer: the resume hung
    forever), the next one's extra state carries a pickle (exit 3 before), the next is a link to its own
    copy moved elsewhere; the resume loads iteration 1 and names each file and reason on one line."""
    save = tmp_path / "ckpt"
    marker = tmp_path / "code_ran"
    args = checkpoints_of_iterations_1_to_4(save)

    fifo = tmp_path / "outside.fifo"
    os.mkfifo(fifo)
    iter4 = save / "iter_0000004"
    _point_item_at(iter4, str(fifo))
    fqn = _plant_extra_state(save / "iter_0000003", [_as_uint8(pickle.dumps(_Planted(marker)))])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (save / "iter_0000002").rename(elsewhere / "iter_0000002")
    (save / "iter_0000002").symlink_to(elsewhere / "iter_0000002")
    leftover = save / ".tmp_iter_0000005_0123456789ab"  # start-up cleanup died of RecursionError on it
    leftover.mkdir()
    fd = os.open(leftover, os.O_RDONLY)
    for _ in range(1500):
        os.mkdir("d", dir_fd=fd)
        fd, parent = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(parent)
    os.close(fd)

    resumed = launch.run([*args, "--train-iters", "5"], timeout=180)
    out = resumed.stdout
    assert resumed.returncode == 0, out[-4000:]
    assert not marker.exists()
    lines = out.splitlines()
    for iteration, named in ((4, str(fifo)), (3, fqn), (2, "is a symlink to")):
        rejected = [x for x in lines if f"load: rejected persistent iteration {iteration}" in x]
        assert len(rejected) == 1 and named in rejected[0], out[-4000:]
    assert "successfully loaded checkpoint from" in out and "at iteration 1" in out, out[-4000:]
    assert "Traceback" not in out
    assert "QUARANTINE_REASON.txt" not in os.listdir(elsewhere / "iter_0000002")  # the link was moved
    assert not leftover.exists() and f"removed {leftover}" in out
