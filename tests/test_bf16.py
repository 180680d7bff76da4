"""--bf16 (megatron-core's Float16Module, fp32 main params in the optimizer) resumes exactly on CPU."""

from __future__ import annotations

import pytest

from tests import launch

pytestmark = pytest.mark.slow


def test_bf16_interrupted_run_continues_the_loss_curve_exactly(tmp_path):
    def args(save, *extra):
        return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--bf16", "--train-iters", "6",
                "--save", str(save), "--load", str(save), "--save-interval", "3", *extra]

    reference = launch.run(args(tmp_path / "a"))
    first = launch.run(args(tmp_path / "b", "--exit-interval", "3"))
    resumed = launch.run(args(tmp_path / "b"))
    for result in (reference, first, resumed):
        assert result.returncode == 0, result.stdout[-3000:]
    assert "at iteration 3" in resumed.stdout
    expected = launch.losses(reference.stdout)
    got = {**launch.losses(first.stdout), **launch.losses(resumed.stdout)}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert got == expected


def test_bf16_with_tensor_parallel_2_counts_every_ranks_gradients_in_the_grad_norm():
    """The fp32 main parameters keep `tensor_model_parallel`, so the grad norm sums the TP-sharded
    gradients of both TP ranks: TP=2 on 2 ranks reports what one rank reports alone (data parallel size 1
    both, the same batches; CPU initialisation builds the full tensors and splits them, so the same
    weights), within bf16's rounding, and what fp32 TP=2 reports."""
    def norms(nproc, *extra):
        result = launch.run([*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "3", *extra],
                            nproc=nproc)
        assert result.returncode == 0, result.stdout[-3000:]
        return {it: float(norm) for it, (_, norm) in launch.losses(result.stdout).items()}

    alone_bf16 = norms(1, "--bf16")
    tp2_bf16 = norms(2, "--bf16", "--tensor-model-parallel-size", "2")
    tp2_fp32 = norms(2, "--tensor-model-parallel-size", "2")
    for it in (1, 2, 3):
        assert tp2_bf16[it] == pytest.approx(alone_bf16[it], rel=0.02), (it, alone_bf16, tp2_bf16)
        assert tp2_bf16[it] == pytest.approx(tp2_fp32[it], rel=0.03), (it, tp2_bf16, tp2_fp32)
