"""A checkpoint's saved arguments are data (--use-checkpoint-args): nothing in them is evaluated, every size
is bounded and checked against what the checkpoint records of its tensors before anything is allocated, a
tokenizer directory that would run code is never taken from them, and the `replaced:` line lists every
value they changed. Each case is a real checkpoint on disk (megatron-resil 0.1's, tests/data) whose
common.pt an attacker rewrote, manifest included; its arguments are parsed as pretrain.py parses them."""

from __future__ import annotations

import argparse
import json
import pickle
import re
import resource
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import launch

V0_1 = launch.REPO / "tests" / "data" / "checkpoint_v0_1" / "iter_0000002"
TRAINING = ["--micro-batch-size", "1", "--lr", "1e-3", "--mock-data", "--train-iters", "2"]
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "32"]
MOE = {"num_experts": 4, "add_bias_linear": False}
# The patterns of finding 4: parsing spun until killed, an OverflowError traceback, 8 GB per rank.
SPINS, OVERFLOWS, ALLOCATES = "[0]*9**9**9**9", "[0]*99**99", "[0]*10**9"


def _saved(**changes) -> argparse.Namespace:
    """The checkpoint's own saved arguments (1 layer, hidden size 16, 2 heads), with `changes`."""
    import torch

    common = torch.load(V0_1 / "common.pt", weights_only=False)  # the test's own, trusted copy
    return argparse.Namespace(**{**common["args"], **changes})


