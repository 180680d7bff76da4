"""Resume, the way an operator lives it: real torchrun runs on real checkpoint directories, no mocks.

A run interrupted at iteration k (`--exit-interval k`, mid-interval) and resumed from the tracker must
continue exactly as the uninterrupted run: the same printed loss and grad norm at every later iteration
and bitwise-identical final checkpoints, with TP=2 and with DP=2 (two microbatches per rank, dropout on,
so the data position and every RNG state must come back; on megatron-core's distributed optimizer with
both overlaps, and with sequence parallelism). A bad tracker or a truncated newest checkpoint
costs one `[resil]` line and a fall-back to the newest complete checkpoint; debris of interrupted saves
is cleaned and never loaded; retention follows Megatron; `--finetune` restarts at iteration 0.

Launches are the cost (about 10 s each on an idle 2-core CPU, 30 s under load), so runs are shared
through module-scoped fixtures:
14 torchrun launches in all (3 per interrupted job, 4 tracker cases, 1 each for
--exit-on-missing-checkpoint and --finetune, 2 inside scripts/demo.sh).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

try:
    from tests import launch  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

from megatron_resil import exit_codes, patches
from megatron_resil.checkpointing.safe_load import CommonLoadWeightsOnly

pytestmark = pytest.mark.slow

N = 10  # every job trains to iteration N ...
K = 5  # ... and its interrupted twin stops at K: not a multiple of --save-interval 2
TRACKER = "latest_checkpointed_iteration.txt"
_PUBLISHED = re.compile(r"^iter_(\d{7})$")

# TP=2 with sequence parallelism: the norms' gradients summed across tensor-parallel ranks, the RNG
# tracker's per-rank streams in the checkpoint.
TP2 = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
# DP=2 with --global-batch-size 8 and micro batch 2: two microbatches per rank (gradient accumulation), on
# megatron-core's distributed optimizer (each rank holds half the Adam state) with gradient reduction and
# parameter gathering overlapped. Dropout stays at its default 0.1, so a resume that lost an RNG state
# would show in the loss.
DP2 = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--global-batch-size", "8", "--use-distributed-optimizer",
       "--overlap-grad-reduce", "--overlap-param-gather"]


# ---- helpers ------------------------------------------------------------------------------------

def _run_ok(args: list[str]) -> str:
    result = launch.run(args)
    assert result.returncode == 0, f"run failed ({result.returncode}):\n{result.stdout[-6000:]}"
    return result.stdout


def _iterations(root: Path) -> list[int]:
    """Published checkpoints: `iter_NNNNNNN` directories (not staging or quarantined ones)."""
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _PUBLISHED.match(p.name)) and p.is_dir())


def _tracker(root: Path) -> str:
    return (root / TRACKER).read_text().strip()


def _resil_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("[resil]")]


def _load_line(root: Path, tp: int, iteration: int) -> str:
    return f"successfully loaded checkpoint from {root} [ t 1/{tp}, p 1/1 ] at iteration {iteration} "


def _iter_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def _same(a, b) -> bool:
    """Exact equality through the nested lists, dicts and tuples a checkpoint holds (RNG states)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _dcp_state(checkpoint: Path, out: Path) -> dict:
    dcp_to_torch_save(str(checkpoint), str(out))
    return torch.load(out, weights_only=False)


# Arguments recorded in common.pt that differ between the two jobs by construction: each job has its own
# directory. Everything else must match.
_ARGS_THAT_DIFFER = {"save", "load"}


