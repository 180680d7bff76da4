"""Megatron-LM's integrity manifest (`--verify-integrity`, `integrity.json`) both ways.

Its checkpoints: the two in tests/data/megatron_lm_integrity, whose manifests Megatron-LM's own
`save_integrity_manifest` wrote (see the README there), verify here and resume; a flipped weight byte
that nothing else notices is caught by their manifest, the checkpoint quarantined and the older one
loaded; a name in it that leaves the checkpoint is refused before anything is opened; its loader's other
rules (algorithm, missing files, unlisted files) hold here too.

Ours: saved with --verify-integrity, every checkpoint carries the manifest in Megatron-LM's exact bytes.
Megatron-LM's code is not imported here (tests never fetch, and none of it is copied): its
`save_integrity_manifest` wrote the committed manifests, so writing ours for the same files must give the
same bytes; and what its `verify_integrity_manifest` checks (each listed file's SHA-256, lowercase hex) is
checked of our real saves. make.py ran its verify function on our checkpoints too (made_by.json).
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megatron_resil.arguments import parse_args
from megatron_resil.checkpointing import manifest, megatron_integrity
from megatron_resil.checkpointing.global_tier import GlobalTier
from megatron_resil.checkpointing.tier import NotForThisRun, TierCandidate

try:
    from tests import launch
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

CHECKPOINT = Path(__file__).parent / "data" / "megatron_lm_integrity" / "checkpoint"
INTEGRITY = "integrity.json"
# The model make.py trained (1 rank), and the tiny model of the other end-to-end tests for ours.
MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--max-position-embeddings", "8", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32",
         "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data",
         "--log-interval", "1"]


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(CHECKPOINT, root)
    return root


def _iter_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def _verify(root: Path, iteration: int, **tier_options) -> str | None:
    return GlobalTier(str(root), **tier_options).verify(
        TierCandidate("persistent", iteration, str(_iter_dir(root, iteration))))


def _flip_a_weight_byte(iter_dir: Path) -> str:
    """Flip one bit inside the values of a weight (not in any pickle or header), as bit rot would; returns
    the shard's name."""
    metadata = pickle.loads((iter_dir / ".metadata").read_bytes())  # committed test data: trusted
    info = next(info for index, info in metadata.storage_data.items()
                if index.fqn == "decoder.layers.mlp.linear_fc2.weight")
    shard = iter_dir / info.relative_path
    data = bytearray(shard.read_bytes())
    record = bytes(data[info.offset:info.offset + info.length])
    values = torch.load(io.BytesIO(record), weights_only=True).numpy().tobytes()
    data[info.offset + record.index(values) + len(values) // 2] ^= 0x01
    shard.write_bytes(data)
    return info.relative_path


def _megatron_lm_manifest_of(directory: Path) -> str:
    """What megatron-core's save_integrity_manifest writes for the files now in `directory` (its format,
    from its source; test_our_writer_gives_megatron_lms_bytes checks it against its real output)."""
    files = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != INTEGRITY)
    return json.dumps({"algorithm": "sha256",
                       "files": {name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
                                 for name in files}}, indent=2)


def _rewrite_integrity(iter_dir: Path, change) -> None:
    """Replace the manifest with `change(what it holds)`."""
    path = iter_dir / INTEGRITY
    path.write_text(json.dumps(change(json.loads(path.read_text())), indent=2))


def _with_file(name: str, digest):
    return lambda data: {**data, "files": {**data["files"], name: digest}}


# ---- Megatron-LM's checkpoints, here ------------------------------------------------------------------

def test_megatron_lms_manifests_verify_and_only_they_catch_a_flipped_weight_bit(tmp_path):
    root = _copy(tmp_path)
    assert _verify(root, 1) is None
    assert _verify(root, 2) is None

    shard = _flip_a_weight_byte(_iter_dir(root, 2))
    reason = _verify(root, 2)
    assert reason is not None and "integrity.json" in reason and shard in reason and "SHA-256" in reason
    # Without its manifest the same checkpoint passes every other check: the manifest is what caught it.
    (_iter_dir(root, 2) / INTEGRITY).unlink()
    assert _verify(root, 2) is None


