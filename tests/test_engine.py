"""Training on megatron-core's engine, each parallel layout of the CPU matrix for real: a job runs to N
saving at K; a second job resumes from a copy of that checkpoint and must continue exactly as the first
did (the same printed loss and grad norm, and a bitwise-identical final checkpoint). DP=2 with the
distributed optimizer and both overlaps, and TP=2 with sequence parallelism, are test_resume.py's jobs;
here: PP=2 1F1B, PP=2 interleaved, EP=2 MoE (alltoall), TP=2 x PP=2 on four ranks.

Two launches per layout (about 15 s each with two ranks on an idle 2-core machine).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

try:
    from tests import launch
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

from megatron_resil.checkpointing.safe_load import CommonLoadWeightsOnly
from tests.test_resume import TRACKER, _assert_checkpoints_identical, _iter_dir

pytestmark = pytest.mark.slow

N, K = 6, 3
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall"]
LAYOUTS = {
    "pp2_1f1b": (2, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]),
    "pp2_interleaved": (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                            "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8"]),
    "ep2_moe": (2, [*MOE, "--global-batch-size", "8", "--use-distributed-optimizer"]),
    "tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                    "--sequence-parallel", "--use-distributed-optimizer", "--global-batch-size", "4"]),
}


@dataclass
class ResumedJob:
    full_dir: Path
    resumed_dir: Path
    full_out: str
    resumed_out: str


def _run_ok(nproc: int, args: list[str]) -> str:
    result = launch.run(args, nproc=nproc, timeout=420)
    assert result.returncode == 0, f"run failed ({result.returncode}):\n{result.stdout[-6000:]}"
    return result.stdout


def _resumed_job(root: Path, nproc: int, layout: list[str]) -> ResumedJob:
    common = [*launch.TINY_MODEL, *launch.TINY_TRAINING, *layout, "--train-iters", str(N),
              "--save-interval", str(K)]
    full_dir, resumed_dir = root / "full", root / "resumed"
    full_out = _run_ok(nproc, [*common, "--save", str(full_dir)])
    resumed_dir.mkdir()
    shutil.copytree(_iter_dir(full_dir, K), _iter_dir(resumed_dir, K))
    (resumed_dir / TRACKER).write_text(f"{K}\n")
    resumed_out = _run_ok(nproc, [*common, "--save", str(resumed_dir), "--load", str(resumed_dir)])
    return ResumedJob(full_dir, resumed_dir, full_out, resumed_out)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def job(request, tmp_path_factory) -> tuple[str, ResumedJob]:
    nproc, layout = LAYOUTS[request.param]
    return request.param, _resumed_job(tmp_path_factory.mktemp(request.param), nproc, layout)


@pytest.mark.compat
def test_resumed_run_continues_bit_exact(job):
    name, run = job
    full, resumed = launch.losses(run.full_out), launch.losses(run.resumed_out)
    assert sorted(full) == list(range(1, N + 1)), run.full_out[-3000:]
    assert sorted(resumed) == list(range(K + 1, N + 1)), run.resumed_out[-3000:]
    assert {i: full[i] for i in resumed} == resumed
    pp = 2 if "pp2" in name else 1
    tp = 2 if "tp2" in name else 1
    assert (f"successfully loaded checkpoint from {run.resumed_dir} [ t 1/{tp}, p 1/{pp} ] at iteration "
            f"{K}") in run.resumed_out


@pytest.mark.compat
def test_final_checkpoints_are_bitwise_identical(job, tmp_path):
    _, run = job
    _assert_checkpoints_identical(_iter_dir(run.full_dir, N), _iter_dir(run.resumed_dir, N), tmp_path)


@pytest.mark.compat
def test_checkpoint_holds_megatron_lm_keys(job):
    """The common state as Megatron-LM writes it (common.pt; inside the shards on megatron-core 0.19);
    the tensors under megatron-core's sharded keys (layers stacked along a layer axis, the norms under
    the keys Transformer Engine's fused layers use), whatever the pipeline layout that wrote them."""
    name, run = job
    checkpoint = _iter_dir(run.full_dir, N)
    common = CommonLoadWeightsOnly().load_common(checkpoint)
    assert set(common) == {"args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far",
                           "rerun_state_machine", "optimizer", "opt_param_scheduler", "content_metadata"}
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == N
    assert common["args"].consumed_train_samples == N * common["args"].global_batch_size
    keys = set(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    assert {"embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_qkv.weight",
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight", "decoder.final_layernorm.weight",
            "rng_state"} <= {key.split("/")[0] for key in keys}
    distributed = "--use-distributed-optimizer" in LAYOUTS[name][1]
    # Megatron's keys: optimizer.*, or chained_<i>.optimizer.* when experts have an optimizer of their own.
    unprefixed = {k.split(".", 1)[1] if k.startswith("chained_") else k for k in keys}
    assert any(k.startswith("optimizer.distributed.") for k in unprefixed) == distributed
    if name == "ep2_moe":
        assert any(k.startswith("decoder.layers.mlp.experts.") for k in keys)


def test_moe_log_line_carries_the_load_balancing_loss(job):
    name, run = job
    if name != "ep2_moe":
        pytest.skip("dense model")
    lines = [line for line in run.full_out.splitlines() if " iteration " in line and "lm loss:" in line]
    assert lines and all("| load_balancing_loss: " in line for line in lines), lines[:2]
    assert lines[0].index("lm loss:") < lines[0].index("load_balancing_loss:") < lines[0].index("grad norm:")
