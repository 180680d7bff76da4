"""--dist-ckpt-strictness, as in Megatron-LM: a checkpoint saved without the linear layers' biases, resumed
by a model that has them. By default the load fails with one line and the checkpoint stays as it was; a
mode that loads around missing keys resumes, and the biases keep their initial values, said once."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

try:
    from tests import launch
except ImportError:
    import launch

pytestmark = pytest.mark.slow


def _args(save, iters: int, *extra: str) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(iters), "--save", str(save),
            "--load", str(save), "--save-interval", "2", *extra]


def _digest(directory) -> str:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()


@pytest.fixture(scope="module")
def without_bias(tmp_path_factory):
    save = tmp_path_factory.mktemp("strictness") / "ckpt"
    result = launch.run(_args(save, 4, "--disable-bias-linear"))
    assert result.returncode == 0, result.stdout[-3000:]
    return save


def test_by_default_a_model_key_the_checkpoint_lacks_fails_the_load_and_keeps_the_checkpoint(without_bias):
    before = _digest(without_bias / "iter_0000004")
    result = launch.run(_args(without_bias, 6))
    out = result.stdout
    root, codes = launch.failure_codes(out)  # no loadable checkpoint (docs/exit_codes.md): code 3
    assert result.returncode != 0 and root == 3 and codes <= {3, -15}, out[-3000:]
    said = [line for line in out.splitlines() if line.startswith("[resil] exit:")]
    assert len(said) == 1 and "does not load into this model" in said[0], out[-3000:]
    assert "Traceback" not in out.split("failed (exitcode:")[0]  # the ranks' output; torchrun's own follows
    assert _digest(without_bias / "iter_0000004") == before  # not quarantined, not touched
    assert (without_bias / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


@pytest.mark.parametrize("mode", ["log_unexpected", "return_all"])
def test_a_mode_that_loads_around_missing_keys_resumes_and_says_which_weights_kept_their_values(
        without_bias, tmp_path, mode):
    save = tmp_path / "ckpt"
    shutil.copytree(without_bias, save)
    result = launch.run(_args(save, 6, "--dist-ckpt-strictness", mode, "--no-load-optim"))
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    kept = [line for line in out.splitlines() if "keep their initial values (--dist-ckpt-strictness)" in line]
    assert len(kept) == 1 and kept[0].startswith("[resil] load: ") and ".bias" in kept[0], out[-3000:]
    # The model keys megatron-core returned under return_all are these biases: said by no other line.
    assert [line for line in out.splitlines() if "[resil]" in line and "layers.0.mlp.linear_fc2.bias" in line
            and "optimizer." not in line] == kept, out[-3000:]
    events = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines()]
    recorded = [e for e in events if e["event"] == "load" and "keep their initial values" in e["message"]]
    assert len(recorded) == 1 and all(k.endswith(".bias") for k in recorded[0]["kept"]), recorded
    assert "[resil] load: accepted persistent iteration 4" in out
    assert sorted(launch.losses(out)) == [5, 6]