def test_our_writer_gives_megatron_lms_bytes_for_the_same_files(tmp_path):
    root = _copy(tmp_path)
    for iteration in (1, 2):
        iter_dir = _iter_dir(root, iteration)
        theirs = (iter_dir / INTEGRITY).read_bytes()
        (iter_dir / INTEGRITY).unlink()
        megatron_integrity.write_integrity_manifest(str(iter_dir))
        assert (iter_dir / INTEGRITY).read_bytes() == theirs
        assert _megatron_lm_manifest_of(iter_dir).encode() == theirs


@pytest.mark.parametrize("name", ["../outside.bin", "{absolute}", "sub/../../outside.bin"])
def test_a_name_in_the_manifest_that_is_not_a_path_inside_the_checkpoint_is_refused(tmp_path, name):
    root = _copy(tmp_path)
    outside = root / "outside.bin"
    outside.write_bytes(b"not part of any checkpoint")
    name = name.format(absolute=outside)
    # The right digest: only the path rule can refuse it.
    digest = hashlib.sha256(outside.read_bytes()).hexdigest()
    _rewrite_integrity(_iter_dir(root, 2), _with_file(name, digest))
    reason = _verify(root, 2)
    assert reason is not None and "integrity.json" in reason and "not a path inside it" in reason, reason
    assert repr(name) in reason


