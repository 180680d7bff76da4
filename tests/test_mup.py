"""MuP (--use-mup, --mup-base-hidden-size, ...) as Megatron-LM wires it on megatron-core 0.19: the
TransformerConfig scales the initialization, the attention and the logits by the width multiplier
(hidden size / base hidden size), and the optimizer's parameter groups for the hidden matrices take the
learning rate and Adam's epsilon divided by it. A MuP run trains, its checkpoint holds those groups and
that initialization, and a run resumed from it continues exactly. megatron-core 0.16 has no MuP: the first
lane refuses the flag in one line naming megatron-core.
"""

from __future__ import annotations

import importlib.metadata
import shutil

import pytest

try:
    from tests import launch  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

from megatron_resil.arguments import parse_args
from megatron_resil.arguments.flag_table import config_fields

HAS_MUP = "use_mup" in config_fields("TransformerConfig")
needs_mup = pytest.mark.skipif(not HAS_MUP, reason="the installed megatron-core's TransformerConfig has no "
                                                   "use_mup (MuP came with megatron-core 0.19)")
# TINY_MODEL is 64 wide with 4 heads (kv-channels 16): a base of 16 is a width multiplier of 4.
MUP = ["--use-mup", "--mup-base-hidden-size", "16"]
_BASE = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--global-batch-size", "4", "--train-iters", "4"]


@pytest.mark.skipif(HAS_MUP, reason="the installed megatron-core has MuP")
def test_a_megatron_core_without_mup_refuses_the_flag_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args([*_BASE, *MUP], world_size=1)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "pretrain.py: error: --use-mup needs a megatron-core whose TransformerConfig has use_mup (installed: "
        f"megatron-core {importlib.metadata.version('megatron-core')}); drop the flag or upgrade"), lines


@needs_mup
def test_the_config_scales_attention_and_logits_by_the_width():
    from megatron_resil.model import transformer_config

    config = transformer_config(parse_args([*_BASE, *MUP], world_size=1))
    assert config.use_mup and config.mup_width_mult == 4.0
    assert config.mup_output_mult == pytest.approx(1 / 4)  # logits x 1 / width multiplier
    assert config.softmax_scale == pytest.approx(1 / 16)  # 1 / kv-channels, not 1 / sqrt(kv-channels)
    plain = transformer_config(parse_args(_BASE, world_size=1))
    assert not plain.use_mup and plain.softmax_scale is None


def _run_ok(args: list[str]) -> str:
    result = launch.run(args, nproc=1)
    assert result.returncode == 0, f"run failed ({result.returncode}):\n{result.stdout[-6000:]}"
    return result.stdout


def _std(tensors: dict, name: str) -> float:
    return float(tensors[name].float().std())


@needs_mup
@pytest.mark.slow
@pytest.mark.compat
def test_a_mup_run_scales_its_groups_and_init_and_resumes_exactly(tmp_path):
    """One rank, 4 iterations saving every 2; the twin resumes from a copy of iteration 2."""
    from megatron_resil import patches
    from megatron_resil.checkpointing.safe_load import CommonLoadWeightsOnly
    from tests.test_resume import TRACKER, _assert_checkpoints_identical, _dcp_state, _iter_dir

    common = [*_BASE, *MUP, "--save-interval", "2"]
    whole, twin = tmp_path / "whole", tmp_path / "twin"
    whole_out = _run_ok([*common, "--save", str(whole)])
    twin.mkdir()
    shutil.copytree(_iter_dir(whole, 2), _iter_dir(twin, 2))
    (twin / TRACKER).write_text("2\n")
    resumed_out = _run_ok([*common, "--save", str(twin), "--load", str(twin)])

    patches.install(quiet=True)  # megatron-core 0.19 reads the common state through DCP, as pretrain.py
    groups = CommonLoadWeightsOnly().load_common(_iter_dir(whole, 4))["optimizer"]["param_groups"]
    # megatron-core's standard groups keep --lr 1e-3 and --adam-eps 1e-8 (the logged rate is theirs); MuP's
    # group of hidden matrices has both divided by the width multiplier.
    scaled = [g for g in groups if not g["default_config"]]
    assert len(scaled) == 1, groups
    assert (scaled[0]["max_lr"], scaled[0]["min_lr"], scaled[0]["eps"]) == \
        pytest.approx((1e-3 / 4, 1e-4 / 4, 1e-8 / 4))
    standard = {(g["max_lr"], g["min_lr"], g["eps"]) for g in groups if g["default_config"]}
    assert standard == {(1e-3, 1e-4, 1e-8)}
    # The initialization, two small steps later: hidden matrices at --init-method-std / sqrt(4), the
    # output projections also / sqrt(2 x layers), the embeddings unscaled.
    weights = _dcp_state(_iter_dir(whole, 2), tmp_path / "iter2.pt")
    assert _std(weights, "decoder.layers.mlp.linear_fc1.weight") == pytest.approx(0.02 / 2, rel=0.1)
    assert _std(weights, "decoder.layers.mlp.linear_fc2.weight") == pytest.approx(0.02 / 2 / 2, rel=0.1)
    assert _std(weights, "embedding.word_embeddings.weight") == pytest.approx(0.02, rel=0.1)

    whole_losses, resumed = launch.losses(whole_out), launch.losses(resumed_out)
    assert sorted(whole_losses) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert {i: whole_losses[i] for i in resumed} == resumed
    _assert_checkpoints_identical(_iter_dir(whole, 4), _iter_dir(twin, 4), tmp_path / "scratch")