def _assert_checkpoints_identical(a: Path, b: Path, scratch: Path,
                                  args_that_differ: frozenset = frozenset()) -> None:
    scratch.mkdir(parents=True, exist_ok=True)
    # As pretrain.py does: megatron-core 0.19's common state is read from the shards through DCP's
    # readers, which only the torch_dcp patches make safe (read_common_from_shards insists on them).
    patches.install(quiet=True)
    tensors_a = _dcp_state(a, scratch / "a.pt")
    tensors_b = _dcp_state(b, scratch / "b.pt")
    assert tensors_a.keys() == tensors_b.keys()
    assert any(k.startswith(("optimizer.", "chained_")) for k in tensors_a)  # chained_<i>.optimizer. with MoE
    assert any("rng_state" in k for k in tensors_a)
    # Every key: weights and Adam moments (torch.equal), and each rank's RNG states (ShardedObjects).
    # megatron-core 0.19 keeps the common state (common.pt before) in the shards as "common_state", the
    # job's own arguments included: compared below, as common.pt is.
    different = sorted(k for k in tensors_a
                       if not k.startswith("common_state/") and not _same(tensors_a[k], tensors_b[k]))
    assert not different, f"{len(different)} of {len(tensors_a)} entries differ: {different[:8]}"

    # Read as the loader reads it (its allow-list admits Megatron-LM's argparse.Namespace); plain
    # torch.load(weights_only=True) passes only once megatron.core has been imported in this process.
    common_a = CommonLoadWeightsOnly().load_common(a)
    common_b = CommonLoadWeightsOnly().load_common(b)
    args_a, args_b = vars(common_a.pop("args")), vars(common_b.pop("args"))  # Namespaces, as Megatron-LM
    assert _same(common_a, common_b)  # iteration, scheduler, optimizer step, version
    # Keys in one record only come from a flag added to pretrain.py between the two runs (a tree being
    # edited while the suite runs); they say nothing about the resume.
    differing_args = {k for k in args_a.keys() & args_b.keys() if args_a[k] != args_b[k]}
    assert differing_args <= _ARGS_THAT_DIFFER | args_that_differ, differing_args
    assert args_a["consumed_train_samples"] == args_b["consumed_train_samples"]


@dataclass
class Job:
    """One training job run twice: A uninterrupted to N; B stopped at K and resumed from its tracker."""

    a_dir: Path
    b_dir: Path
    a_out: str
    b1_out: str  # B until the interruption at K
    b2_out: str  # B resumed to N
    tp: int
    debris: dict[str, Path]


def _plant_debris(root: Path) -> dict[str, Path]:
    """What a kill during a later save, deletion and tracker update would have left behind."""
    staging = root / ".tmp_iter_0000012_abcdef012345"  # newer than anything published
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"\0" * 100)  # a partial shard, no .metadata
    deleting = root / ".deleting_iter_0000002_abcdef012345"
    deleting.mkdir()
    (deleting / "common.pt").write_bytes(b"half a file")
    tracker_tmp = root / f".{TRACKER}.tmp.abcd1234"
    tracker_tmp.write_text("12\n")
    return {"staging": staging, "deleting": deleting, "tracker_tmp": tracker_tmp}


def _interrupted_job(root: Path, base: list[str], policy: list[str], tp: int, debris: bool) -> Job:
    a_dir, b_dir = root / "a", root / "b"
    a_dir.mkdir()  # a job's first run: --load names an empty directory
    b_dir.mkdir()
    common = [*base, "--train-iters", str(N), "--save-interval", "2", *policy]
    a_out = _run_ok([*common, "--save", str(a_dir), "--load", str(a_dir)])
    b_args = [*common, "--save", str(b_dir), "--load", str(b_dir)]
    b1_out = _run_ok([*b_args, "--exit-interval", str(K)])
    planted = _plant_debris(b_dir) if debris else {}
    b2_out = _run_ok(b_args)
    return Job(a_dir, b_dir, a_out, b1_out, b2_out, tp, planted)


@pytest.fixture(scope="module")
def tp2_job(tmp_path_factory) -> Job:
    return _interrupted_job(tmp_path_factory.mktemp("tp2"), TP2, ["--ckpt-keep-last", "2"], tp=2,
                            debris=False)


@pytest.fixture(scope="module")
def dp2_job(tmp_path_factory) -> Job:
    return _interrupted_job(tmp_path_factory.mktemp("dp2"), DP2, ["--save-retain-interval", "4"], tp=1,
                            debris=True)


def _assert_interrupted_at_k(job: Job) -> None:
    assert (f"[resil] exit: --exit-interval {K} reached at iteration {K}; saving and exiting with code "
            f"{exit_codes.FINISHED}") in job.b1_out
    assert f"successfully saved checkpoint from iteration {K:7d} to {job.b_dir}" in job.b1_out
    assert max(launch.losses(job.b1_out)) == K
    # Up to the interruption the two runs are the same run: the baseline for exactness below.
    a = launch.losses(job.a_out)
    assert launch.losses(job.b1_out) == {i: a[i] for i in range(1, K + 1)}


