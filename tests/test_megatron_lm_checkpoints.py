"""Checkpoints written by Megatron-LM's own `save_checkpoint` resume here exactly.

tests/data/megatron_lm_checkpoints holds, per layout (TP 2 and PP 2 with the distributed optimizer, an MoE
with EP 2; 2 ranks each), a checkpoint Megatron-LM's code wrote at iteration 2 (make.py ran it outside
CI; made_by.json names the commit) and what each of its ranks held when it saved. The MoE is there twice,
in the two ways Megatron-LM keeps RNG states under expert parallelism: per (pipeline, tensor,
data-parallel) rank by core_v0.16.1 (`ep2_moe`), per (pipeline, tensor) rank by main (`ep2_moe_main`),
whose rank 1 must get back its own expert-parallel stream, not rank 0's. For each:
- megatron-resil's loader reads it and every tensor a resume depends on equals what Megatron-LM held:
  the weights, the distributed optimizer's main parameters and Adam state, the LR scheduler, the RNG
  states, the iteration and the consumed samples;
- pretrain.py resumes it at iteration 2, and its losses and grad norms at 3 and 4 are, to the printed
  digits, those of our uninterrupted run whose iteration-2 checkpoint Megatron-LM's save started from.
The other direction (Megatron-LM's `load_checkpoint` reading ours) is recorded in made_by.json by make.py:
Megatron-LM's code is not imported here.
"""

from __future__ import annotations

import importlib.metadata
import json
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

pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data" / "megatron_lm_checkpoints"
MADE_BY = json.loads((DATA / "made_by.json").read_text())
MAIN = f"{MADE_BY['main_commit']['ref']} ({MADE_BY['main_commit']['sha'][:12]})"
# Megatron-LM main's saved arguments hold megatron.core.transformer.enums.InferenceCudaGraphScope, which
# megatron-core 0.16 does not have: the first lane reads it as a placeholder and says so (safe_load.py).
# That case is marked compat too: the second lane's tier reads it with the class present.
FIRST_LANE = importlib.metadata.version("megatron-core").startswith("0.16.")


def _flags(layout: str) -> list[str]:
    return [*MADE_BY["model_flags"], *MADE_BY["training_flags"], *MADE_BY["layouts"][layout]["flags"]]


def _sizes(flags: list[str]) -> tuple[int, int]:
    def size(name: str) -> int:
        return int(flags[flags.index(name) + 1]) if name in flags else 1
    return size("--tensor-model-parallel-size"), size("--pipeline-model-parallel-size")


def _copy(tmp_path: Path, layout: str) -> Path:
    load = tmp_path / "megatron_lm"
    shutil.copytree(DATA / layout / "checkpoint", load)
    return load


def _saved_by_main(layout: str) -> bool:
    return MADE_BY["layouts"][layout].get("saved_by") == MAIN


@pytest.mark.parametrize("layout", [
    pytest.param(name, marks=[pytest.mark.compat] if _saved_by_main(name) else [])
    for name in sorted(MADE_BY["layouts"])])
def test_megatron_lms_checkpoint_loads_every_tensor_it_saved_and_resumes_where_it_left_off(tmp_path, layout):
    load, flags, saved_at = _copy(tmp_path, layout), _flags(layout), MADE_BY["saved_at"]

    compared = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
         "2", str(DATA / "engine_state.py"), *flags, "--load", str(load), "--reference",
         str(DATA / layout / "reference")],
        env=launch.env(), cwd=launch.REPO, timeout=300, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    # The ranks print at once: their lines may run together.
    verdicts = dict(re.findall(r"\[state\] rank (\d): \d+ tensors, (all equal|\d+ differ)", compared.stdout))
    assert compared.returncode == 0 and verdicts == {"0": "all equal", "1": "all equal"}, \
        compared.stdout[-5000:]

    resumed = launch.run([*flags, "--load", str(load)], timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    tp, pp = _sizes(flags)
    assert f"{load / f'iter_{saved_at:07d}'} has no manifest: saved by Megatron-LM" in resumed.stdout
    assert (f"successfully loaded checkpoint from {load} [ t 1/{tp}, p 1/{pp} ] at iteration {saved_at} "
            in resumed.stdout), resumed.stdout[-3000:]
    if FIRST_LANE and _saved_by_main(layout):
        assert "names megatron.core.transformer.enums.InferenceCudaGraphScope, which megatron-core 0.16" \
            in resumed.stdout, resumed.stdout[-3000:]
    losses = {str(it): list(printed) for it, printed in launch.losses(resumed.stdout).items()}
    assert losses == MADE_BY["layouts"][layout]["losses_after_save"]


def test_the_two_ep2_checkpoints_hold_megatron_lms_two_rng_layouts():
    """What the ep2 cases stand for: core_v0.16.1 keyed its RNG states by (pipeline, tensor, data-parallel)
    rank, main by (pipeline, tensor) rank, in the item names of DCP's .metadata."""
    def rng_keys(layout: str) -> set[bytes]:
        checkpoint = DATA / layout / "checkpoint" / f"iter_{MADE_BY['saved_at']:07d}"
        metadata = (checkpoint / ".metadata").read_bytes()
        return set(re.findall(rb"rng_state/shard_[0-9._]+", metadata))

    assert not _saved_by_main("ep2_moe") and _saved_by_main("ep2_moe_main")
    assert rng_keys("ep2_moe") == {b"rng_state/shard_0.0.0_1.1.2", b"rng_state/shard_0.0.1_1.1.2"}
    assert rng_keys("ep2_moe_main") == {b"rng_state/shard_0.0_1.1"}
