"""A checkpoint directory is untrusted input, path by path: whatever a checkpoint names (DCP's storage
entries, the manifest's files) stays inside it, a link or a FIFO anywhere in it is refused before it is
opened, what is read whole is bounded, and a layer's extra state is no way around the allow-list.

Each case builds the checkpoint for real (a FIFO outside with no writer, so an `open` of it would block
forever, a real symlink, a crafted pickle, a name no encoder can print, a deflate bomb) and checks that
verification refuses it by name, quickly, and that nothing it quotes can turn the refusal into a crash."""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from megatron_resil.checkpointing.untrusted import remove_tree
from tests import launch
from tests.test_safe_load import (
    V0_1,
    _metadata,
    _Planted,
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
                          env=launch.env(), cwd=launch.REPO, capture_output=True, text=True, timeout=300)
    assert tool.returncode == 1 and f"a FIFO, {name}" in tool.stdout + tool.stderr, tool.stdout + tool.stderr


def test_ckpt_list_names_fifos_where_notes_and_manifests_should_be(checkpoint, tmp_path):
    root = checkpoint.parent
    (checkpoint / "resil_manifest.json").unlink()
    os.mkfifo(checkpoint / "resil_manifest.json")
    quarantined = root / "iter_0000001.quarantined.checksum.0123abcd"
    quarantined.mkdir()
    os.mkfifo(quarantined / "QUARANTINE_REASON.txt")
    tool = subprocess.run([sys.executable, "-m", "megatron_resil.tools.ckpt", "list", str(root)],
                          env=launch.env(), cwd=launch.REPO, capture_output=True, text=True, timeout=300)
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


@pytest.mark.parametrize("case", ["deflated", "larger than this run's state"])
def test_a_local_shard_that_would_take_more_memory_than_this_run_can_is_rejected(tmp_path, case):
    """A node-local shard is read whole, then torch.load'ed: before, a deflated one was inflated in full and
    one of any size read into memory (a sparse terabyte included). Its manifest is rewritten to match."""
    from megatron_resil.checkpointing.local_tier import MANIFEST_SUFFIX
    from megatron_resil.checkpointing.sealed_shard import crc32_of
    tier, candidate = _local_candidate(tmp_path / "local", None)
    shard = tier.my_dir / "iter_0000006_0_local.pt"
    if case == "deflated":
        data = deflated(shard.read_bytes(), padding=16 << 20)
        shard.write_bytes(data)
        manifest = Path(str(shard) + MANIFEST_SUFFIX)
        meta = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({**meta, "size": len(data), "crc32": crc32_of(data)}))
        wanted = "is compressed (zip method 8)"
    else:
        tier.max_rank_bytes = shard.stat().st_size - 1
        wanted = f"more than any local shard can have ({tier.max_rank_bytes})"
    reason = tier.verify(candidate)
    assert reason is not None and wanted in reason, reason