def _assert_resumes_bit_exact(job: Job) -> None:
    assert _load_line(job.b_dir, job.tp, K) in job.b2_out
    assert f"training from iteration {K} to {N}" in job.b2_out
    a, b2 = launch.losses(job.a_out), launch.losses(job.b2_out)
    assert sorted(b2) == list(range(K + 1, N + 1)), "the resumed run must continue, not start over"
    mismatches = {i: (a[i], b2[i]) for i in b2 if b2[i] != a[i]}
    assert not mismatches, f"(lm loss, grad norm) uninterrupted vs resumed: {mismatches}"


# ---- 1. TP=2 ------------------------------------------------------------------------------------

def test_tp2_exit_interval_saves_mid_interval_and_exits_cleanly(tp2_job):
    _assert_interrupted_at_k(tp2_job)


@pytest.mark.compat
def test_tp2_interrupted_run_resumes_bit_exact(tp2_job):
    _assert_resumes_bit_exact(tp2_job)


@pytest.mark.compat
def test_tp2_final_checkpoints_are_bitwise_identical(tp2_job, tmp_path):
    _assert_checkpoints_identical(_iter_dir(tp2_job.a_dir, N), _iter_dir(tp2_job.b_dir, N), tmp_path)


# ---- 2. DP=2, two microbatches per rank, dropout ------------------------------------------------

def test_dp2_exit_interval_saves_mid_interval_and_exits_cleanly(dp2_job):
    _assert_interrupted_at_k(dp2_job)


@pytest.mark.compat
def test_dp2_with_grad_accumulation_resumes_bit_exact(dp2_job):
    _assert_resumes_bit_exact(dp2_job)


@pytest.mark.compat
def test_dp2_final_checkpoints_are_bitwise_identical(dp2_job, tmp_path):
    _assert_checkpoints_identical(_iter_dir(dp2_job.a_dir, N), _iter_dir(dp2_job.b_dir, N), tmp_path)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_constant_structure_checkpoints_equal_those_planned_at_every_save(dp2_job, tmp_path, mode):
    """--ckpt-assume-constant-structure: saves after the first reuse megatron-core's plan and spread and
    skip the sharding validation; with --async-save too (the combination whose cached structure wrote
    wrong bytes in NVRx 0.6). Every checkpoint must equal, entry for entry, the one the same run writes
    when it plans every save (job A of dp2_job), and the losses must be the same run's."""
    root = tmp_path / "c"
    root.mkdir()
    out = _run_ok([*DP2, "--train-iters", str(N), "--save-interval", "2", "--save-retain-interval", "4",
                   "--save", str(root), "--load", str(root), "--ckpt-assume-constant-structure",
                   *(["--async-save"] if mode == "async" else [])])
    assert launch.losses(out) == launch.losses(dp2_job.a_out)
    compared = sorted(set(_iterations(root)) & set(_iterations(dp2_job.a_dir)))
    assert compared == [4, 8, N], compared
    for iteration in compared:
        _assert_checkpoints_identical(_iter_dir(dp2_job.a_dir, iteration), _iter_dir(root, iteration),
                                      tmp_path / str(iteration),
                                      frozenset({"ckpt_assume_constant_structure", "async_save"}))
    # The cached plan megatron-core records in `.metadata` passes the loader's allow-list (it once did
    # not: Megatron-LM's checkpoints saved with this flag were refused), and every checkpoint verifies.
    verify = launch.ckpt_tool("verify", root)
    assert verify.returncode == 0, verify.stdout + verify.stderr


# ---- 3. tracker problems ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def job_dir_with_4_and_8(dp2_job, tmp_path_factory) -> Path:
    """A job directory as a run that stopped at 8 leaves it: iter_0000004, iter_0000008, tracker 8."""
    src = tmp_path_factory.mktemp("tracker_source") / "ckpt"
    shutil.copytree(dp2_job.a_dir, src)
    shutil.rmtree(_iter_dir(src, 10))
    (src / TRACKER).write_text("8\n")
    assert _iterations(src) == [4, 8]
    return src


def _garbage_tracker(root: Path) -> str:
    (root / TRACKER).write_text("g@rbage!\n")
    return f"[resil] tracker: tracker {root / TRACKER} is unparsable"


def _tracker_names_12(root: Path) -> str:
    (root / TRACKER).write_text("12\n")
    return (f"[resil] load: rejected persistent iteration 12 ({_iter_dir(root, 12)}): "
            "rank 0: directory missing")


