"""Checkpoints that fail verification are rejected by every rank together, quarantined, and never
loaded; a checkpoint that verifies but does not fit the model stops the run instead of a silent
fresh start; the checkpoint tool tells the same story without training."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests import launch

pytestmark = pytest.mark.slow


def _train_args(save, iters: int, extra=()) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(iters),
            "--save", str(save), "--load", str(save), "--save-interval", "2", *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """iter_0000002 and iter_0000004, tracker at 4."""
    root = tmp_path_factory.mktemp("trained") / "ckpt"
    result = launch.run(_train_args(root, 4))
    assert result.returncode == 0, result.stdout[-3000:]
    return root


def _flip_byte(path, offset: int = 1000) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _tool(*args) -> subprocess.CompletedProcess:
    return launch.ckpt_tool(*args)


@pytest.mark.compat
def test_flipped_bit_in_a_shard_is_rejected_quarantined_and_the_run_falls_back(trained, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    _flip_byte(root / "iter_0000004" / "__1_0.distcp")

    which = _tool("which", root)
    assert which.returncode == 0
    assert "would reject persistent iteration 4" in which.stdout and "fails its checksum" in which.stdout
    assert "would load persistent iteration 2" in which.stdout

    result = launch.run(_train_args(root, 3))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[resil] load: rejected persistent iteration 4" in result.stdout
    assert "__1_0.distcp fails its checksum" in result.stdout
    assert "successfully loaded checkpoint from" in result.stdout and "at iteration 2" in result.stdout
    quarantined = list(root.glob("iter_0000004.quarantined.checksum.*"))
    assert len(quarantined) == 1, list(root.iterdir())
    assert "fails its checksum" in (quarantined[0] / "QUARANTINE_REASON.txt").read_text()
    listing = _tool("list", root).stdout
    assert "quarantined iter_0000004.quarantined.checksum" in listing

    # The same decisions, machine-readable, in the event log beside the checkpoints.
    log = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]
    this_run = log[max(i for i, e in enumerate(log) if e["event"] == "start"):]
    decisions = [(e["event"], e.get("verdict"), e.get("iteration")) for e in this_run
                 if e["event"] in ("load", "quarantine", "loaded")]
    assert decisions == [("load", "rejected", 4), ("quarantine", None, 4), ("load", "accepted", 2),
                         ("loaded", None, 2)]
    quarantine = next(e for e in this_run if e["event"] == "quarantine")
    assert "fails its checksum" in quarantine["reason"]
    assert [e["iteration"] for e in this_run if e["event"] == "save_published"] == [3]
    assert this_run[-1]["event"] == "finished"


def test_checkpoints_present_but_none_loadable_refuses_a_fresh_start(trained, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    for iteration in (2, 4):
        shard = root / f"iter_{iteration:07d}" / "__0_0.distcp"
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    assert _tool("verify", root).returncode == 1

    result = launch.run(_train_args(root, 6))
    assert result.returncode != 0
    assert "refusing to start from scratch" in result.stdout
    assert "exitcode  : 3" in result.stdout
    assert "training from iteration" not in result.stdout
    # Nothing was deleted: both are kept, renamed, for a human to look at.
    assert len(list(root.glob("iter_*.quarantined.truncated.*"))) == 2
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


def test_a_checkpoint_that_does_not_fit_the_model_stops_the_run_and_keeps_it(trained, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    args = _train_args(root, 6)
    args[args.index("--hidden-size") + 1] = "128"
    result = launch.run(args)
    assert result.returncode != 0
    assert "passed verification but does not load into this model" in result.stdout
    assert "Global shape mismatch" in result.stdout
    assert "exitcode  : 3" in result.stdout
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    assert _tool("verify", root).returncode == 0


def test_a_fifo_tracker_neither_hangs_the_tool_nor_hides_the_checkpoints(trained, tmp_path):
    import os
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    (root / "latest_checkpointed_iteration.txt").unlink()
    os.mkfifo(root / "latest_checkpointed_iteration.txt")  # opening it for reading blocks without a writer
    which = _tool("which", root)  # _tool's timeout fails the test if it hangs
    assert which.returncode == 0, which.stdout + which.stderr
    assert "is not a regular file (a FIFO)" in which.stdout
    assert "would load persistent iteration 4" in which.stdout


def test_a_symlink_planted_in_a_checkpoint_is_rejected_by_name_and_never_written_through(trained, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    victim = tmp_path / "victim.txt"  # outside every directory the run was given
    victim.write_text("precious\n")
    (root / "iter_0000004" / "QUARANTINE_REASON.txt").symlink_to(victim)
    # And in the older checkpoint, a shard swapped for a symlink to an identical copy elsewhere.
    shard = root / "iter_0000002" / "__0_0.distcp"
    shutil.copy(shard, tmp_path / "copy.distcp")
    shard.unlink()
    shard.symlink_to(tmp_path / "copy.distcp")

    verify = _tool("verify", root)
    assert verify.returncode == 1
    assert "holds a symlink, QUARANTINE_REASON.txt" in verify.stdout
    assert "holds a symlink, __0_0.distcp" in verify.stdout

    result = launch.run(_train_args(root, 3))  # nothing verifies: refuses to start from scratch (3)
    assert "[resil] load: rejected persistent iteration 4" in result.stdout
    assert "holds a symlink, QUARANTINE_REASON.txt" in result.stdout
    assert victim.read_text() == "precious\n"  # the quarantine wrote its reason beside, not through
    quarantined = next(root.glob("iter_0000004.quarantined.*"))
    reason = quarantined / "QUARANTINE_REASON.txt"
    assert not reason.is_symlink() and "symlink" in reason.read_text()


def test_a_read_only_load_skips_a_bad_checkpoint_in_memory_and_loads_the_older_one(trained, tmp_path):
    import subprocess as sp
    source = tmp_path / "source"
    shutil.copytree(trained, source)
    _flip_byte(source / "iter_0000004" / "__1_0.distcp")
    mounted = tmp_path / "readonly"
    mounted.mkdir()
    if sp.run(["mount", "--bind", str(source), str(mounted)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        if sp.run(["mount", "-o", "remount,bind,ro", str(mounted)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount read-only here")
        save = tmp_path / "new_save"
        result = launch.run([*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "3",
                             "--load", str(mounted), "--save", str(save), "--save-interval", "2"])
    finally:
        sp.run(["umount", "-l", str(mounted)], check=False)
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    assert "[resil] load: rejected persistent iteration 4" in out
    assert f"[resil] quarantine: left {mounted}/iter_0000004 in place" in out
    assert "successfully loaded checkpoint from" in out and "at iteration 2" in out
    assert sorted(p.name for p in source.iterdir() if p.name.startswith("iter_")) == \
        ["iter_0000002", "iter_0000004"]  # nothing renamed in the directory that was only read