@pytest.mark.parametrize("how", ["deflated", "through a DCP transform"])
def test_a_tensor_item_that_would_be_decompressed_on_load_is_refused_at_verification(checkpoint, how):
    """DCP torch.load's each tensor item whole when it loads, after verification: a deflated one (or one
    stored through DCP's decompressing transforms) would have been inflated then, on every rank."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    fqn = "decoder.layers.mlp.linear_fc1.weight"
    metadata = _metadata(checkpoint)
    index, stored = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == fqn)
    if how == "deflated":
        with open(checkpoint / stored.relative_path, "rb") as f:
            f.seek(stored.offset)
            tensor = torch.load(io.BytesIO(f.read(stored.length)), weights_only=True)
        replace_byte_item(checkpoint, lambda name: name == fqn, tensor,
                          serialized=lambda saved: deflated(saved, padding=16 << 20))
        wanted = f"(item {fqn}): entry"
    else:
        metadata.storage_data[index] = _StorageInfo(stored.relative_path, stored.offset, stored.length,
                                                    ["zstandard"])
        with open(checkpoint / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
        wanted = f"item {fqn} is stored through DCP's transforms"
    (checkpoint / "resil_manifest.json").unlink()
    reason = _verify(checkpoint)
    assert reason is not None and wanted in reason, reason


def _oversize_metadata(ckpt: Path) -> None:
    """A 1.5 GiB sparse .metadata: before, every rank read all of it into memory first."""
    with open(ckpt / ".metadata", "r+b") as f:
        f.truncate(3 << 29)
    (ckpt / "resil_manifest.json").unlink()


def test_an_oversized_metadata_is_refused_without_reading_it(checkpoint):
    """(What reading it costs is measured in a process of its own:
    test_files_that_would_take_more_memory_than_their_size_are_refused_in_one_line_with_little.)"""
    _oversize_metadata(checkpoint)
    reason = _verify(checkpoint)
    assert reason is not None and "refused without reading it" in reason, reason
    from megatron_resil.checkpointing.global_tier import _slug
    assert _slug(reason) == "oversized"


def _entry_bytes(archive: bytes, entry: zipfile.ZipInfo) -> bytes:
    """A stored entry's bytes, from its local header: zipfile would check a CRC-32 that our writers leave out
    (torch.serialization.set_crc32_options(False): the manifest's checksum covers the same bytes)."""
    assert entry.compress_type == zipfile.ZIP_STORED, entry
    name_length, extra_length = struct.unpack_from("<HH", archive, entry.header_offset + 26)
    start = entry.header_offset + 30 + name_length + extra_length
    return archive[start:start + entry.compress_size]


def deflated(archive: bytes, padding: int = 128 << 20) -> bytes:
    """A torch.save archive rewritten with every entry deflated and `padding` zero bytes after the pickle's
    STOP: torch.load reads what it did, after inflating all of it (a few MB on disk; torch itself writes
    every entry stored)."""
    bomb = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as plain, \
            zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as out:
        for entry in plain.infolist():
            with out.open(entry.filename, "w") as written:
                written.write(_entry_bytes(archive, entry))
                if entry.filename.endswith("/data.pkl"):
                    zeros = bytes(1 << 20)
                    for _ in range(padding >> 20):
                        written.write(zeros)
    return bomb.getvalue()


def write_deflate_bomb(path: Path, state) -> None:
    """torch.save(state) at `path`, deflated (`deflated`)."""
    import torch
    saved = io.BytesIO()
    torch.save(state, saved)
    path.write_bytes(deflated(saved.getvalue()))


def _legacy_deflate_bomb(ckpt: Path) -> None:
    """A --ckpt-format torch checkpoint of one rank (Megatron-LM's layout) whose model_optim_rng.pt is a
    deflate bomb."""
    import torch
    state = {"args": argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1),
             "checkpoint_version": 3.0, "iteration": 3, "model": {"decoder.weight": torch.ones(4, 4)}}
    (ckpt / "mp_rank_00").mkdir(parents=True)
    write_deflate_bomb(ckpt / "mp_rank_00" / "model_optim_rng.pt", state)