def _truncate_newest(root: Path) -> str:
    shard = sorted(_iter_dir(root, 8).glob("__*.distcp"))[0]
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    assert _tracker(root) == "8"
    return (f"[resil] load: rejected persistent iteration 8 ({_iter_dir(root, 8)}): "
            f"rank 0: file {shard.name} has {size // 2} bytes, manifest says {size}")


# A deleted or binary tracker is read as the garbage one is (tests/test_checkpoint_primitives.py reads each
# kind of bad tracker); one of them is enough to launch, the scan that follows is the same.
@pytest.mark.parametrize(("damage", "expected_iteration"), [
    pytest.param(_garbage_tracker, 8, id="tracker_garbage"),
    pytest.param(_tracker_names_12, 8, id="tracker_names_missing_iteration_12"),
    pytest.param(_truncate_newest, 4, id="newest_checkpoint_truncated"),
])
@pytest.mark.compat
def test_bad_tracker_or_truncated_checkpoint_falls_back_to_newest_complete_one(
        job_dir_with_4_and_8, dp2_job, tmp_path, damage, expected_iteration):
    root = tmp_path / "ckpt"
    shutil.copytree(job_dir_with_4_and_8, root)
    why = damage(root)
    out = _run_ok([*DP2, "--load", str(root), "--train-iters", str(expected_iteration + 1)])

    # One line says why; what follows from it (the accepted fall-back, a quarantine rename) is not a reason.
    consequences = ("[resil] load: accepted", "[resil] quarantine:")
    decisions = [line for line in _resil_lines(out) if not line.startswith(consequences)]
    assert len(decisions) == 1 and decisions[0].startswith(why), decisions
    assert f"[resil] load: accepted persistent iteration {expected_iteration} " in out
    assert _load_line(root, 1, expected_iteration) in out
    # What it fell back to is a whole checkpoint: the next iteration is the uninterrupted run's, exactly.
    nxt = expected_iteration + 1
    assert launch.losses(out) == {nxt: launch.losses(dp2_job.a_out)[nxt]}


# ---- 4. missing checkpoints ---------------------------------------------------------------------

def test_exit_on_missing_checkpoint_with_empty_load_dir_exits_3_with_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = launch.run([*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "3",
                         "--load", str(empty), "--exit-on-missing-checkpoint"])
    out = result.stdout
    # torchrun itself exits 1 whenever a rank fails; the ranks' own exit code is in its failure report.
    assert result.returncode != 0
    root_cause = re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", out, re.DOTALL)
    assert root_cause and int(root_cause.group(1)) == exit_codes.NO_CHECKPOINT, out[-3000:]
    assert _resil_lines(out) == [
        f"[resil] exit: no loadable checkpoint under --load {empty} and --exit-on-missing-checkpoint is "
        f"set; exiting with code {exit_codes.NO_CHECKPOINT}"]
    assert not re.search(r"\[rank\d+\]: Traceback", out), "ranks must exit, not crash"
    assert "training from iteration" not in out


def test_without_exit_on_missing_checkpoint_empty_load_dir_starts_at_iteration_0(tp2_job):
    # Run A of the TP=2 job was started with --load on its still-empty directory.
    where = re.escape(str(tp2_job.a_dir))
    said = rf"^\[resil\] load: no .*checkpoint under --load {where}; starting .*at iteration 0$"
    assert re.search(said, tp2_job.a_out, re.MULTILINE), _resil_lines(tp2_job.a_out)
    assert f"training from iteration 0 to {N}" in tp2_job.a_out
    assert min(launch.losses(tp2_job.a_out)) == 1


# ---- 5. debris of interrupted saves --------------------------------------------------------------

