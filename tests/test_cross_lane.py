"""A checkpoint written on one lane resumes on the other, exactly: Python 3.11 + megatron-core 0.16 +
NVRx 0.4 (the first lane, scripts/setup_env.sh) and Python 3.12 + megatron-core 0.19 + NVRx 0.7 (the
second, scripts/setup_lane2.sh). The two megatron-cores keep the common state in different places
(common.pt against a "common_state" object inside the shards); users upgrade mid-run, so each reads both.

DP=2 with the distributed optimizer (dp_reshardable, whose buffer layout is what would differ first):
a job stopped at K on one lane and resumed on the other prints the losses of a job that ran straight
through. Runs in the second lane's tier, which has both venvs at hand (the first lane's is built first).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    from tests import launch
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

pytestmark = [pytest.mark.slow, pytest.mark.compat]

N, K = 6, 4
ARGS = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--use-distributed-optimizer", "--train-iters", str(N),
        "--save-interval", str(K)]
SECOND_LANE = sys.version_info >= (3, 12)


def _first_lane_python() -> Path:
    return Path(os.environ.get("RESIL_VENV", launch.REPO / ".venv")) / "bin" / "python"


@pytest.fixture(scope="module")
def pythons() -> dict[str, str]:
    if not SECOND_LANE:
        pytest.skip("runs in the second lane's tier (scripts/test_lane2.sh), which has both lanes' venvs")
    first = _first_lane_python()
    if not first.exists():
        pytest.skip(f"no first-lane venv at {first} (scripts/setup_env.sh builds it)")
    return {"first": str(first), "second": sys.executable}


def _run(python: str, save: Path, *extra: str) -> str:
    env = {**launch.env(), "PYTHONPATH": str(launch.REPO)}
    result = subprocess.run([python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                             "--nproc-per-node", "2", launch.PRETRAIN, *ARGS, "--save", str(save),
                             "--load", str(save), *extra], env=env, cwd=launch.REPO, timeout=240,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert result.returncode == 0, f"{python}: run failed ({result.returncode}):\n{result.stdout[-5000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def straight_through(pythons, tmp_path_factory) -> dict[int, tuple[str, str]]:
    return launch.losses(_run(pythons["second"], tmp_path_factory.mktemp("straight")))


@pytest.mark.parametrize(("writer", "reader"), [("first", "second"), ("second", "first")])
def test_a_checkpoint_resumes_exactly_on_the_other_lane(pythons, straight_through, tmp_path, writer, reader):
    save = tmp_path / "ckpt"
    stopped = _run(pythons[writer], save, "--exit-interval", str(K))
    assert sorted(launch.losses(stopped)) == list(range(1, K + 1))
    resumed = _run(pythons[reader], save)
    assert f"[resil] load: accepted persistent iteration {K} " in resumed
    assert launch.losses(resumed) == {i: straight_through[i] for i in range(K + 1, N + 1)}
    # Up to K the writer's losses are the straight run's too: the lanes train alike.
    assert launch.losses(stopped) == {i: straight_through[i] for i in range(1, K + 1)}
