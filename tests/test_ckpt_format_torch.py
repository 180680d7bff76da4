"""--ckpt-format torch, Megatron-LM's legacy per-rank checkpoints, under real torchrun runs.

Two 2-rank jobs, each trained once to iteration N with saves at 2, 4 and 6, then resumed once from a copy
whose newest checkpoint was damaged:
- interleaved: PP 2 with two virtual stages per rank, the distributed optimizer with both overlaps and
  --overlap-param-gather-with-optimizer-step (a chained optimizer: distrib_optim.pt holds a list). A byte
  flipped in the newest model_optim_rng.pt: the loader rejects it and resumes iteration 4 exactly.
- dp2: the distributed optimizer at DP 2 (its state gathered to data-parallel rank 0's distrib_optim.pt). A
  pickle that would run a command planted in the newest model_optim_rng.pt, its manifest rewritten to match
  (whoever writes the bytes can write the manifest): refused without running, iteration 4 resumed exactly.
The files are checked to be in Megatron-LM's layout and to unpickle as Megatron-LM reads them
(torch.load(weights_only=True) with megatron-core's safe globals).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

try:
    from tests import launch  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

from megatron_resil.arguments import parse_args
from megatron_resil.checkpointing import torch_format
from megatron_resil.checkpointing.manifest import MANIFEST_NAME, file_checksum

N = 6
OVERLAPS = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
INTERLEAVED = [*launch.TINY_MODEL[2:], *launch.TINY_TRAINING, "--num-layers", "4", "--global-batch-size", "4",
               "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
               *OVERLAPS, "--overlap-param-gather-with-optimizer-step"]
DP2 = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--global-batch-size", "8", *OVERLAPS]
TRACKER = "latest_checkpointed_iteration.txt"


class Evil:
    """What a planted model_optim_rng.pt asks an unpickler to do: run a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _run_ok(args: list[str]) -> str:
    result = launch.run(args)
    assert result.returncode == 0, f"run failed ({result.returncode}):\n{result.stdout[-6000:]}"
    return result.stdout


def _as_megatron_lm_reads(path: Path):
    """Megatron-LM's read of a legacy file: torch.load weights-only, megatron-core's safe globals registered
    (argparse.Namespace, NumPy's RNG state)."""
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
    return torch.load(path, map_location="cpu", weights_only=True)


def _rewrite_manifest_entry(checkpoint: Path, relative: str) -> None:
    manifest_path = checkpoint / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    path = checkpoint / relative
    manifest["files"][relative] = {"size": path.stat().st_size, "crc32": file_checksum(str(path))}
    manifest_path.write_text(json.dumps(manifest))


def _job(root: Path, base: list[str], damage) -> dict:
    a_dir, b_dir = root / "a", root / "b"
    a_dir.mkdir()
    common = [*base, "--ckpt-format", "torch", "--train-iters", str(N), "--save-interval", "2"]
    a_out = _run_ok([*common, "--save", str(a_dir), "--load", str(a_dir)])
    shutil.copytree(a_dir, b_dir)
    damage(b_dir / f"iter_{N:07d}", root)
    b_out = _run_ok([*common, "--save", str(b_dir), "--load", str(b_dir)])
    return {"a_dir": a_dir, "b_dir": b_dir, "a_out": a_out, "b_out": b_out, "root": root}


def _flip_a_byte(checkpoint: Path, root: Path) -> None:
    target = checkpoint / "mp_rank_00_001" / torch_format.MODEL_FILE
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))


def _plant_pickle(checkpoint: Path, root: Path) -> None:
    relative = f"mp_rank_00/{torch_format.MODEL_FILE}"
    (checkpoint / relative).unlink()
    torch.save({"args": Evil(root / "PWNED"), "iteration": N}, checkpoint / relative)
    _rewrite_manifest_entry(checkpoint, relative)


@pytest.fixture(scope="module")
def interleaved_job(tmp_path_factory) -> dict:
    return _job(tmp_path_factory.mktemp("interleaved"), INTERLEAVED, _flip_a_byte)


@pytest.fixture(scope="module")
def dp2_job(tmp_path_factory) -> dict:
    return _job(tmp_path_factory.mktemp("dp2"), DP2, _plant_pickle)


def _assert_resumed_exactly_from(job: dict, iteration: int) -> None:
    assert f"successfully loaded checkpoint from {job['b_dir']} " in job["b_out"]
    assert f"training from iteration {iteration} to {N}" in job["b_out"]
    a, b = launch.losses(job["a_out"]), launch.losses(job["b_out"])
    assert sorted(b) == list(range(iteration + 1, N + 1))
    assert {i: b[i] for i in b} == {i: a[i] for i in b}, "(lm loss, grad norm) uninterrupted vs resumed"