def _crafted(root: Path, args, metadata=None) -> Path:
    """A checkpoint directory `root` (tracker naming iteration 2) whose common.pt saves `args` (and whose
    .metadata is `metadata`, when given), with its manifest written over them: whoever can write a
    checkpoint can write its checksums too."""
    import torch

    from megatron_resil.checkpointing.manifest import write_manifest

    ckpt = root / "iter_0000002"
    shutil.copytree(V0_1, ckpt)
    (root / "latest_checkpointed_iteration.txt").write_text("2\n")
    common = torch.load(ckpt / "common.pt", weights_only=False)
    common["args"] = args
    torch.save(common, ckpt / "common.pt")
    if metadata is not None:
        with open(ckpt / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
    write_manifest(str(ckpt), 2, "torch_dist")
    return root


def _argv(load: Path, *extra: str) -> list[str]:
    return [*NULL_TOKENIZER, *TRAINING, "--load", str(load), "--use-checkpoint-args", *extra]


def _refused(argv: list[str], capsys) -> str:
    """pretrain.py's argument parsing, in this process: the one line it ends with (exit code 2)."""
    from megatron_resil.arguments import parse_args
    from megatron_resil.checkpointing.saved_args import take_from_checkpoint

    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        parse_args(argv, world_size=1, saved_args=take_from_checkpoint)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("pretrain.py: error: "), err
    return lines[0]


def test_a_layer_pattern_saved_as_text_is_refused_in_one_line_without_being_read(tmp_path, capsys):
    """Megatron-LM saves --moe-layer-freq parsed (N or a list); text is only ever refused. (The pattern that
    spun and the one that allocated are the standby's test below, in a process of their own.)"""
    load = _crafted(tmp_path / "ckpt", _saved(**MOE, moe_layer_freq=OVERFLOWS))
    line = _refused(_argv(load), capsys)
    assert "moe_layer_freq=" in line and "which is no value of --moe-layer-freq" in line, line
    assert f"{load}/iter_0000002" in line


def test_saved_arguments_that_are_no_namespace_are_refused_in_one_line(tmp_path, capsys):
    load = _crafted(tmp_path / "ckpt", 5)
    line = _refused(_argv(load), capsys)
    assert "holds saved arguments that are 5, not the Namespace Megatron-LM saves" in line, line


@pytest.mark.parametrize("saved, said", [
    # ZeroDivisionError in model.py before
    ({"group_query_attention": True, "num_query_groups": 0}, "num_query_groups=0, which --num-query-groups"),
    ({"kv_channels": 0}, "kv_channels=0, which --kv-channels"),
    ({"num_experts": 0}, "num_experts=0, which --num-experts"),
    ({"moe_router_topk": 0}, "moe_router_topk=0, which --moe-router-topk"),
    ({"num_layers": -2}, "num_layers=-2, which --num-layers"),
    # the 64 GiB allocation of finding 5
    ({**MOE, "moe_ffn_hidden_size": 2 ** 28}, f"moe_ffn_hidden_size={2 ** 28}, which --moe-ffn-hidden-size"),
    ({"num_attention_heads": 2 ** 80}, "num_attention_heads=an integer of 81 bits, which is no value of "
                                       "--num-attention-heads"),
], ids=["query-groups-0", "kv-channels-0", "experts-0", "topk-0", "layers-negative", "expert-ffn-2^28",
        "heads-2^80"])
def test_a_saved_size_out_of_bounds_is_refused_naming_it(tmp_path, capsys, saved, said):
    load = _crafted(tmp_path / "ckpt", _saved(**saved))
    line = _refused(_argv(load), capsys)
    assert f"{load}/iter_0000002 (iteration 2) holds {said}" in line, line
    assert line.endswith("drop --use-checkpoint-args"), line


def _with_declared(size: tuple[int, ...]):
    """The checkpoint's .metadata, with the word embeddings declared `size`: what a crafted one could say."""
    import torch

    with open(V0_1 / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own, trusted copy
    metadata.state_dict_metadata["embedding.word_embeddings.weight"].size = torch.Size(size)
    return metadata


@pytest.mark.parametrize("case", ["sizes", "metadata-claims-more-than-the-files-hold"])
def test_a_model_larger_than_the_checkpoint_records_is_refused_before_anything_is_allocated(
        tmp_path, capsys, case):
    """64 experts of hidden size 2^20 are within every size's bound, but 2^31 parameters do not fit in a
    checkpoint whose .metadata declares 12,240 elements; nor in one whose .metadata claims 2^44 while its
    files hold 0.2 MB."""
    metadata = _with_declared((2 ** 40, 16)) if case != "sizes" else None
    load = _crafted(tmp_path / "ckpt", _saved(num_experts=64, moe_ffn_hidden_size=2 ** 20,
                                              add_bias_linear=False), metadata)
    line = _refused(_argv(load), capsys)
    assert "describe at least 2,147," in line and "(experts: 1 MoE layer(s) x num_experts 64" in line, line
    said = "but its .metadata declares tensors of 12,240 elements;" if case == "sizes" else \
        "but its files hold 186,738 bytes (its .metadata claims tensors of 17,592,186,056,016 elements);"
    assert said in line and "refused before building the model" in line, line


def test_every_megatron_lm_checkpoint_here_fits_what_it_records():
    """No false refusal: the model each Megatron-LM checkpoint's own arguments describe (MoE with expert
    parallelism, tensor and pipeline parallel, the distributed optimizer) fits in what it records."""
    from megatron_resil import patches
    from megatron_resil.arguments import build_parser
    from megatron_resil.arguments.sizes import least_parameters
    from megatron_resil.checkpointing.recorded_size import recorded_elements
    from megatron_resil.checkpointing.safe_load import CommonLoadWeightsOnly

    patches.install()  # megatron-core 0.19's layout keeps the saved arguments in the shards
    defaults = vars(build_parser().parse_args([]))
    found = sorted((launch.REPO / "tests" / "data" / "megatron_lm_checkpoints").glob("*/checkpoint/iter_*"))
    assert len(found) == 4
    for ckpt in found:
        saved = vars(CommonLoadWeightsOnly().load_common(str(ckpt))["args"])
        args = argparse.Namespace(**{**defaults, **{k: v for k, v in saved.items() if k in defaults}})
        least = sum(count for count, _ in least_parameters(args))
        recorded, _ = recorded_elements(str(ckpt))
        assert 0 < least <= recorded, (ckpt, least, recorded)


def test_the_replaced_line_lists_every_value_the_checkpoint_changed(tmp_path, capsys):
    from megatron_resil.arguments import parse_args
    from megatron_resil.checkpointing.saved_args import take_from_checkpoint

    load = _crafted(tmp_path / "ckpt", _saved())
    args = parse_args(_argv(load, "--num-query-groups", "1"), world_size=1,
                      saved_args=take_from_checkpoint)
    (said,) = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("[resil] checkpoint args: model arguments from")]
    for replaced in ("num_layers (None -> 1)", "hidden_size (None -> 16)", "kv_channels (None -> 8)",
                     "max_position_embeddings (None -> 8)", "num_query_groups (1 -> 2)"):
        assert replaced in said, said
    assert (args.num_layers, args.kv_channels) == (1, 8)


@pytest.fixture
def tokenizer_dirs(tmp_path):
    """A plain Hugging Face tokenizer directory (the user's), and one that ships code: loading it under
    trust_remote_code imports its module, which leaves a marker."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    mine = tmp_path / "my_tokenizer"
    vocab = {"<eos>": 0, "<unk>": 1, "a": 2}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>",
                                         unk_token="<unk>").save_pretrained(str(mine))
    shipped = tmp_path / "shipped_tokenizer"  # beside the checkpoint, as a crafted one would ship it
    shipped.mkdir()
    marker = tmp_path / "code_ran"
    (shipped / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["shipped.ShippedTokenizer", None]},
         "tokenizer_class": "ShippedTokenizer"}))
    (shipped / "shipped.py").write_text(textwrap.dedent(f"""\
        import pathlib
        pathlib.Path({str(marker)!r}).touch()
        from transformers import PreTrainedTokenizer
        class ShippedTokenizer(PreTrainedTokenizer):
            pass
        """))
    return mine, marker


def test_under_trust_remote_code_the_tokenizer_directory_is_never_taken_from_the_checkpoint(
        tmp_path, capsys, monkeypatch, tokenizer_dirs):
    from megatron_resil.arguments import parse_args
    from megatron_resil.checkpointing.saved_args import take_from_checkpoint

    mine, marker = tokenizer_dirs
    monkeypatch.chdir(tmp_path)  # the saved path is relative: it resolves beside the checkpoint
    load = _crafted(tmp_path / "ckpt", _saved(tokenizer_type="HuggingFaceTokenizer",
                                              tokenizer_model="shipped_tokenizer"))
    args = parse_args([*TRAINING, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(mine),
                       "--trust-remote-code", "--load", str(load), "--use-checkpoint-args"], world_size=1,
                      saved_args=take_from_checkpoint)
    assert not marker.exists()
    assert args.tokenizer_model == str(mine) and args.tokenizer_type == "HuggingFaceTokenizer"
    said = [line for line in capsys.readouterr().out.splitlines() if "--tokenizer-model" in line]
    assert said == [f"[resil] checkpoint args: kept the command line's --tokenizer-model {mine}, not "
                    f"'shipped_tokenizer' from {load}/iter_0000002 (iteration 2): under --trust-remote-code "
                    "the tokenizer directory decides what code runs, and that is never taken from a "
                    "checkpoint"]


_STANDBY_READS_AHEAD = """
import json, os, sys
from megatron_resil.launch import standby_warmup
results = []
for load in sys.argv[1:]:
    request = {"argv": ["pretrain.py", *ARGV, "--load", load, "--use-checkpoint-args"],
               "env": dict(os.environ), "cwd": os.getcwd()}
    results.append(standby_warmup._parse(request) == (None, None))
print(json.dumps(results))
"""


def test_the_standby_reading_a_ranks_arguments_ahead_refuses_pattern_text_at_once(tmp_path):
    """The launcher's standby parses a rank's command line before forking it (standby_warmup.py), checkpoint
    arguments included: text that spun parsing forever, overflowed, or allocated 8 GB per rank ends that
    parse at once, refused, and the standby serves on. Under an address-space limit, so that nothing here
    could take the machine's memory."""
    loads = [str(_crafted(tmp_path / name, _saved(**MOE, moe_layer_freq=pattern)))
             for name, pattern in (("spins", SPINS), ("overflows", OVERFLOWS), ("allocates", ALLOCATES))]
    script = f"ARGV = {NULL_TOKENIZER + TRAINING!r}\n{_STANDBY_READS_AHEAD}"

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    result = subprocess.run([sys.executable, "-c", script, *loads], env=launch.env(standby=False),
                            cwd=launch.REPO, capture_output=True, text=True, timeout=180, preexec_fn=limited)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [True, True, True], result.stdout


@pytest.mark.slow
def test_a_run_whose_checkpoint_asks_for_64_gib_of_experts_stops_in_one_line(tmp_path):
    """Finding 5's case at a real start: torchrun, one rank, under an address-space limit of 6 GiB (a
    64 GiB allocation attempt would fail with a traceback instead of taking the machine)."""
    load = _crafted(tmp_path / "ckpt", _saved(**MOE, moe_ffn_hidden_size=2 ** 28))

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    result = subprocess.run(launch.torchrun_cmd(_argv(load), nproc=1), env=launch.env(standby=False),
                            cwd=launch.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=240, preexec_fn=limited)
    out = result.stdout
    rank = out.partition(" failed (exitcode: ")[0]  # what torchrun adds after (its own traceback) aside
    errors = [line for line in rank.splitlines() if line.startswith("pretrain.py: error:")]
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", out)) == {"2"}, out[-3000:]
    assert "Traceback" not in rank, rank[-3000:]
    assert errors == [f"pretrain.py: error: {load}/iter_0000002 (iteration 2) holds moe_ffn_hidden_size="
                      f"{2 ** 28}, which --moe-ffn-hidden-size cannot be: it is more than any model has (at "
                      "most 4194304); drop --use-checkpoint-args"], out[-3000:]