REJECTED = {  # what Megatron-LM's loader stops on, and the words our reason has
    "another algorithm": (lambda data: {**data, "algorithm": "md5"}, "'md5'"),
    "no files": (lambda data: {"algorithm": data["algorithm"]}, '"files"'),
    "not an object": (lambda data: [data], "not a JSON object"),
    "an upper-case digest": (lambda data: _with_file(".metadata", data["files"][".metadata"].upper())(data),
                             ".metadata fails its SHA-256 checksum"),
    "a digest that is no string": (_with_file("common.pt", 7), "not a string"),
    "a digest of other bytes": (_with_file("__0_0.distcp", hashlib.sha256(b"x").hexdigest()),
                                "__0_0.distcp fails its SHA-256 checksum"),
}
ACCEPTED = {  # what its loader lets through: so do we
    "no algorithm (sha256 assumed)": lambda data: {"files": data["files"]},
    "nothing listed": lambda data: {**data, "files": {}},
    "a file it does not list": lambda data: {**data, "files": {k: v for k, v in data["files"].items()
                                                               if k != "common.pt"}},
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_megatron_lms_rules_reject(tmp_path, case):
    change, words = REJECTED[case]
    root = _copy(tmp_path)
    _rewrite_integrity(_iter_dir(root, 2), change)
    reason = _verify(root, 2)
    assert reason is not None and "integrity.json" in reason and words in reason, reason


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_megatron_lms_rules_accept(tmp_path, case):
    root = _copy(tmp_path)
    _rewrite_integrity(_iter_dir(root, 2), ACCEPTED[case])
    assert _verify(root, 2) is None


def test_a_listed_file_that_is_gone_is_rejected(tmp_path):
    root = _copy(tmp_path)
    (_iter_dir(root, 2) / "__0_1.distcp").unlink()
    assert _verify(root, 2) == \
        "Megatron-LM's integrity manifest (integrity.json) lists __0_1.distcp, which is missing"


def test_unparsable_manifest_is_rejected(tmp_path):
    root = _copy(tmp_path)
    (_iter_dir(root, 2) / INTEGRITY).write_text('{"algorithm": "sha256", "files": {')
    reason = _verify(root, 2)
    assert reason is not None and "integrity.json" in reason and "unparsable" in reason


def test_ranks_split_the_hashing_and_each_file_is_read_once_for_both_manifests(tmp_path, monkeypatch):
    root = _copy(tmp_path)
    iter_dir = _iter_dir(root, 2)
    files = json.loads((iter_dir / INTEGRITY).read_text())["files"]
    hashed: list[str] = []
    real_sha256, real_digests = megatron_integrity.sha256_file, manifest.file_digests
    monkeypatch.setattr(megatron_integrity, "sha256_file",
                        lambda path: hashed.append(path) or real_sha256(path))
    monkeypatch.setattr(manifest, "file_digests",
                        lambda path, *a, **k: hashed.append(path) or real_digests(path, *a, **k))

    shares = []
    for rank in (0, 1):
        hashed.clear()
        assert megatron_integrity.verify_integrity_manifest(str(iter_dir), files, share=(rank, 2)) is None
        shares.append({Path(p).name for p in hashed})
    assert shares[0] and shares[1] and not shares[0] & shares[1] and shares[0] | shares[1] == set(files)

    # With our manifest there too (integrity.json among the files it lists), one read per file checks both.
    manifest.write_manifest(str(iter_dir), 2, "torch_dist")
    hashed.clear()
    assert _verify(root, 2) is None
    assert sorted(Path(p).name for p in hashed) == sorted([*files, INTEGRITY])
    # An integrity.json whose digest disagrees with a file our checksums accept: found in that same read.
    _rewrite_integrity(iter_dir, _with_file("common.pt", "0" * 64))
    manifest.write_manifest(str(iter_dir), 2, "torch_dist")
    hashed.clear()
    reason = _verify(root, 2)
    assert reason is not None and "common.pt fails its SHA-256 checksum" in reason
    assert len(hashed) == len(set(hashed))


def test_with_verify_integrity_a_checkpoint_without_the_manifest_is_passed_over_not_quarantined(tmp_path):
    root = _copy(tmp_path)
    (_iter_dir(root, 2) / INTEGRITY).unlink()
    reason = _verify(root, 2, verify_integrity=True)
    assert isinstance(reason, NotForThisRun) and "--verify-integrity" in reason
    assert _verify(root, 1, verify_integrity=True) is None
    # Ours listed it: then it is missing from a checkpoint that had it, and that is a rejection.
    manifest.write_manifest(str(_iter_dir(root, 1)), 1, "torch_dist")
    (_iter_dir(root, 1) / INTEGRITY).unlink()
    reason = _verify(root, 1, verify_integrity=True)
    assert reason == "file integrity.json missing" and not isinstance(reason, NotForThisRun)


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data"]


def test_the_flag_is_megatron_lms():
    assert parse_args(BASE, world_size=1).verify_integrity is False
    assert parse_args([*BASE, "--verify-integrity"], world_size=1).verify_integrity is True


@pytest.mark.parametrize("extra, names", [
    (["--ckpt-format", "zarr"], ("--verify-integrity", "--ckpt-format", "zarr")),
    (["--ckpt-skip-checksums"], ("--verify-integrity", "--ckpt-skip-checksums")),
])
def test_the_flag_with_what_contradicts_it_ends_in_one_line(tmp_path, capsys, extra, names):
    with pytest.raises(SystemExit) as stop:
        parse_args([*BASE, "--save", str(tmp_path / "ckpt"), "--verify-integrity", *extra], world_size=1)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and all(name in lines[0] for name in names), lines


# ---- end to end ---------------------------------------------------------------------------------------

def _run_ok(args: list[str], nproc: int) -> str:
    result = launch.run(args, nproc=nproc, timeout=300)
    assert result.returncode == 0, result.stdout[-5000:]
    return result.stdout


@pytest.mark.slow
def test_megatron_lms_checkpoint_resumes_here_with_its_manifest_verified(tmp_path):
    root = _copy(tmp_path)
    # Megatron-LM saved it with --train-iters 2: as there, a longer run says which schedule wins.
    out = _run_ok([*MODEL, "--train-iters", "3", "--load", str(root), "--save", str(root),
                   "--save-interval", "3", "--verify-integrity", "--use-checkpoint-opt_param-scheduler"],
                  nproc=1)
    assert f"{_iter_dir(root, 2)} has no manifest: saved by Megatron-LM or an older megatron-resil; its " \
           "files are checked against Megatron-LM's integrity manifest (integrity.json) instead" in out
    assert f"successfully loaded checkpoint from {root} [ t 1/1, p 1/1 ] at iteration 2 " in out
    assert sorted(launch.losses(out)) == [3]
    saved = _iter_dir(root, 3)
    assert (saved / INTEGRITY).read_text() == _megatron_lm_manifest_of_save(saved)


@pytest.mark.slow
def test_a_flipped_weight_bit_is_rejected_by_megatron_lms_manifest_quarantined_older_one_loads(tmp_path):
    root = _copy(tmp_path)
    shard = _flip_a_weight_byte(_iter_dir(root, 2))
    out = _run_ok([*MODEL, "--train-iters", "3", "--load", str(root), "--save", str(root),
                   "--save-interval", "3", "--use-checkpoint-opt_param-scheduler"], nproc=1)
    rejected = [line for line in out.splitlines() if "[resil] load: rejected persistent iteration 2" in line]
    assert len(rejected) == 1, out[-3000:]
    assert "integrity.json" in rejected[0] and f"{shard} fails its SHA-256" in rejected[0]
    quarantined = [p for p in root.iterdir() if p.name.startswith("iter_0000002.quarantined.checksum.")]
    assert len(quarantined) == 1
    assert "integrity.json" in (quarantined[0] / "QUARANTINE_REASON.txt").read_text()
    assert f"successfully loaded checkpoint from {root} [ t 1/1, p 1/1 ] at iteration 1 " in out
    assert sorted(launch.losses(out)) == [2, 3]


def _megatron_lm_manifest_of_save(iter_dir: Path) -> str:
    """A checkpoint of ours: Megatron-LM's manifest lists what its save would have left there (everything
    but our manifest, written after it)."""
    scratch = iter_dir.parent / f".{iter_dir.name}.megatron_view"
    shutil.copytree(iter_dir, scratch, ignore=shutil.ignore_patterns(manifest.MANIFEST_NAME))
    try:
        return _megatron_lm_manifest_of(scratch)
    finally:
        shutil.rmtree(scratch)


@pytest.mark.slow
def test_our_checkpoints_saved_with_verify_integrity_carry_megatron_lms_manifest_and_resume(tmp_path):
    """2 ranks, --async-save: both ranks' shards are listed, with the digests Megatron-LM's loader
    recomputes; ours lists integrity.json and carries no SHA-256 of its own."""
    root = tmp_path / "ckpt"
    job = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--lr-decay-iters", "4", "--save", str(root),
           "--save-interval", "1", "--verify-integrity"]
    _run_ok([*job, "--train-iters", "2", "--async-save"], nproc=2)
    for iteration in (1, 2):
        saved = _iter_dir(root, iteration)
        assert (saved / INTEGRITY).read_text() == _megatron_lm_manifest_of_save(saved)
        assert {"__0_0.distcp", "__1_0.distcp"} <= set(json.loads((saved / INTEGRITY).read_text())["files"])
        ours = json.loads((saved / manifest.MANIFEST_NAME).read_text())["files"]
        assert INTEGRITY in ours and not any("sha256" in entry for entry in ours.values())
    out = _run_ok([*job, "--train-iters", "3", "--load", str(root)], nproc=2)
    assert f"successfully loaded checkpoint from {root} [ t 1/1, p 1/1 ] at iteration 2 " in out


def test_a_checkpoint_without_our_manifest_is_warned_about_once_however_often_it_is_verified(tmp_path,
                                                                                            capsys):
    """--use-checkpoint-args verifies the candidate to read its arguments, then the loader verifies it."""
    root = _copy(tmp_path)
    iteration = int((root / "latest_checkpointed_iteration.txt").read_text())
    for _ in range(2):
        assert _verify(root, iteration) is None
    warned = [line for line in capsys.readouterr().err.splitlines() if "has no manifest" in line]
    assert len(warned) == 1 and str(_iter_dir(root, iteration)) in warned[0], warned