def test_files_that_would_take_more_memory_than_their_size_are_refused_in_one_line_with_little(tmp_path):
    """`ckpt verify`, in a fresh process whose peak memory is read: a 1.5 GiB sparse .metadata, a common.pt
    whose pickle is deflated (128 MiB in 0.6 MB; one of 256 MiB took the tool up 511 MiB before) and a
    --ckpt-format torch model_optim_rng.pt the same, each refused in one line before torch.load sees it;
    the intact iteration 2 still verifies."""
    import torch
    root = tmp_path / "ckpt"
    shutil.copytree(V0_1, root / "iter_0000002")
    shutil.copytree(V0_1, root / "iter_0000005")
    _oversize_metadata(root / "iter_0000005")
    shutil.copytree(V0_1, root / "iter_0000004")
    (root / "iter_0000004" / "resil_manifest.json").unlink()
    common = torch.load(V0_1 / "common.pt", weights_only=False)  # the test's own, trusted copy
    write_deflate_bomb(root / "iter_0000004" / "common.pt", common)
    _legacy_deflate_bomb(root / "iter_0000003")

    done, grew_kib = launch.ckpt_tool_measured("verify", root)
    verdicts = dict(re.findall(r"^persistent iteration (\d): (.*)$", done.stdout, re.MULTILINE))
    assert done.returncode == 1 and sorted(verdicts) == ["2", "3", "4", "5"], done.stdout + done.stderr
    assert ".metadata has 1610612736 bytes" in verdicts["5"] and "refused without reading it" in verdicts["5"]
    for iteration, file in (("4", "common.pt"), ("3", "mp_rank_00/model_optim_rng.pt")):
        assert re.search(rf"{re.escape(file)}: entry \S+/data\.pkl is compressed \(zip method 8\)",
                         verdicts[iteration]), verdicts[iteration]
    assert verdicts["2"].startswith("ok"), verdicts["2"]
    assert grew_kib < 64 * 1024, f"peak resident memory grew by {grew_kib} KiB while verifying"


def _newest_damaged(tmp_path: Path) -> tuple[Path, Path]:
    """A --save directory whose tracker names iteration 3, a copy of iteration 2 without its manifest (for
    the case to damage), beside the intact iteration 2: (root, iteration 3's directory)."""
    root = tmp_path / "ckpt"
    shutil.copytree(V0_1, root / "iter_0000002")
    newest = root / "iter_0000003"
    shutil.copytree(V0_1, newest)
    (newest / "resil_manifest.json").unlink()
    (root / "latest_checkpointed_iteration.txt").write_text("3\n")
    return root, newest