def test_leftovers_of_interrupted_saves_are_removed_and_never_loaded(dp2_job):
    # The DP=2 job's resume started on a directory holding a staging dir for iteration 12 (with a
    # partial shard), a half-deleted iter_0000002 and a tracker temp file.
    out, debris = dp2_job.b2_out, dp2_job.debris
    cleanup = [line for line in _resil_lines(out) if line.startswith("[resil] cleanup:")]
    assert cleanup == [
        f"[resil] cleanup: removed {debris['deleting']}: interrupted retention deletion",
        f"[resil] cleanup: removed {debris['staging']}: leftover of a save interrupted before it was "
        "published; never loaded",
        f"[resil] cleanup: removed {debris['tracker_tmp']}: interrupted tracker update",
    ]
    assert not any(path.exists() for path in debris.values())
    ours = {".events.reserve", ".resil.lock"}  # the event log's reserve and the directory lock
    leftover = [p.name for p in dp2_job.b_dir.iterdir() if p.name.startswith(".") and p.name not in ours]
    assert leftover == [], leftover
    # Cleaned before the load was chosen, and the load is the real checkpoint at K, not "12".
    assert out.index("[resil] cleanup:") < out.index("[resil] load:")
    assert _load_line(dp2_job.b_dir, 1, K) in out
    others = [line for line in _resil_lines(out) if not line.startswith("[resil] cleanup:")]
    assert not any(".tmp_iter_" in line for line in others), others


# ---- 6. retention ---------------------------------------------------------------------------------

def test_ckpt_keep_last_2_leaves_only_the_two_newest(tp2_job):
    # --save-interval 2 --train-iters 10 --ckpt-keep-last 2
    assert _iterations(tp2_job.a_dir) == [8, 10]
    assert _tracker(tp2_job.a_dir) == "10"
    deleted = re.findall(r"\[resil\] retention: deleted .*iter_(\d{7})", tp2_job.a_out)
    assert sorted(map(int, deleted)) == [2, 4, 6]
    assert _iterations(tp2_job.b_dir) == [8, 10]  # the interrupted-and-resumed job ends the same


def test_save_retain_interval_4_keeps_its_multiples_plus_the_newest(dp2_job):
    # --save-interval 2 --train-iters 10 --save-retain-interval 4, Megatron's semantics
    assert _iterations(dp2_job.a_dir) == [4, 8, 10]
    assert _tracker(dp2_job.a_dir) == "10"
    deleted = re.findall(r"\[resil\] retention: deleted .*iter_(\d{7})", dp2_job.a_out)
    assert sorted(map(int, deleted)) == [2, 6]
    assert _iterations(dp2_job.b_dir) == [4, 8, 10]


# ---- 7. finetune ----------------------------------------------------------------------------------

def test_finetune_restarts_at_iteration_0_from_the_trained_weights(tp2_job):
    out = _run_ok([*TP2, "--train-iters", "3", "--load", str(tp2_job.a_dir), "--finetune",
                   "--no-load-optim"])
    assert f"[resil] load: accepted persistent iteration {N} " in out
    assert _load_line(tp2_job.a_dir, 2, 0) in out
    assert "training from iteration 0 to 3" in out
    tuned, fresh = launch.losses(out), launch.losses(tp2_job.a_out)
    assert sorted(tuned) == [1, 2, 3]
    # Same first batch and dropout masks as run A's iteration 1, but trained weights: a lower loss.
    assert float(tuned[1][0]) < float(fresh[1][0]), (tuned[1], fresh[1])


# ---- 8. the README's main job -------------------------------------------------------------------

def test_demo_script_stops_at_20_and_resumes_to_30(tmp_path):
    venv = Path(sys.prefix)
    # scripts/setup_env.sh's stamp: setup.py and the constraints it installs through.
    stamped = b"".join((launch.REPO / name).read_bytes() for name in ("setup.py", "scripts/constraints.txt"))
    stamp = venv / f".megatron-resil-{hashlib.sha1(stamped).hexdigest()[:12]}"
    if not stamp.exists():
        pytest.skip(f"{venv} is not set up for this setup.py and constraints ({stamp.name} missing); demo.sh "
                    "would pip install into it")
    env = {**launch.env(), "RESIL_VENV": str(venv), "DEMO_DIR": str(tmp_path)}
    result = subprocess.run(["bash", str(launch.REPO / "scripts" / "demo.sh")], env=env, cwd=launch.REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    out = result.stdout
    assert result.returncode == 0, out[-6000:]
    run1, run2 = out.split("=== run 2")
    ckpt = tmp_path / "checkpoints"
    assert "=== tracker after run 1: 20 ===" in run1
    assert max(launch.losses(run1)) == 20
    assert _load_line(ckpt, 1, 20) in run2
    assert max(launch.losses(run2)) == 30
    assert _tracker(ckpt) == "30"
