"""--use-checkpoint-args, as in Megatron-LM: a job resumed with another model on its command line builds the
checkpoint's model and trains on as the uninterrupted run did, each argument taken said once in Megatron-LM's
line. As there, a size the command line gives (--num-layers) is kept; the checkpoint then does not load. Bad
input ends in one line; a checkpoint whose saved arguments cannot be read safely is passed over."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

try:
    from tests import launch
except ImportError:
    import launch

pytestmark = pytest.mark.slow

# The model saved: launch.TINY_MODEL's sizes, with RMSNorm, SwiGLU and untied output weights.
SAVED_MODEL = [*launch.TINY_MODEL, "--normalization", "RMSNorm", "--swiglu",
               "--untie-embeddings-and-output-weights"]
TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
# What the resuming command line says instead: no sizes, and another norm, attention and position embedding
# (grouped-query attention changes the shape of every attention weight).
OTHER_MODEL = [*TOKENIZER, "--normalization", "LayerNorm", "--group-query-attention",
               "--num-query-groups", "2", "--position-embedding-type", "rope"]


def _args(save, model: list[str], *extra: str) -> list[str]:
    return [*model, *launch.TINY_TRAINING, "--train-iters", "6", "--save", str(save), "--load", str(save),
            "--save-interval", "2", *extra]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Six iterations of the saved model, checkpoints at 2, 4 and 6, and the losses it printed."""
    save = tmp_path_factory.mktemp("use_checkpoint_args") / "ckpt"
    result = launch.run(_args(save, SAVED_MODEL))
    assert result.returncode == 0, result.stdout[-3000:]
    return save, launch.losses(result.stdout)


def _stopped_at_4(uninterrupted, tmp_path):
    """The same job as if it had stopped after saving iteration 4."""
    save = tmp_path / "ckpt"
    shutil.copytree(uninterrupted[0], save)
    shutil.rmtree(save / "iter_0000006")
    (save / "latest_checkpointed_iteration.txt").write_text("4\n")
    return save


def _lines(out: str, prefix: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(prefix)]


@pytest.mark.compat  # megatron-core 0.19 keeps the saved arguments inside the shards, not in common.pt
def test_resumed_with_another_model_it_builds_the_checkpoints_and_trains_on_exactly(uninterrupted, tmp_path):
    save = _stopped_at_4(uninterrupted, tmp_path)
    result = launch.run(_args(save, OTHER_MODEL, "--use-checkpoint-args"))
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    for taken in ("num_layers to 2", "hidden_size to 64", "seq_length to 32", "normalization to RMSNorm",
                  "swiglu to True", "group_query_attention to False", "num_query_groups to 4",
                  "position_embedding_type to learned_absolute",
                  "untie_embeddings_and_output_weights to True"):
        assert len(_lines(out, f"Setting {taken} from checkpoint")) == 1, out[-4000:]  # rank 0, once
    said = _lines(out, "[resil] checkpoint args:")
    assert len(said) == 1 and f"{save}/iter_0000004 (iteration 4)" in said[0], out[-4000:]
    for replaced in ("normalization (LayerNorm -> RMSNorm)", "group_query_attention (True -> False)",
                     "position_embedding_type (rope -> learned_absolute)", "swiglu (False -> True)"):
        assert replaced in said[0], said
    assert "[resil] load: accepted persistent iteration 4" in out
    assert launch.losses(out) == {i: uninterrupted[1][i] for i in (5, 6)}  # as if never stopped


def test_a_size_the_command_line_gives_is_kept_as_in_megatron_lm_and_the_checkpoint_does_not_load(
        uninterrupted, tmp_path):
    save = _stopped_at_4(uninterrupted, tmp_path)
    result = launch.run(_args(save, [*OTHER_MODEL, "--num-layers", "3"], "--use-checkpoint-args"))
    out = result.stdout
    assert "Setting num_layers" not in out and "Setting hidden_size to 64 from checkpoint" in out, out[-4000:]
    root, codes = launch.failure_codes(out)  # no loadable checkpoint (docs/exit_codes.md): code 3
    assert result.returncode != 0 and root == 3 and codes <= {3, -15}, out[-3000:]
    said = _lines(out, "[resil] exit:")
    assert len(said) == 1 and "does not load into this model" in said[0], out[-3000:]


