"""The small checkpoint building blocks on real files: tracker, layout names, manifest, retention, atomic
publish and fsync. Single process, no torch.distributed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_resil.checkpointing import atomic, layout, manifest, retention, tracker
from megatron_resil.checkpointing.layout import TRACKER_NAME


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _make_ckpt(root: Path, iteration: int, payload: str = "weights") -> Path:
    d = Path(layout.iteration_dir(str(root), iteration))
    (d / "sub").mkdir(parents=True)
    (d / ".metadata").write_text("meta")
    (d / "__0_0.distcp").write_text(payload)
    (d / "sub" / "common.pt").write_text("common")
    return d


# --- tracker ---------------------------------------------------------------------------------------------

def test_tracker_missing(tmp_path: Path) -> None:
    reading = tracker.read_tracker(str(tmp_path))
    assert reading.iteration is None
    assert "missing" in reading.problem and TRACKER_NAME in reading.problem


@pytest.mark.parametrize("text, words", [
    pytest.param("garbage\n", ("unparsable", "garbage"), id="garbage"),
    pytest.param("", ("unparsable",), id="empty"),
    pytest.param("12.5\n", ("unparsable",), id="float"),
    pytest.param("-5\n", ("negative", "-5"), id="negative"),
])
def test_tracker_bad_content(tmp_path: Path, text: str, words: tuple[str, ...]) -> None:
    (tmp_path / TRACKER_NAME).write_text(text)
    reading = tracker.read_tracker(str(tmp_path))
    assert reading.iteration is None
    for word in words:
        assert word in reading.problem, reading.problem


def _binary(path: Path) -> None:
    path.write_bytes(b"\x89\xff\x00\x12garbage")


def _directory(path: Path) -> None:
    path.mkdir()


def _fifo(path: Path) -> None:
    os.mkfifo(path)  # opening it for reading would block until a writer comes


def _symlink(path: Path) -> None:
    (path.parent / "elsewhere.txt").write_text("10\n")
    path.symlink_to(path.parent / "elsewhere.txt")


def _large(path: Path) -> None:
    path.write_text("1" * 10_000)


@pytest.mark.parametrize("make, words", [
    pytest.param(_binary, ("not text",), id="binary"),
    pytest.param(_directory, ("not a regular file", "directory"), id="directory"),
    pytest.param(_fifo, ("not a regular file", "FIFO"), id="fifo"),
    pytest.param(_symlink, ("not a regular file", "symlink"), id="symlink"),
    pytest.param(_large, ("10000 bytes",), id="large"),
])
def test_tracker_that_is_not_a_small_text_file_is_a_problem_never_a_crash_or_a_hang(
        tmp_path: Path, make, words: tuple[str, ...]) -> None:
    make(tmp_path / TRACKER_NAME)
    reading = tracker.read_tracker(str(tmp_path))
    assert reading.iteration is None
    for word in words:
        assert word in reading.problem, reading.problem


@pytest.mark.parametrize("text, iteration", [
    pytest.param("release\n", -1, id="release"),
    pytest.param("100\n", 100, id="good"),
    pytest.param("  0000042 \n", 42, id="padded"),
    pytest.param("0", 0, id="zero-no-newline"),
])
def test_tracker_good_content(tmp_path: Path, text: str, iteration: int) -> None:
    (tmp_path / TRACKER_NAME).write_text(text)
    assert tracker.read_tracker(str(tmp_path)) == tracker.TrackerReading(iteration, None)


def test_write_tracker_round_trip_leaves_no_temp_files(tmp_path: Path) -> None:
    tracker.write_tracker(str(tmp_path), 10)
    assert tracker.read_tracker(str(tmp_path)).iteration == 10
    tracker.write_tracker(str(tmp_path), 20)  # replaces
    assert tracker.read_tracker(str(tmp_path)).iteration == 20
    assert (tmp_path / TRACKER_NAME).read_text() == "20\n"  # Megatron's format
    assert os.listdir(tmp_path) == [TRACKER_NAME]
    assert layout.leftovers(str(tmp_path))["tracker_tmp"] == []


def test_atomic_write_text_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "note.txt"
    atomic.atomic_write_text(str(target), "one")
    atomic.atomic_write_text(str(target), "two")
    assert target.read_text() == "two"
    assert os.listdir(tmp_path) == ["note.txt"]


# --- layout ---------------------------------------------------------------------------------------------

def test_published_iterations_only_final_directories(tmp_path: Path) -> None:
    root = str(tmp_path)
    for it in (10, 300, 20):
        os.mkdir(layout.iteration_dir(root, it))
    os.mkdir(layout.new_staging_dir(root, 400))
    os.mkdir(layout.new_displaced_dir(root, 500))
    os.mkdir(layout.new_deleting_dir(root, 600))
    (tmp_path / "iter_0000700").write_text("a file, not a checkpoint")
    os.mkdir(tmp_path / "iter_12")  # fewer than 7 digits: not Megatron's name
    os.mkdir(tmp_path / "iter_0000800.bak")
    os.mkdir(tmp_path / "release")
    quarantined = layout.new_quarantine_dir(root, 900, "bad-checksum")  # starts with iter_, still not final
    os.mkdir(quarantined)
    (tmp_path / TRACKER_NAME).write_text("300\n")
    assert layout.published_iterations(root) == [300, 20, 10]  # newest first
    assert layout.quarantined(root) == [quarantined]
    assert quarantined not in sum(layout.leftovers(root).values(), [])  # kept on purpose, not debris


def test_published_iterations_of_missing_root(tmp_path: Path) -> None:
    assert layout.published_iterations(str(tmp_path / "nope")) == []
    assert layout.leftovers(str(tmp_path / "nope")) == {
        "staging": [], "displaced": [], "deleting": [], "tracker_tmp": []}


def test_iteration_dir_is_megatron_name(tmp_path: Path) -> None:
    assert os.path.basename(layout.iteration_dir(str(tmp_path), 100)) == "iter_0000100"
    assert os.path.basename(layout.iteration_dir(str(tmp_path), 12345678)) == "iter_12345678"


def test_leftovers_finds_each_kind(tmp_path: Path) -> None:
    root = str(tmp_path)
    staging = layout.new_staging_dir(root, 40)
    displaced = layout.new_displaced_dir(root, 30)
    deleting = layout.new_deleting_dir(root, 20)
    for d in (staging, displaced, deleting):
        os.mkdir(d)
    tracker_tmp = str(tmp_path / f".{TRACKER_NAME}.tmp.0123abcd")
    Path(tracker_tmp).write_text("4")
    os.mkdir(layout.iteration_dir(root, 10))  # not debris
    (tmp_path / TRACKER_NAME).write_text("10\n")  # not debris
    (tmp_path / ".tmp_iter_12").mkdir()  # not ours: wrong shape
    found = layout.leftovers(root)
    assert found == {"staging": [staging], "displaced": [displaced], "deleting": [deleting],
                     "tracker_tmp": [tracker_tmp]}
    assert layout.displaced_iteration(displaced) == 30
    assert layout.published_iterations(root) == [10]


def test_work_in_progress_names_never_look_final(tmp_path: Path) -> None:
    root = str(tmp_path)
    for make in (layout.new_staging_dir, layout.new_displaced_dir, layout.new_deleting_dir):
        a, b = make(root, 5), make(root, 5)
        assert a != b  # two attempts at the same iteration do not collide
        assert not os.path.basename(a).startswith("iter_")


# --- manifest -------------------------------------------------------------------------------------------

@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = _make_ckpt(tmp_path, 100)
    manifest.write_manifest(str(d), 100, "torch_dist")
    return d


def test_manifest_written_then_verified(ckpt: Path) -> None:
    assert manifest.has_manifest(str(ckpt))
    assert manifest.verify_manifest(str(ckpt), 100) is None
    assert manifest.verify_manifest(str(ckpt), None) is None  # release: no iteration check
    recorded = json.loads((ckpt / manifest.MANIFEST_NAME).read_text())
    assert recorded["iteration"] == 100 and recorded["format"] == "torch_dist"
    assert set(recorded["files"]) == {".metadata", "__0_0.distcp", os.path.join("sub", "common.pt")}
    assert manifest.MANIFEST_NAME not in recorded["files"]


def test_manifest_deleted_file(ckpt: Path) -> None:
    (ckpt / "sub" / "common.pt").unlink()
    reason = manifest.verify_manifest(str(ckpt), 100)
    assert reason is not None and "common.pt" in reason and "missing" in reason


def test_manifest_truncated_file(ckpt: Path) -> None:
    with open(ckpt / "__0_0.distcp", "r+b") as f:
        f.truncate(3)
    reason = manifest.verify_manifest(str(ckpt), 100)
    assert reason is not None and "__0_0.distcp" in reason and "3 bytes" in reason


def test_manifest_flipped_bits_same_size(ckpt: Path) -> None:
    data = bytearray((ckpt / "__0_0.distcp").read_bytes())
    data[0] ^= 0x01
    (ckpt / "__0_0.distcp").write_bytes(bytes(data))
    reason = manifest.verify_manifest(str(ckpt), 100)
    assert reason is not None and "__0_0.distcp" in reason and "checksum" in reason
    assert manifest.verify_manifest(str(ckpt), 100, checksums=False) is None  # sizes still match


def test_manifest_grown_file(ckpt: Path) -> None:
    with open(ckpt / "sub" / "common.pt", "a") as f:
        f.write("more")
    reason = manifest.verify_manifest(str(ckpt), 100)
    assert reason is not None and "common.pt" in reason and "bytes" in reason


def test_manifest_version_1_sizes_only_still_verifies(ckpt: Path) -> None:
    """A manifest from before checksums: {relpath: size}."""
    path = ckpt / manifest.MANIFEST_NAME
    recorded = json.loads(path.read_text())
    recorded["version"] = 1
    recorded["files"] = {rel: os.path.getsize(ckpt / rel) for rel in recorded["files"]}
    path.write_text(json.dumps(recorded))
    assert manifest.verify_manifest(str(ckpt), 100) is None
    (ckpt / ".metadata").write_text("longer metadata")
    reason = manifest.verify_manifest(str(ckpt), 100)
    assert reason is not None and ".metadata" in reason


def test_manifest_of_another_iteration(ckpt: Path) -> None:
    reason = manifest.verify_manifest(str(ckpt), 200)
    assert reason is not None and "100" in reason and "200" in reason


def test_manifest_missing(ckpt: Path) -> None:
    (ckpt / manifest.MANIFEST_NAME).unlink()
    assert not manifest.has_manifest(str(ckpt))
    reason = manifest.verify_manifest(str(ckpt), 100)
    assert reason is not None and "manifest" in reason and "missing" in reason


@pytest.mark.parametrize("content", [
    pytest.param('{"version": 1, "iteration": 1', id="truncated-json"),
    pytest.param("\x00\x00\x00\x00", id="zeros"),
    pytest.param("", id="empty"),
    pytest.param('{"version": 1}', id="missing-keys"),
    pytest.param("[1, 2]", id="a-list"),
    pytest.param('{"files": [], "iteration": 100}', id="files-not-a-mapping"),
])
def test_manifest_unparsable(ckpt: Path, content: str) -> None:
    (ckpt / manifest.MANIFEST_NAME).write_text(content)
    reason = manifest.verify_manifest(str(ckpt), 100)
    assert reason is not None and "manifest" in reason and "unparsable" in reason


# --- retention policy -----------------------------------------------------------------------------------

ITERS = [50, 40, 30, 20, 10]  # newest first


@pytest.mark.parametrize("keep_last, retain_interval, protected, deleted", [
    pytest.param(None, None, set(), [], id="no-policy-keeps-all"),
    pytest.param(2, None, set(), [30, 20, 10], id="keep-last-2"),
    pytest.param(5, None, set(), [], id="keep-last-all"),
    pytest.param(10, None, set(), [], id="keep-last-more-than-exist"),
    pytest.param(None, 20, set(), [30, 10], id="retain-interval-keeps-multiples-and-newest"),
    pytest.param(None, 100, set(), [40, 30, 20, 10], id="retain-interval-no-multiples-keeps-newest"),
    pytest.param(2, 20, set(), [30, 10], id="keep-last-and-retain-interval"),
    pytest.param(1, 30, set(), [40, 20, 10], id="keep-last-1-and-retain-interval"),
    pytest.param(2, None, {10}, [30, 20], id="protected-tracker-iteration"),
    pytest.param(1, None, {99}, [40, 30, 20, 10], id="protected-but-absent"),
    pytest.param(0, None, set(), [40, 30, 20, 10], id="keep-last-0-still-keeps-newest"),
])
def test_to_delete(keep_last, retain_interval, protected, deleted) -> None:
    assert retention.to_delete(list(ITERS), keep_last, retain_interval, protected) == deleted


def test_to_delete_never_the_newest() -> None:
    assert retention.to_delete([55, 40, 20], None, 20, set()) == []
    assert retention.to_delete([55, 40, 20], 1, 20, set()) == []
    assert retention.to_delete([55, 41, 21], 1, 20, set()) == [41, 21]
    assert retention.to_delete([], 1, 20, set()) == []
    assert retention.to_delete([7], 1, 5, set()) == []


def test_apply_retention_on_real_directories(tmp_path: Path, capsys) -> None:
    root = str(tmp_path)
    for it in ITERS:
        _make_ckpt(tmp_path, it)
    tracker.write_tracker(root, 20)  # e.g. the last good one after a fallback: must survive
    deleted = retention.apply_retention(root, keep_last=2, retain_interval=None)
    assert deleted == [30, 10]
    assert layout.published_iterations(root) == [50, 40, 20]
    assert sorted(os.listdir(root)) == ["iter_0000020", "iter_0000040", "iter_0000050", TRACKER_NAME]
    assert not any(layout.leftovers(root).values())
    assert _files(tmp_path / "iter_0000020") == {".metadata", "__0_0.distcp", "sub", "sub/common.pt"}
    out = capsys.readouterr().out
    for it in (30, 10):
        assert f"iter_{it:07d}" in out and "retention" in out


def test_apply_retention_with_retain_interval(tmp_path: Path) -> None:
    root = str(tmp_path)
    for it in ITERS:
        _make_ckpt(tmp_path, it)
    tracker.write_tracker(root, 50)
    assert retention.apply_retention(root, keep_last=1, retain_interval=20) == [30, 10]
    assert layout.published_iterations(root) == [50, 40, 20]
    assert not any(layout.leftovers(root).values())


def test_apply_retention_without_policy_or_tracker(tmp_path: Path) -> None:
    root = str(tmp_path)
    for it in ITERS:
        _make_ckpt(tmp_path, it)
    assert retention.apply_retention(root, None, None) == []
    assert layout.published_iterations(root) == ITERS
    (tmp_path / TRACKER_NAME).write_text("garbage")  # a bad tracker protects nothing, breaks nothing
    assert retention.apply_retention(root, 3, None) == [20, 10]
    assert layout.published_iterations(root) == [50, 40, 30]


# --- atomic publish and fsync ---------------------------------------------------------------------------

def _staging_with(root: Path, iteration: int, payload: str) -> Path:
    staging = Path(layout.new_staging_dir(str(root), iteration))
    (staging / "sub").mkdir(parents=True)
    (staging / "__0_0.distcp").write_text(payload)
    (staging / "sub" / "common.pt").write_text(payload)
    return staging


def test_publish_directory_to_new_name(tmp_path: Path) -> None:
    staging = _staging_with(tmp_path, 10, "new")
    final = layout.iteration_dir(str(tmp_path), 10)
    atomic.publish_directory(str(staging), final, layout.new_displaced_dir(str(tmp_path), 10))
    assert not staging.exists()
    assert (Path(final) / "__0_0.distcp").read_text() == "new"
    assert os.listdir(tmp_path) == ["iter_0000010"]


@pytest.mark.parametrize("can_exchange", [True, False], ids=["renameat2-exchange", "rename-fallback"])
def test_publish_directory_over_existing(tmp_path: Path, monkeypatch, can_exchange: bool) -> None:
    old = _make_ckpt(tmp_path, 10, payload="old")
    (old / "only_in_old").write_text("x")
    if not can_exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    staging = _staging_with(tmp_path, 10, "new")
    displaced = layout.new_displaced_dir(str(tmp_path), 10)
    atomic.publish_directory(str(staging), str(old), displaced)
    assert (old / "__0_0.distcp").read_text() == "new"
    assert (old / "sub" / "common.pt").read_text() == "new"
    assert not (old / "only_in_old").exists()  # replaced as a whole, not merged
    assert not staging.exists() and not os.path.exists(displaced)
    assert os.listdir(tmp_path) == ["iter_0000010"]
    assert not any(layout.leftovers(str(tmp_path)).values())


def test_exchange_swaps_when_supported(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "mark").write_text("a")
    (b / "mark").write_text("b")
    if not atomic._exchange(str(a), str(b)):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available on this kernel/filesystem")
    assert (a / "mark").read_text() == "b" and (b / "mark").read_text() == "a"


def test_fsync_tree_on_nested_tree(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "tree"
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "empty_dir").mkdir()
    for rel in ("top.bin", "a/one.bin", "a/b/two.bin", "a/b/c/three.bin"):
        (root / rel).write_bytes(b"x" * 10)
    atomic.fsync_tree(str(root))  # the real thing runs

    synced_files, synced_dirs = [], []
    monkeypatch.setattr(atomic, "fsync_file", synced_files.append)
    monkeypatch.setattr(atomic, "fsync_dir", synced_dirs.append)
    atomic.fsync_tree(str(root))
    assert {os.path.relpath(p, root) for p in synced_files} == {
        "top.bin", "a/one.bin", "a/b/two.bin", "a/b/c/three.bin"}
    assert {os.path.relpath(p, root) for p in synced_dirs} == {".", "a", "a/b", "a/b/c", "empty_dir"}


def test_fsync_file_and_dir(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    atomic.fsync_file(str(f))
    atomic.fsync_dir(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        atomic.fsync_file(str(tmp_path / "nope"))


def test_async_staging_copies_into_one_shared_arena_reused_from_save_to_save_and_crosses_by_reference():
    """What an async save writes from: each tensor copied once into its slot of one shared-memory arena (by
    a thread beside training; a slot's storage is exactly its slice, so torch.save writes only it),
    unaffected by training's later updates; the same slots at the next save of the same structure,
    re-planned (in the same arena where it fits) when the structure changes; and pickled for the worker as
    references into the arena."""
    import io
    import pickle

    import torch

    from megatron_resil.checkpointing.staging import HostStaging, unpickle

    live = [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.ones(5, dtype=torch.bfloat16)]
    host = HostStaging()
    w, b = host.stage(live)
    host.wait_copied()  # the copies run beside training until then
    arena, arena_id = host.arena, host.arena_id
    assert arena.is_shared() and w.data_ptr() != live[0].data_ptr()
    assert torch.equal(w, live[0]) and torch.equal(b, live[1])
    assert w.untyped_storage().nbytes() == 48 and b.untyped_storage().nbytes() == 10
    assert w.untyped_storage().data_ptr() - arena.data_ptr() == 0
    assert b.untyped_storage().data_ptr() - arena.data_ptr() == 256  # aligned
    written = io.BytesIO()
    torch.save(w, written)
    alone = io.BytesIO()
    torch.save(live[0].clone(), alone)
    assert len(written.getvalue()) == len(alone.getvalue())  # the slot, not the arena
    live[0].mul_(-1)  # training goes on
    assert w[1, 1].item() == 5.0
    again = host.stage(live)
    host.wait_copied()
    assert again[0].data_ptr() == w.data_ptr() and torch.equal(again[0], live[0])  # reused, new values

    payload = host.pickle({"tensors": again, "step": 7})
    assert len(payload) < 1000  # references, not the data
    received = unpickle(payload, {arena_id: arena})
    assert received["step"] == 7 and torch.equal(received["tensors"][0], live[0])
    assert received["tensors"][1].untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    with pytest.raises(pickle.UnpicklingError, match="arena 1, which this worker was not sent"):
        unpickle(payload, {})

    smaller = host.stage([torch.zeros(2, 2), live[1]])  # another structure that fits: same arena
    host.wait_copied()
    assert host.arena_id == arena_id and smaller[0].shape == (2, 2) and torch.equal(smaller[1], live[1])
    bigger = host.stage([torch.zeros(1000)])  # one that does not: a new arena, which the worker must map
    assert host.arena_id == arena_id + 1 and host.arena.nbytes() >= 4000
    assert bigger[0].untyped_storage().data_ptr() == host.arena.data_ptr()
