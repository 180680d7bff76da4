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