def _assert_same_final_state(job: dict, rank_dirs: list[str]) -> None:
    """The resumed run's final checkpoint holds the uninterrupted run's weights, optimizer state and
    distributed optimizer state, bit for bit."""
    for rank_dir in rank_dirs:
        for name in (torch_format.MODEL_FILE, torch_format.OPTIMIZER_FILE):
            a = torch_format.read_file(str(job["a_dir"] / f"iter_{N:07d}" / rank_dir / name))
            b = torch_format.read_file(str(job["b_dir"] / f"iter_{N:07d}" / rank_dir / name))
            if name == torch_format.MODEL_FILE:
                a = {k: v for k, v in a.items() if k != "args"}  # --save and --load differ by construction
                b = {k: v for k, v in b.items() if k != "args"}
            compared = _tensors(a)
            assert compared and compared.keys() == _tensors(b).keys()
            different = [k for k, t in compared.items() if not torch.equal(t, _tensors(b)[k])]
            assert not different, f"{rank_dir}/{name}: {different[:5]}"


def _tensors(value, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for key, part in items:
        out.update(_tensors(part, f"{prefix}/{key}"))
    return out


# ---- interleaved pipeline, chained distributed optimizer ----------------------------------------------

@pytest.mark.slow
@pytest.mark.compat
def test_interleaved_checkpoints_are_in_megatron_lms_layout(interleaved_job):
    a_dir = interleaved_job["a_dir"]
    assert (a_dir / TRACKER).read_text().strip() == str(N)
    for iteration in (2, 4, N):
        checkpoint = a_dir / f"iter_{iteration:07d}"
        files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())
        assert files == ["mp_rank_00_000/distrib_optim.pt", "mp_rank_00_000/model_optim_rng.pt",
                         "mp_rank_00_001/distrib_optim.pt", "mp_rank_00_001/model_optim_rng.pt",
                         MANIFEST_NAME]
        manifest = json.loads((checkpoint / MANIFEST_NAME).read_text())
        assert manifest["format"] == "torch" and sorted(manifest["files"]) == files[:-1]
    state = _as_megatron_lm_reads(a_dir / f"iter_{N:07d}" / "mp_rank_00_001" / torch_format.MODEL_FILE)
    assert {"args", "checkpoint_version", "iteration", "model0", "model1", "optimizer", "opt_param_scheduler",
            "rng_state", "num_floating_point_operations_so_far"} <= state.keys()
    assert state["iteration"] == N and state["checkpoint_version"] == 3.0
    assert isinstance(state["args"], argparse.Namespace)
    assert state["args"].virtual_pipeline_model_parallel_size == 2
    assert state["args"].consumed_train_samples == N * 4
    assert any(key.endswith("output_layer.weight") for key in state["model1"])  # the last stage's
    assert isinstance(state["rng_state"], list) and len(state["rng_state"]) == 1
    # --overlap-param-gather-with-optimizer-step: the first chunk's optimizer and the rest's, chained.
    assert isinstance(state["optimizer"], list) and len(state["optimizer"]) == 2
    parameters = _as_megatron_lm_reads(a_dir / f"iter_{N:07d}/mp_rank_00_001" / torch_format.OPTIMIZER_FILE)
    assert isinstance(parameters, list) and len(parameters) == 2
    assert all(part["buckets_coalesced"] for part in parameters)


@pytest.mark.slow
@pytest.mark.compat
def test_flipped_byte_is_rejected_and_the_previous_checkpoint_resumes_exactly(interleaved_job):
    out, b_dir = interleaved_job["b_out"], interleaved_job["b_dir"]
    rejected = [line for line in out.splitlines() if line.startswith("[resil] load: rejected")]
    assert len(rejected) == 1, rejected
    assert f"rejected persistent iteration {N} " in rejected[0]
    assert f"mp_rank_00_001/{torch_format.MODEL_FILE} fails its checksum" in rejected[0]
    assert "[resil] load: accepted persistent iteration 4 " in out
    assert [p.name for p in b_dir.iterdir() if ".quarantined." in p.name] != []
    _assert_resumed_exactly_from(interleaved_job, 4)
    _assert_same_final_state(interleaved_job, ["mp_rank_00_000", "mp_rank_00_001"])


# ---- distributed optimizer at DP 2 ---------------------------------------------------------------------

@pytest.mark.slow  # first lane only: the second runs the interleaved job's (CI time)
def test_dp2_distributed_optimizer_state_is_gathered_to_one_file(dp2_job):
    checkpoint = dp2_job["a_dir"] / "iter_0000004"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["mp_rank_00", MANIFEST_NAME]
    assert sorted(p.name for p in (checkpoint / "mp_rank_00").iterdir()) == \
        ["distrib_optim.pt", "model_optim_rng.pt"]  # data-parallel rank 0 writes both
    parameters = _as_megatron_lm_reads(checkpoint / "mp_rank_00" / torch_format.OPTIMIZER_FILE)
    (buffer,) = parameters[0].values()
    assert parameters["buckets_coalesced"] and {"param", "exp_avg", "exp_avg_sq", "numel_unpadded"} <= \
        buffer.keys()
    # Both ranks' halves: the whole unpadded buffer, whatever the data-parallel size that reads it.
    assert buffer["param"].numel() == buffer["numel_unpadded"]
    state = _as_megatron_lm_reads(checkpoint / "mp_rank_00" / torch_format.MODEL_FILE)
    assert "state" not in state["optimizer"]["optimizer"]  # the parameter state is distrib_optim.pt's