def _check_args(*args: str, world_size: int = 2) -> subprocess.CompletedProcess:
    """pretrain.py --check-args-only, as rank 0 of `world_size` (no torchrun: arguments come first)."""
    env = {**launch.env(), "WORLD_SIZE": str(world_size), "RANK": "0"}
    command = [sys.executable, launch.PRETRAIN, *args, *launch.TINY_TRAINING, "--train-iters", "6",
               "--check-args-only"]
    return subprocess.run(command, env=env, cwd=launch.REPO, capture_output=True, text=True, timeout=120)


def test_parallel_sizes_come_from_the_checkpoint_only_with_use_mp_args_from_checkpoint_args(uninterrupted):
    load = ["--load", str(uninterrupted[0]), "--use-checkpoint-args", "--tensor-model-parallel-size", "2"]
    kept = _check_args(*TOKENIZER, *load)
    assert kept.returncode == 0 and "arguments are valid" in kept.stdout, kept.stdout + kept.stderr
    assert "tensor_model_parallel_size" not in kept.stdout
    taken = _check_args(*TOKENIZER, *load, "--use-mp-args-from-checkpoint-args")
    assert taken.returncode == 0, taken.stdout + taken.stderr
    assert "Setting tensor_model_parallel_size to 1 from checkpoint" in taken.stdout.splitlines()
    assert "tensor_model_parallel_size (2 -> 1)" in taken.stdout


def test_without_load_it_is_refused_naming_the_flag():
    result = launch.run_single([*TOKENIZER, "--use-checkpoint-args"])
    assert result.returncode == 2
    said = "pretrain.py: error: --use-checkpoint-args needs --load DIR: the checkpoint whose model arguments"
    assert result.stderr.strip().splitlines() == [f"{said} it takes"]


def test_with_a_node_local_tier_it_is_refused_as_in_megatron_lm(tmp_path):
    result = launch.run_single([*launch.TINY_MODEL, "--load", str(tmp_path), "--use-checkpoint-args",
                                "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir",
                                str(tmp_path / "local")])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--use-checkpoint-args cannot be used with --non-persistent-ckpt-type local" \
        in lines[0], result.stderr


def test_no_checkpoint_under_load_keeps_the_command_line_as_megatron_lm_does(tmp_path):
    result = _check_args(*launch.TINY_MODEL, "--load", str(tmp_path), "--use-checkpoint-args")
    assert result.returncode == 0, result.stdout + result.stderr
    said = "Checkpoint not found to provide arguments, using provided arguments."  # Megatron-LM's line
    assert said in result.stdout.splitlines()
    assert "arguments are valid" in result.stdout


def test_no_checkpoint_under_load_and_no_sizes_given_is_one_line_naming_the_flag(tmp_path):
    result = _check_args(*TOKENIZER, "--load", str(tmp_path), "--use-checkpoint-args")
    assert result.returncode == 2
    said = "pretrain.py: error: --num-layers is required: --use-checkpoint-args has nothing to take it from"
    assert result.stderr.strip().splitlines() == [f"{said} (no checkpoint under --load {tmp_path})"]


@pytest.mark.compat
def test_saved_arguments_that_would_run_code_are_refused_and_the_previous_checkpoints_are_taken(
        uninterrupted, tmp_path):
    from tests.test_safe_load import _plant_in_common

    save = tmp_path / "ckpt"
    shutil.copytree(uninterrupted[0], save)
    marker = tmp_path / "ran"
    file = _plant_in_common(save / "iter_0000006", marker)
    os.remove(save / "iter_0000006" / "resil_manifest.json")  # or its sizes alone would reject it
    result = _check_args(*TOKENIZER, "--load", str(save), "--use-checkpoint-args")
    assert result.returncode == 0, result.stdout + result.stderr
    passed = _lines(result.stdout, "[resil] checkpoint args: passed over")
    assert len(passed) == 1 and file in passed[0] and "posix.system" in passed[0], result.stdout
    assert f"model arguments from {save}/iter_0000004 (iteration 4)" in result.stdout
    assert "Setting normalization to RMSNorm from checkpoint" in result.stdout.splitlines()
    assert not marker.exists()