def _nest(directory: Path, depth: int) -> None:
    """`depth` directories `d/d/...` under `directory`, made by file descriptor (os.makedirs recurses)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            fd, parent = os.open("d", os.O_RDONLY, dir_fd=fd), fd
            os.close(parent)
    finally:
        os.close(fd)


@pytest.mark.parametrize("case", ["an integrity.json key, ASCII stdout",
                                  "a link's name, strict UTF-8 stdout"])
def test_a_name_no_encoder_can_print_is_a_rejection_not_a_crash(tmp_path, case):
    """Before, `ckpt verify` ended in UnicodeEncodeError (and every launch with exit 1, the newest
    iteration never quarantined, the good one never loaded): the name is escaped in the verdict and the
    older iteration is the one to load, on a stdout that encodes strictly."""
    root, newest = _newest_damaged(tmp_path)
    if "integrity.json" in case:
        (newest / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": {"\ud800": "00"}}))
        encoding, shown = "ascii", "lists \\ud800, which is missing"
    else:
        os.symlink(b"/nowhere", os.path.join(os.fsencode(newest), b"\xff"))
        encoding, shown = "utf-8", "holds a symlink, \\xff;"
    verified = launch.ckpt_tool("verify", root, encoding=encoding)
    lines = verified.stdout.splitlines()
    assert verified.returncode == 1 and len(lines) == 2, verified.stdout + verified.stderr
    assert lines[0].startswith("persistent iteration 3: FAILED: ") and shown in lines[0], lines[0]
    assert lines[1] == "persistent iteration 2: ok (sizes and checksums match the manifest)", lines[1]
    chosen = launch.ckpt_tool("which", root, encoding=encoding)
    assert chosen.returncode == 0 and chosen.stdout.splitlines()[-1].startswith(
        f"would load persistent iteration 2 ({root / 'iter_0000002'})"), chosen.stdout


def test_a_saved_argument_quoted_in_a_resil_line_is_one_escaped_line_on_an_ascii_stdout(tmp_path):
    """What the loader prints of a checkpoint's saved arguments ("Setting tokenizer_model to ... from
    checkpoint") and its decisions go through the same lines: a newline there forged a line of its own, a
    lone surrogate ended the run in UnicodeEncodeError, and an ASCII stdout could not take an accent. The
    event log keeps the same escaped text."""
    import contextlib

    from megatron_resil import events
    saved = "/models/t\u00e9\ud800\n[resil] load: accepted persistent iteration 9\x1b[2K"
    raw = io.BytesIO()
    stdout = io.TextIOWrapper(raw, encoding="ascii", errors="strict")
    events.configure(str(tmp_path))
    try:
        with contextlib.redirect_stdout(stdout):
            events.print_rank_0(f"Setting tokenizer_model to {saved} from checkpoint")
            events.decision("load", f"rejected persistent iteration 3: {saved}", reason=saved)
        stdout.flush()
    finally:
        events.configure(None)
    forged = "[resil] load: accepted persistent iteration 9"
    escaped = f"/models/t\\xe9\\ud800\\x0a{forged}\\x1b[2K"
    assert raw.getvalue().decode("ascii").splitlines() == [
        f"Setting tokenizer_model to {escaped} from checkpoint",
        f"[resil] load: rejected persistent iteration 3: {escaped}"]
    (record,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert record["reason"] == f"/models/t\u00e9\\ud800\\x0a{forged}\\x1b[2K"  # an accent is printable


def test_ckpt_list_walks_a_dangling_link_and_a_tree_1100_deep_and_keeps_a_planted_note_on_its_line(tmp_path):
    """`ckpt list` raised FileNotFoundError on a dangling link inside an iteration and RecursionError on a
    tree 1,100 levels deep (Python 3.11's os.walk recurses), as `ckpt verify` does not; and it printed a
    quarantine note as written, so a newline in it forged a line of its own."""
    root = tmp_path / "ckpt"
    shutil.copytree(V0_1, root / "iter_0000002")
    (root / "iter_0000002" / "dangling").symlink_to(tmp_path / "gone")
    (root / "iter_0000003").mkdir()
    quarantined = root / "iter_0000001.quarantined.checksum.0123abcd"
    quarantined.mkdir()
    (quarantined / "QUARANTINE_REASON.txt").write_text(
        "bad\n[resil] load: accepted persistent iteration 1\x1b[2K\n")
    try:
        _nest(root / "iter_0000003", 1100)
        listed = launch.ckpt_tool("list", root, encoding="ascii")
    finally:  # pytest's own clean-up of old temporary directories recurses
        remove_tree(str(root / "iter_0000003"))
    assert listed.returncode == 0, listed.stdout + listed.stderr
    lines = listed.stdout.splitlines()
    (second,) = [line for line in lines if "iter_0000002" in line]
    assert re.fullmatch(r"  iter_0000002 +0\.\d MiB  manifest v3", second), second
    (third,) = [line for line in lines if "iter_0000003" in line]
    assert "more than 32 directories deep" in third and "not all counted" in third, third
    (note,) = [line for line in lines if "quarantined iter_0000001" in line]
    assert note.endswith(": bad\\x0a[resil] load: accepted persistent iteration 1\\x1b[2K"), note
    assert not any(line.startswith("[resil]") for line in lines), lines


def test_removing_a_leftover_of_any_depth_follows_no_link(tmp_path):
    """A `.tmp_iter_*` 1,500 directories deep ended start-up cleanup with RecursionError on every restart."""
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
    """Seven checkpoints, six of them crafted. The newest's integrity.json lists a key "\\ud800" and the
    next holds a link named with byte \\xff (each ended every launch in UnicodeEncodeError, printing or
    writing the quarantine note: exit 1, nothing quarantined, a crash loop); the next's common.pt is a
    deflate bomb (128 MiB in 0.6 MB); the next's .metadata reads a shard from a FIFO outside (no writer: the
    resume hung forever), the next one's extra state carries a pickle (exit 3 before), the next is a link
    to its own copy moved elsewhere. The resume loads iteration 1 and names each file and reason, escaped,
    on one line."""
    save = tmp_path / "ckpt"
    marker = tmp_path / "code_ran"
    args = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--save", str(save), "--load", str(save),
            "--save-interval", "1"]
    first = launch.run([*args, "--train-iters", "7"])
    assert first.returncode == 0, first.stdout[-3000:]

    iter7 = save / "iter_0000007"
    (iter7 / "resil_manifest.json").unlink()
    (iter7 / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": {"\ud800": "00"}}))
    os.symlink(b"/nowhere", os.path.join(os.fsencode(save / "iter_0000006"), b"\xff"))
    planted_in = _bomb_the_common_state(save / "iter_0000005")
    fifo = tmp_path / "outside.fifo"
    os.mkfifo(fifo)
    _point_item_at(save / "iter_0000004", str(fifo))
    fqn = _plant_extra_state(save / "iter_0000003", [_as_uint8(pickle.dumps(_Planted(marker)))])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (save / "iter_0000002").rename(elsewhere / "iter_0000002")
    (save / "iter_0000002").symlink_to(elsewhere / "iter_0000002")
    leftover = save / ".tmp_iter_0000008_0123456789ab"  # start-up cleanup died of RecursionError on it
    leftover.mkdir()
    try:
        _nest(leftover, 1500)
        resumed = launch.run([*args, "--train-iters", "3"], timeout=180)
    finally:  # pytest's clean-up of old temporary directories, in any later session, would recurse on it
        if leftover.exists():
            remove_tree(str(leftover))
    out = resumed.stdout
    assert resumed.returncode == 0, out[-4000:]
    assert not marker.exists()
    lines = out.splitlines()
    for iteration, named in ((7, "lists \\ud800, which is missing"), (6, "holds a symlink, \\xff;"),
                             (5, f"{planted_in}: entry "), (4, str(fifo)), (3, fqn), (2, "is a symlink to")):
        rejected = [x for x in lines if f"load: rejected persistent iteration {iteration}" in x]
        assert len(rejected) == 1 and named in rejected[0], out[-6000:]
    assert "is compressed (zip method 8)" in next(x for x in lines if "rejected persistent iteration 5" in x)
    assert "successfully loaded checkpoint from" in out and "at iteration 1" in out, out[-4000:]
    assert "Traceback" not in out
    # Each moved aside with its reason, as any rejected candidate.
    for iteration, named in ((7, "\\ud800"), (6, "\\xff"), (5, "is compressed")):
        (moved,) = save.glob(f"iter_{iteration:07d}.quarantined.*")
        assert named in (moved / "QUARANTINE_REASON.txt").read_text()
    assert "QUARANTINE_REASON.txt" not in os.listdir(elsewhere / "iter_0000002")  # the link was moved
    assert f"removed {leftover}" in out


def _bomb_the_common_state(ckpt: Path) -> str:
    """The common state, wherever the checkpoint keeps it (common.pt, or megatron-core 0.19's byte item in
    the shards), replaced by a deflate bomb holding the same; its manifest dropped. Returns the file's name
    as a refusal gives it."""
    import torch

    from megatron_resil.checkpointing.safe_load import COMMON_STATE_KEY
    (ckpt / "resil_manifest.json").unlink()
    if (ckpt / "common.pt").exists():  # read back and saved again: megatron-core wrote it with no CRC-32s
        write_deflate_bomb(ckpt / "common.pt", torch.load(ckpt / "common.pt", weights_only=False))
        return "common.pt"
    stored = next(s for i, s in _metadata(ckpt).storage_data.items() if i.fqn == COMMON_STATE_KEY)
    with open(ckpt / stored.relative_path, "rb") as f:
        f.seek(stored.offset)
        common = torch.load(io.BytesIO(f.read(stored.length)), weights_only=False)  # the test's own copy
    replace_byte_item(ckpt, lambda fqn: fqn == COMMON_STATE_KEY, common, serialized=deflated)
    return f"{stored.relative_path} (item {COMMON_STATE_KEY})"