@pytest.mark.slow  # first lane only: the second runs the interleaved job's (CI time)
def test_planted_pickle_is_refused_without_running_and_the_previous_checkpoint_resumes(dp2_job):
    out, root = dp2_job["b_out"], dp2_job["root"]
    assert not (root / "PWNED").exists(), "the planted pickle ran"
    rejected = [line for line in out.splitlines() if line.startswith("[resil] load: rejected")]
    assert len(rejected) == 1 and f"rejected persistent iteration {N} " in rejected[0], rejected
    assert "asks to unpickle" in rejected[0] and "system" in rejected[0], rejected[0]
    _assert_resumed_exactly_from(dp2_job, 4)
    _assert_same_final_state(dp2_job, ["mp_rank_00"])
    # The checkpoint tool, which reads every rank's files without process groups, refuses it too.
    quarantined = next(p for p in dp2_job["b_dir"].iterdir() if ".quarantined." in p.name)
    shutil.copytree(quarantined, root / "tool" / f"iter_{N:07d}")
    verdict = launch.ckpt_tool("verify", root / "tool")
    assert verdict.returncode == 1 and "asks to unpickle" in verdict.stdout, verdict.stdout
    assert not (root / "PWNED").exists()


@pytest.mark.slow  # first lane only: the second runs the interleaved job's (CI time)
def test_planted_pickle_in_distrib_optim_is_refused_by_the_checkpoint_tool(dp2_job):
    root = dp2_job["root"] / "tool_optim"
    shutil.copytree(dp2_job["a_dir"] / "iter_0000004", root / "iter_0000004")
    relative = f"mp_rank_00/{torch_format.OPTIMIZER_FILE}"
    (root / "iter_0000004" / relative).unlink()
    torch.save([Evil(root / "PWNED")], root / "iter_0000004" / relative)
    _rewrite_manifest_entry(root / "iter_0000004", relative)
    verdict = launch.ckpt_tool("verify", root)
    assert verdict.returncode == 1, verdict.stdout
    assert f"{relative} asks to unpickle" in verdict.stdout and "system" in verdict.stdout, verdict.stdout
    assert not (root / "PWNED").exists()


# ---- what a rank reads into memory ---------------------------------------------------------------------

@pytest.fixture
def one_rank_model_parallel(tmp_path):
    """torch.distributed and megatron-core's model-parallel groups for this process alone, as a rank has them
    when the loader verifies."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_a_rank_file_larger_than_this_models_state_can_be_is_passed_over_unread(tmp_path,
                                                                              one_rank_model_parallel):
    """model_optim_rng.pt is read whole into memory: before, one of any size was (a sparse terabyte too).
    A run reads none larger than its model's parameters and optimizer state can fill; a larger one is
    passed over, not quarantined: it may be a good checkpoint of a larger model."""
    from megatron_resil.checkpointing import state
    from megatron_resil.checkpointing.global_tier import GlobalTier
    from megatron_resil.checkpointing.tier import NotForThisRun, TierCandidate

    model = [torch.nn.Linear(64, 64)]  # 4,160 parameters
    assert state.max_rank_bytes(model) == 4160 * 32 + (256 << 20)
    tier = GlobalTier(str(tmp_path / "ckpt"))
    tier.max_rank_bytes = state.max_rank_bytes(model)
    file = tmp_path / "ckpt" / "iter_0000004" / "mp_rank_00" / torch_format.MODEL_FILE
    file.parent.mkdir(parents=True)
    with open(file, "wb") as f:
        f.truncate(tier.max_rank_bytes + 1)  # sparse: a file system holds such a file for nothing
    reason = tier.verify(TierCandidate("persistent", 4, str(file.parent.parent)))
    assert isinstance(reason, NotForThisRun), reason
    said = f"mp_rank_00/{torch_format.MODEL_FILE} has {tier.max_rank_bytes + 1} bytes, more than this run's"
    assert f"{said} model and optimizer state can take" in reason, reason


# ---- arguments -----------------------------------------------------------------------------------------

def test_megatron_lms_overlap_optimizer_config_is_accepted_with_the_torch_format(tmp_path):
    args = parse_args([*INTERLEAVED, "--ckpt-format", "torch", "--train-iters", "4", "--mock-data",
                       "--save", str(tmp_path / "ckpt")], world_size=2)
    assert args.ckpt_format == "torch" and args.overlap_param_gather_with_optimizer_step
    assert args.virtual_pipeline_model_parallel_size == 2
