"""Checkpoints move between Megatron-LM and megatron-resil both ways.

A run of pretrain.py saves at iteration 2; Megatron-LM's load path (tests/megatron_lm_layout.py, written
from its core_v0.16.1 checkpointing code) reads that checkpoint and writes it back as Megatron-LM writes
one: in place, no manifest, the tracker overwritten. pretrain.py resumes from Megatron-LM's copy and must
continue exactly as the original run did, which it can only do if both sides read every tensor, the
optimizer state, the RNG states and the consumed samples where the other wrote them.

A checkpoint of megatron-resil 0.1 (its own optimizer) fails with one line that says what to do, and
loads its weights when told to (--no-load-optim --no-load-rng).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    from tests import launch
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

from megatron_resil import exit_codes

pytestmark = pytest.mark.slow

TRACKER = "latest_checkpointed_iteration.txt"
# DP=2 on the distributed optimizer: each rank holds half the Adam state; dropout on.
JOB = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--global-batch-size", "8", "--use-distributed-optimizer"]
OLD_CHECKPOINT = Path(__file__).parent / "data" / "checkpoint_v0_1"
OLD_MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
             "--max-position-embeddings", "8", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32",
             "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data",
             "--log-interval", "1"]


def _megatron_lm_copy(ours: Path, theirs: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
           "2", str(Path(__file__).parent / "megatron_lm_layout.py"), "--megatron-load", str(ours),
           "--megatron-save", str(theirs), *JOB, "--train-iters", "4"]
    result = subprocess.run(cmd, env=launch.env(), cwd=launch.REPO, timeout=300, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert result.returncode == 0, result.stdout[-5000:]
    return result.stdout


def _run_ok(args: list[str]) -> str:
    result = launch.run(args, timeout=300)
    assert result.returncode == 0, result.stdout[-5000:]
    return result.stdout


def test_megatron_lm_reads_our_checkpoint_and_we_resume_its_copy_exactly(tmp_path):
    original = _run_ok([*JOB, "--train-iters", "4", "--save", str(tmp_path / "run"), "--save-interval", "2"])
    ours = tmp_path / "ours"
    ours.mkdir()
    shutil.copytree(tmp_path / "run" / "iter_0000002", ours / "iter_0000002")
    (ours / TRACKER).write_text("2\n")

    theirs = tmp_path / "theirs"
    megatron = _megatron_lm_copy(ours, theirs)
    loaded = (f"successfully loaded checkpoint from {ours} [ t 1/1, p 1/1 ] at iteration 2 "
              "(consumed samples 16)")
    assert loaded in megatron
    assert (theirs / TRACKER).read_text() == "2"  # Megatron-LM writes the bare number
    assert not (theirs / "iter_0000002" / "resil_manifest.json").exists()

    resumed = _run_ok([*JOB, "--train-iters", "4", "--load", str(theirs), "--save", str(tmp_path / "after")])
    assert f"{theirs / 'iter_0000002'} has no manifest: saved by Megatron-LM" in resumed
    assert f"successfully loaded checkpoint from {theirs} [ t 1/1, p 1/1 ] at iteration 2 " in resumed
    before, after = launch.losses(original), launch.losses(resumed)
    assert sorted(after) == [3, 4]
    assert after == {3: before[3], 4: before[4]}, (before, after)


def test_a_checkpoint_of_version_0_1_fails_with_one_line_and_loads_its_weights_when_told(tmp_path):
    load = tmp_path / "old"
    shutil.copytree(OLD_CHECKPOINT, load, ignore=shutil.ignore_patterns("README.md"))
    refused = launch.run([*OLD_MODEL, "--train-iters", "3", "--load", str(load)], timeout=300)
    out = refused.stdout
    assert refused.returncode != 0
    assert re.search(rf"exitcode\s*:\s*{exit_codes.NO_CHECKPOINT}\b", out), out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("[resil] exit:")]
    assert len(lines) == 1 and "megatron-resil's own optimizer" in lines[0], lines
    assert "--no-load-optim --no-load-rng" in lines[0]
    assert not re.search(r"\[rank\d+\]: Traceback", out), "ranks must exit, not crash"
    # Nothing is wrong with it: it is not set aside.
    assert not any(p.name.startswith("iter_0000002.quarantined") for p in load.iterdir())

    weights = _run_ok([*OLD_MODEL, "--train-iters", "3", "--load", str(load), "--no-load-optim",
                       "--no-load-rng"])
    assert f"successfully loaded checkpoint from {load} [ t 1/1, p 1/1 ] at iteration 2 " in weights
    assert sorted(launch.losses(weights)) == [3]
