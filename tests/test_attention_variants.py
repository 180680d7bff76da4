"""Megatron-LM's experimental attention variants: gated delta net (gpt3_mcore_te_tp2_pp1_gdn and its four
siblings) and DeepSeek sparse attention (gpt3_mcore_te_tp2_pp2_dsa).

Neither runs on CPU: megatron-core builds both from Transformer Engine's layers only, gated delta net needs
flash-linear-attention's Triton kernels and sparse attention fast-hadamard-transform's CUDA kernel. So on this
machine a run is refused in one line naming what is missing; as on a GPU host with those packages (faked
below, as the coverage benchmark does), Megatron-LM's own command lines are accepted and their flags reach
megatron-core's TransformerConfig with Megatron-LM's meaning. The layers themselves are not built here (not
tested on GPU either: the GPU machine we borrow has no Transformer Engine).
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_resil import arguments
from megatron_resil.arguments import attention_variants, flag_table, parse_args

try:
    from tests import launch  # tests/ is a package
except ImportError:  # tests/ on sys.path instead
    import launch

_refused = launch.refused_line

REPO = Path(__file__).resolve().parents[1]
CORE = tuple(int(p) for p in importlib.metadata.version("megatron-core").split(".")[:2])

# tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp2_pp1_gdn/model_config.yaml (Megatron-LM d98e8a6):
# its model and parallel flags as they are; data, logging and checkpointing stood in for.
GDN_CONFIG = [
    "--untie-embeddings-and-output-weights", "--num-layers", "6", "--hidden-size", "512",
    "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2", "--swiglu",
    "--position-embedding-type", "rope", "--rotary-percent", "0.5", "--no-rope-fusion",
    "--apply-layernorm-1p", "--apply-wd-to-qk-layernorm", "--attention-output-gate",
    "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "3",
    "--linear-conv-kernel-dim", "4", "--linear-key-head-dim", "64", "--linear-value-head-dim", "64",
    "--linear-num-key-heads", "4", "--linear-num-value-heads", "8",
    "--num-experts", "32", "--moe-ffn-hidden-size", "64", "--moe-shared-expert-intermediate-size", "64",
    "--moe-shared-expert-gate", "--moe-router-load-balancing-type", "aux_loss", "--moe-router-topk", "8",
    "--disable-bias-linear", "--moe-router-dtype", "fp32",
    "--micro-batch-size", "4", "--global-batch-size", "32", "--seq-length", "1024",
    "--max-position-embeddings", "1024", "--train-iters", "50", "--lr", "0.00015", "--min-lr", "1.0e-5",
    "--lr-decay-style", "cosine", "--transformer-impl", "transformer_engine",
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--sequence-parallel",
    "--deterministic-mode", "--no-gradient-accumulation-fusion", "--attention-softmax-in-fp32", "--bf16",
    "--attention-backend", "unfused",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
]
# .../gpt3_mcore_te_tp2_pp2_dsa/model_config.yaml, the same way.
DSA_CONFIG = [
    "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--multi-latent-attention",
    "--q-lora-rank", "192", "--kv-lora-rank", "64", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
    "--v-head-dim", "16", "--experimental-attention-variant", "dsa", "--disable-bias-linear",
    "--dsa-indexer-n-heads", "64", "--dsa-indexer-head-dim", "128", "--dsa-indexer-topk", "2048",
    "--dsa-indexer-loss-coeff", "0.01", "--attention-backend", "fused",
    "--micro-batch-size", "4", "--global-batch-size", "32", "--seq-length", "1024",
    "--max-position-embeddings", "1024", "--train-iters", "50", "--lr", "0.00015",
    "--transformer-impl", "transformer_engine", "--tensor-model-parallel-size", "2",
    "--pipeline-model-parallel-size", "2", "--sequence-parallel", "--untie-embeddings-and-output-weights",
    "--deterministic-mode", "--no-gradient-accumulation-fusion", "--attention-softmax-in-fp32", "--bf16",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
]
TINY = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "4"]


def _gpu_host(monkeypatch, packages: set[str]) -> None:
    """Validation as a GPU host with Transformer Engine and the kernel packages named would answer."""
    for module in (arguments, arguments.model, arguments.distributed, arguments.device,
                   arguments.gpu_features, attention_variants):
        for attr in ("cuda_available", "transformer_engine_available"):
            if hasattr(module, attr):
                monkeypatch.setattr(module, attr, lambda: True)
    monkeypatch.setattr(attention_variants, "package_available", lambda module: module in packages)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU behaviour")
def test_on_cpu_each_variant_is_refused_in_one_line_naming_what_is_missing(tmp_path, capsys):
    """pretrain.py itself, as a user starts it: exit 2, one line, no traceback."""
    def check_args(*variant: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "pretrain.py"), *TINY, *variant,
                               "--check-args-only"], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, env={**launch.env(standby=False), "WORLD_SIZE": "1"})

    gdn = check_args("--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2")
    assert gdn.returncode == 2 and len(gdn.stderr.splitlines()) == 1, gdn.stderr
    assert gdn.stderr.startswith("pretrain.py: error: --experimental-attention-variant gated_delta_net runs "
                                 "on GPU only"), gdn.stderr
    assert "missing here: CUDA, transformer-engine, flash-linear-attention" in gdn.stderr
    # Multi-latent attention, which sparse attention is built on, is itself refused first on CPU.
    assert "--multi-latent-attention needs --transformer-impl transformer_engine (GPU)" in _refused(
        [*TINY, "--experimental-attention-variant", "dsa", "--multi-latent-attention"], capsys)
    dsa = check_args("--experimental-attention-variant", "dsa")
    assert dsa.returncode == 2 and len(dsa.stderr.splitlines()) == 1, dsa.stderr
    if CORE < attention_variants.DSA_SINCE:
        assert "dsa needs megatron-core 0.18 or later (installed: megatron-core 0.16" in dsa.stderr
    else:
        assert "missing here: CUDA, transformer-engine, fast-hadamard-transform" in dsa.stderr


def test_flags_have_megatron_lms_names_defaults_and_layer_patterns(capsys):
    args = parse_args(TINY, world_size=1)
    assert (args.experimental_attention_variant, args.linear_attention_freq, args.linear_conv_kernel_dim,
            args.linear_key_head_dim, args.linear_value_head_dim, args.linear_num_key_heads,
            args.linear_num_value_heads) == (None, None, 4, 128, 128, 16, 32)
    assert (args.dsa_indexer_n_heads, args.dsa_indexer_topk_freq, args.dsa_indexer_loss_coeff,
            args.dsa_kernel_backend, args.dsa_indexer_rotate_activation) == (None, 1, None, "none", True)
    parser = arguments.build_parser()
    assert parser.parse_args([*TINY, "--linear-attention-freq", "([1]*3+[0]*1)*2"]).linear_attention_freq == \
        [1, 1, 1, 0, 1, 1, 1, 0]
    assert parser.parse_args([*TINY, "--linear-attention-freq", "4"]).linear_attention_freq == 4
    line = _refused([*TINY, "--linear-attention-freq", "__import__('os')"], capsys)
    assert "--linear-attention-freq: invalid linear attention pattern value" in line


def test_gdn_config_on_a_gpu_host_reaches_megatron_cores_transformer_config(monkeypatch):
    """Megatron-LM's gpt3_mcore_te_tp2_pp1_gdn: accepted on 2 ranks (TP 2), and the config megatron-core's
    experimental layer spec reads has gated delta net every layer but every third."""
    from megatron_resil import model

    _gpu_host(monkeypatch, {"fla"})
    args = parse_args(GDN_CONFIG, world_size=2)
    config = model.transformer_config(args)
    assert config.experimental_attention_variant == "gated_delta_net"
    assert (config.linear_attention_freq, config.linear_conv_kernel_dim, config.linear_key_head_dim,
            config.linear_value_head_dim, config.linear_num_key_heads, config.linear_num_value_heads) == \
        (3, 4, 64, 64, 4, 8)
    assert config.transformer_impl == "transformer_engine" and config.attention_output_gate
    assert (config.num_moe_experts, config.tensor_model_parallel_size, config.deterministic_mode) == \
        (32, 2, True)
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
    )
    assert get_linear_attention_pattern(config) == [1, 1, 0, 1, 1, 0]
    # "gdn", Megatron-LM's newer name, is the same layer for a megatron-core that knows only the old one.
    renamed = parse_args([*GDN_CONFIG, "--experimental-attention-variant", "gdn"], world_size=2)
    known = flag_table.config_choices("TransformerConfig", "experimental_attention_variant")
    assert renamed.experimental_attention_variant == ("gdn" if "gdn" in known else "gated_delta_net")


def test_gated_delta_net_is_checked_before_any_work_starts(monkeypatch, capsys):
    _gpu_host(monkeypatch, {"fla"})
    gdn = [*TINY, "--experimental-attention-variant", "gated_delta_net", "--linear-num-key-heads", "2",
           "--linear-num-value-heads", "4"]
    assert "needs --linear-attention-freq" in _refused(gdn, capsys)
    assert "--linear-attention-freq lists 3 layers, not --num-layers 2" in _refused(
        [*gdn, "--linear-attention-freq", "[1]*3"], capsys)
    assert "--linear-num-value-heads 6 must be a multiple of --linear-num-key-heads 4" in _refused(
        [*gdn, "--linear-attention-freq", "2", "--linear-num-key-heads", "4",
         "--linear-num-value-heads", "6"], capsys)
    assert "needs --transformer-impl transformer_engine" in _refused(
        [*gdn, "--linear-attention-freq", "2", "--transformer-impl", "local"], capsys)
    line = _refused([*gdn, "--experimental-attention-variant", "gdn2", "--linear-attention-freq", "2"],
                    capsys)
    if "gdn2" not in flag_table.config_choices("TransformerConfig", "experimental_attention_variant"):
        assert "gdn2 needs a newer megatron-core" in line
    _gpu_host(monkeypatch, set())  # a GPU host without flash-linear-attention
    line = _refused([*gdn, "--linear-attention-freq", "2"], capsys)
    assert line.endswith("missing here: flash-linear-attention (pip install flash-linear-attention)")


@pytest.mark.skipif(CORE < attention_variants.DSA_SINCE,
                    reason="megatron-core 0.16 and 0.17 do not build sparse attention for GPT")
def test_dsa_config_on_a_gpu_host_reaches_megatron_cores_config(monkeypatch, capsys):
    """Megatron-LM's gpt3_mcore_te_tp2_pp2_dsa on 4 ranks (TP 2, PP 2): needs fast-hadamard-transform for
    its indexer's rotation; with it, the indexer's flags reach megatron-core's multi-latent attention
    config."""
    from megatron_resil import model

    _gpu_host(monkeypatch, set())
    assert "missing here: fast-hadamard-transform (pip install fast-hadamard-transform)" in _refused(
        DSA_CONFIG, capsys, world_size=4)
    parse_args([*DSA_CONFIG, "--no-dsa-indexer-rotate-activation"], world_size=4)  # no rotation, no package
    _gpu_host(monkeypatch, {"fast_hadamard_transform"})
    config = model.transformer_config(parse_args(DSA_CONFIG, world_size=4))
    assert type(config).__name__ == "MLATransformerConfig" and config.experimental_attention_variant == "dsa"
    assert (config.dsa_indexer_n_heads, config.dsa_indexer_head_dim, config.dsa_indexer_topk,
            config.dsa_indexer_loss_coeff, config.q_lora_rank, config.add_bias_linear) == \
        (64, 128, 2048, 0.01, 192, False)
    assert "needs --bf16" in _refused(
        [a for a in DSA_CONFIG if a != "--bf16"], capsys, world_size=4)
    assert "needs --multi-latent-attention" in _refused(
        [a for a in DSA_CONFIG if a != "--multi-latent-attention"], capsys, world_size=4)


@pytest.mark.skipif(CORE >= attention_variants.DSA_SINCE, reason="megatron-core 0.18 builds it")
def test_dsa_is_refused_where_megatron_core_does_not_build_it(monkeypatch, capsys):
    _gpu_host(monkeypatch, {"fast_hadamard_transform"})
    line = _refused(DSA_CONFIG, capsys, world_size=4)
    assert "--experimental-attention-variant dsa needs megatron-core 0.18 or later" in line


def test_throughput_counts_gated_delta_net_layers_as_megatron_lm(monkeypatch):
    """Megatron-LM's num_floating_point_operations for gpt3_mcore_te_tp2_pp1_gdn's model: 4 of its 6 layers
    are gated delta net (projections, convolution, delta rule; no L^2 term), 2 full attention."""
    from megatron_resil.train_log import floating_point_operations

    _gpu_host(monkeypatch, {"fla"})
    args = parse_args(GDN_CONFIG, world_size=2)
    args.padded_vocab_size = 256
    gdn = floating_point_operations(args, 32)
    args.experimental_attention_variant = None
    full = floating_point_operations(args, 32)
    tokens, h = 32 * 1024, 512
    qk, v = 64 * 4, 64 * 8
    linear = 6 * (h * (2 * qk + 2 * v + 2 * 8) + 4 * (2 * qk + v) + 8 * 64 * 64 * 4 + h * v)
    query, kv = 64 * 8, 2 * 64 * 2
    attention = 6 * (h * (query + kv + query) + query * h)  # with --attention-output-gate's gate
    core = 6 * query  # QK^T and softmax(QK^T)V, causal
    assert gdn == pytest.approx(full + 4 * tokens * (linear - attention) - 4 * 32 * 1024 * 1024 * core)


def test_coverage_benchmark_names_the_kernel_package_a_gpu_host_must_install(tmp_path):
    """A gated delta net config is refused as on a GPU host with Transformer Engine but without
    flash-linear-attention, the reason naming it, and counted in the figure for hosts that have it."""
    tree = tmp_path / "Megatron-LM"
    case = tree / "tests/functional_tests/test_cases/gpt/tiny_gdn"
    case.mkdir(parents=True)
    model_args = {a: True for a in ("--group-query-attention", "--disable-bias-linear", "--mock-data")}
    model_args.update({"--num-layers": 4, "--hidden-size": 64, "--num-attention-heads": 4, "--seq-length": 32,
                       "--max-position-embeddings": 32, "--micro-batch-size": 1, "--train-iters": 4,
                       "--lr": 1e-3, "--tokenizer-type": "NullTokenizer", "--vocab-size": 128,
                       "--experimental-attention-variant": "gated_delta_net", "--linear-attention-freq": 2,
                       "--linear-num-key-heads": 2, "--linear-num-value-heads": 4})
    case.joinpath("model_config.yaml").write_text(json.dumps({"MODEL_ARGS": model_args}))
    # The packages a GPU host is counted with: those Megatron-LM's own pyproject.toml lists.
    tree.joinpath("pyproject.toml").write_text('[project.optional-dependencies]\n'
                                               'ssm = ["flash-linear-attention==0.5.1"]\n')
    tiny = " ".join(launch.TINY_MODEL + ["--micro-batch-size", "1", "--train-iters", "4", "--lr", "1e-3"])
    for example in ("gpt3/train_gpt3_175b_distributed.sh", "llama/train_llama3_8b_h100_fp8.sh",
                    "mixtral/train_mixtral_8x7b_distributed.sh"):  # the three scripts it reads, accepted
        (tree / "examples" / example).parent.mkdir(parents=True, exist_ok=True)
        (tree / "examples" / example).write_text(f"torchrun pretrain_gpt.py {tiny} --mock-data\n")
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks/megatron_flag_coverage.py"), str(tree),
                             "--json", str(report)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(report.read_text())
    if attention_variants.package_available("fla"):
        pytest.skip("flash-linear-attention is installed here")
    assert (summary["configs_accepted_whole"], summary["configs_accepted_whole_with_kernel_packages"]) == \
        (0, 1)
    assert summary["kernel_packages"] == {"fla": 1}
    assert summary["refused_flags"][0]["first_reason"].endswith(
        "missing here: flash-linear-attention (pip install flash-linear-attention)")
