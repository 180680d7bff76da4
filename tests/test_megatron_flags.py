"""Megatron-LM's own command lines: the flags of its example pretraining scripts and functional-test configs
are accepted with Megatron-LM's names, defaults and meanings, reach megatron-core's configs, and train.

The three example scripts' command lines are written out below as the scripts pass them (Megatron-LM
d98e8a6, examples/{gpt3,llama,mixtral}); the slow test trains each for 4 iterations on CPU with the model
and parallel sizes shrunk, a few flags dropped or stood in for, each listed with its reason.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_resil import arguments
from megatron_resil.arguments import flag_table, parse_args

try:
    from tests import launch  # tests/ is a package
except ImportError:  # tests/ on sys.path instead
    import launch

_refused = launch.refused_line

REPO = Path(__file__).resolve().parents[1]

# --- the example scripts' command lines, as the scripts pass them ----------------------------------------
GPT3_175B = [
    "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
    "--max-position-embeddings", "2048", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "1536",
    "--step-batch-size-schedule", "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", "--train-iters",
    "500000",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
    "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
    "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
    "--data-path", "{data}", "--vocab-file", "{vocab}", "--merge-file", "{merges}", "--split", "949,50,1",
    "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000", "--save", "{ckpt}",
    "--load", "{ckpt}", "--eval-iters", "10", "--tensorboard-dir", "{tb}",
]
LLAMA3_8B_FP8 = [
    "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8", "--kv-channels",
    "128",
    "--seq-length", "8192", "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout",
    "0.0",
    "--swiglu", "--normalization", "RMSNorm", "--init-method-std", "0.0134", "--attention-backend", "fused",
    "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000",
    "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015", "--min-lr",
    "0.00001",
    "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad",
    "1.0",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
    "--empty-unused-memory-level", "1",
    "--exit-duration-in-mins", "235", "--use-distributed-optimizer", "--overlap-grad-reduce",
    "--overlap-param-gather", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
    "--fp8-amax-compute-algo", "max", "--fp8-param-gather", "--tensor-model-parallel-size", "1",
    "--context-parallel-size", "1", "--sequence-parallel", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "128256", "--data-cache-path", "{cache}", "--tiktoken-pattern", "v2",
    "--split", "'99,1,0'", "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
    "--num-workers", "1",
    "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
    "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
    "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60", "--save", "{ckpt}", "--load",
    "{ckpt}",
    "--tensorboard-dir", "{tb}",
]
MIXTRAL_8X7B = [
    "--use-mcore-models", "--disable-bias-linear", "--seq-length", "4096", "--max-position-embeddings",
    "32768",
    "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads",
    "32",
    "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
    "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "8",
    "--no-masked-softmax-fusion", "--no-position-embedding", "--rotary-base", "1000000",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
    "--overlap-param-gather", "--overlap-grad-reduce",
    "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "{tokenizer}", "--data-path", "{data}",
    "--split", "99990,8,2",
    "--micro-batch-size", "1", "--global-batch-size", "256", "--lr", "1e-4", "--train-iters", "500000",
    "--lr-decay-iters", "320000", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
    "--lr-warmup-iters", "500", "--clip-grad", "1.0", "--bf16",
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
    "--expert-model-parallel-size", "8",
    "--use-distributed-optimizer", "--sequence-parallel",
    "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10",
    "--save", "{ckpt}", "--load", "{ckpt}", "--tensorboard-dir", "{tb}", "--no-load-optim", "--no-load-rng",
]

# What the CPU runs change, and why. Sizes are shrunk to the tiny model on 2 ranks.
TINY = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "32",
        "--max-position-embeddings": "32", "--train-iters": "4", "--log-interval": "1",
        "--eval-interval": "2", "--eval-iters": "1", "--save-interval": "4"}
# The scripts' tokenizer files are not here: a NullTokenizer of a tiny vocabulary stands in
# (tests/test_tokenizers.py trains on GPT-2's BPE from files it makes).
TOKENIZER_STAND_IN = ("--vocab-file", "--merge-file", "--tokenizer-model", "--tokenizer-type", "--vocab-size",
                      "--tiktoken-pattern")
EXAMPLES = {
    "gpt3_175b": dict(
        argv=GPT3_175B,
        # The schedule shrunk: 2 samples a step, then 4 from the 4th sample (128 tokens of 32) on.
        set={"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "1",
             "--step-batch-size-schedule": "0:2 128:4", "--lr-decay-iters": "4"},
        # The script passes both; Megatron-LM refuses --global-batch-size with a schedule (so do we). It also
        # expands the schedule unquoted, so Megatron-LM receives it split into words: passed here as one.
        dropped={"--global-batch-size": "refused with --step-batch-size-schedule, as in Megatron-LM"},
        gpu_only={},
        stand_ins={"--data-path": "mock data",
                   "--vocab-file/--merge-file": "GPT-2's files are not here"}),
    "llama3_8b_fp8": dict(
        argv=LLAMA3_8B_FP8,
        # The run stays in samples: 4 iterations of the shrunk global batch of 4.
        set={"--ffn-hidden-size": "128", "--num-query-groups": "2", "--kv-channels": "16",
             "--global-batch-size": "4", "--train-samples": "16", "--lr-decay-samples": "16",
             "--lr-warmup-samples": "4"},
        dropped={}, gpu_only={"--fp8-format": "changes results: refused on CPU",
                              "--fp8-param-gather": "changes results: refused on CPU"},
        stand_ins={}),
    "mixtral_8x7b": dict(
        argv=MIXTRAL_8X7B,
        set={"--ffn-hidden-size": "128", "--num-query-groups": "2", "--num-experts": "4",
             "--global-batch-size": "4", "--lr-decay-iters": "4", "--lr-warmup-iters": "1",
             "--pipeline-model-parallel-size": "1", "--expert-model-parallel-size": "2"},
        dropped={}, gpu_only={},
        stand_ins={"--data-path": "mock data", "--tokenizer-type Llama2Tokenizer": "no tokenizer.model"}),
}
SP_WARNING = ("pretrain.py: warning: Disabling sequence parallelism because tensor model parallelism is "
              "disabled")


def _drop(argv: list[str], flag: str) -> list[str]:
    """argv without `flag` and its values."""
    out, skipping = [], False
    for arg in argv:
        if arg == flag:
            skipping = True
        elif skipping and not re.fullmatch(r"--[a-z].*", arg):
            continue
        else:
            skipping = False
            out.append(arg)
    return out


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    return [*_drop(argv, flag), flag, value]


def cpu_command_line(name: str, tmp: Path) -> list[str]:
    example = EXAMPLES[name]
    argv = list(example["argv"])
    for flag in [*example["dropped"], *example["gpu_only"]]:
        argv = _drop(argv, flag)
    if "--data-path" in argv:
        argv = [*_drop(argv, "--data-path"), "--mock-data"]
    for flag in TOKENIZER_STAND_IN:
        argv = _drop(argv, flag)
    argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    shrunk = {**TINY, **example["set"]}
    if "--step-batch-size-schedule" in shrunk:
        shrunk.pop("--global-batch-size", None)
    for flag, value in shrunk.items():
        if not (flag == "--train-iters" and "--train-samples" in argv):  # a run in samples stays so
            argv = _set(argv, flag, value)
    places = {"ckpt": tmp / "ckpt", "tb": tmp / "tb", "cache": tmp / "cache"}
    return [a.format(**places) for a in argv]


# --- parsing (fast) --------------------------------------------------------------------------------------

@pytest.fixture
def gpu_host(monkeypatch):
    """Validation as a GPU host with Transformer Engine would answer (the configs are GPU runs)."""
    for module in (arguments, arguments.model, arguments.distributed, arguments.device,
                   arguments.gpu_features):
        for attr in ("cuda_available", "transformer_engine_available"):
            if hasattr(module, attr):
                monkeypatch.setattr(module, attr, lambda: True)


def _files(tmp: Path) -> dict[str, str]:
    names = {"data": tmp / "corpus_text_document", "vocab": tmp / "gpt2-vocab.json",
             "merges": tmp / "gpt2-merges.txt", "tokenizer": tmp / "tokenizer.model", "ckpt": tmp / "ckpt",
             "tb": tmp / "tb", "cache": tmp / "cache"}
    for suffix in (".bin", ".idx"):
        Path(str(names["data"]) + suffix).touch()
    for key in ("vocab", "merges", "tokenizer"):
        names[key].touch()
    return {k: str(v) for k, v in names.items()}


def test_every_flag_of_the_three_example_scripts_is_a_megatron_flag_here():
    parser = arguments.build_parser()
    known = {option for action in parser._actions for option in action.option_strings}
    for argv in (GPT3_175B, LLAMA3_8B_FP8, MIXTRAL_8X7B):
        flags = {a for a in argv if re.fullmatch(r"--[a-z].*", a)}
        assert flags <= known, sorted(flags - known)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_script_is_accepted_as_on_its_gpu_cluster(name, tmp_path, gpu_host, capsys):
    """Unshrunk, at the script's world size, with only the stand-ins for what item 2 builds."""
    argv = [a.format(**_files(tmp_path)) for a in EXAMPLES[name]["argv"]]
    for flag in EXAMPLES[name]["dropped"]:
        argv = _drop(argv, flag)
    for flag in TOKENIZER_STAND_IN:
        argv = _drop(argv, flag)
    argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128256"]
    world = {"gpt3_175b": 128, "llama3_8b_fp8": 8, "mixtral_8x7b": 32}[name]
    args = parse_args(argv, world_size=world)
    assert args.world_size == world
    if name == "llama3_8b_fp8":
        assert args.fp8 == "hybrid" and args.fp8_param_gather and args.layernorm_zero_centered_gamma
        # TP 1: Megatron-LM's adjustment, with its warning.
        assert not args.sequence_parallel and SP_WARNING in capsys.readouterr().err
        assert not args.accumulate_allreduce_grads_in_fp32  # --grad-reduce-in-bf16
        assert args.train_iters == 1953125000 // 128 and args.lr_decay_samples == 1949218748  # in samples
    if name == "mixtral_8x7b":
        assert args.num_experts == 8 and args.moe_grouped_gemm and args.expert_model_parallel_size == 8
    if name == "gpt3_175b":
        assert args.lr_warmup_fraction == 0.001 and args.tensor_model_parallel_size == 8


def test_sequence_parallel_with_tp1_is_turned_off_with_megatron_lms_warning(tmp_path, capsys):
    args = parse_args(_base("--sequence-parallel"), world_size=1)
    assert not args.sequence_parallel
    assert capsys.readouterr().err.splitlines() == [SP_WARNING]


def _base(*extra: str) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "4", *extra]


@pytest.mark.parametrize("flags, named", [
    (("--use-megatron-fsdp",), "--use-megatron-fsdp"),
    (("--optimizer", "soap"), "--optimizer soap"),
    (("--experimental-attention-variant", "gated_delta_net"), "--experimental-attention-variant"),
    (("--tokenizer-type", "BertWordPieceCase", "--vocab-size", "128"), "BertWordPieceCase is not built here"),
    (("--no-position-embedding",), "--no-position-embedding"),
    (("--recompute-granularity", "full", "--recompute-method", "uniform"), None),
])
def test_what_cannot_run_here_is_refused_in_one_line_naming_the_flag(flags, named, capsys):
    argv = _base(*flags)
    if "--tokenizer-type" in flags:
        argv = _drop(_drop(argv, "--tokenizer-type"), "--vocab-size") + list(flags)
    line = _refused(argv, capsys)
    assert (named or flags[0]) in line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU behaviour")
def test_gpu_only_flags_on_cpu_one_warning_if_only_faster_refused_if_results_change(capsys):
    args = parse_args(_base("--cross-entropy-loss-fusion", "--empty-unused-memory-level", "1",
                            "--num-experts", "2", "--disable-bias-linear", "--moe-grouped-gemm"),
                      world_size=1)
    assert not args.cross_entropy_loss_fusion and not args.moe_grouped_gemm
    assert args.empty_unused_memory_level == 0
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 3 and all("ignored without CUDA" in w for w in warnings), warnings
    line = _refused(_base("--fp8-format", "hybrid"), capsys)
    assert "--fp8-format hybrid needs CUDA: it changes what is computed" in line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU behaviour")
def test_cuda_graphs_userbuffers_and_op_fuser_on_cpu_one_warning_each_and_ignored(capsys):
    """They only replay or overlap GPU work: the run is the same without them."""
    args = parse_args(_base("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn",
                            "--cuda-graph-warmup-steps", "0", "--te-rng-tracker", "--tp-comm-overlap",
                            "--tp-comm-overlap-cfg", "ub.yaml", "--use-transformer-engine-op-fuser",
                            "--fine-grained-activation-offloading", "--offload-modules", "core_attn"),
                      world_size=1)
    assert (args.cuda_graph_impl, args.te_rng_tracker, args.tp_comm_overlap,
            args.use_transformer_engine_op_fuser, args.fine_grained_activation_offloading) == \
        ("none", False, False, False, False)
    warnings = capsys.readouterr().err.splitlines()
    assert [w.split(" ")[2] for w in warnings] == [
        "--use-transformer-engine-op-fuser", "--fine-grained-activation-offloading", "--tp-comm-overlap",
        "--cuda-graph-impl", "--te-rng-tracker"], warnings
    assert all(w.endswith("ignored without CUDA") for w in warnings), warnings
    assert "--cuda-graph-impl transformer_engine only replays captured GPU work (same results)" in warnings[3]
    assert "--fine-grained-activation-offloading only manages GPU memory (same results)" in warnings[1]


def test_cuda_graphs_userbuffers_offloading_reach_megatron_cores_config_on_a_gpu_host(gpu_host, tmp_path,
                                                                                       capsys):
    """As Megatron-LM: the deprecated switch becomes --cuda-graph-impl, CUDA graphs with Transformer Engine
    turn its RNG tracker on, and the config gets the implementation, the modules, the warm-up, the
    userbuffer switch (the modules under the name the installed megatron-core uses) and what is offloaded."""
    from megatron_resil import gpu_features, model

    cfg = tmp_path / "ub.yaml"
    cfg.write_text("qkv_fprop:\n  method: ring_exchange\n")
    tp2 = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
    args = parse_args(_base(*tp2, "--enable-cuda-graph", "--cuda-graph-scope", "attn", "mlp",
                            "--cuda-graph-warmup-steps", "2", "--tp-comm-overlap", "--tp-comm-overlap-cfg",
                            str(cfg)), world_size=2)
    assert capsys.readouterr().err.splitlines() == [
        "pretrain.py: warning: --enable-cuda-graph is deprecated, use --cuda-graph-impl=local instead.",
        "pretrain.py: warning: --cuda-graph-scope is deprecated, use --cuda-graph-modules instead.",
        "pretrain.py: warning: te_rng_tracker is not enabled, enabling it for CUDA graphs."]
    config = {**flag_table.config_kwargs(args, arguments.FLAGS, "TransformerConfig"),
              **model.cuda_graph_kwargs(args)}
    modules = "cuda_graph_modules" if "cuda_graph_modules" in config else "cuda_graph_scope"
    assert {k: config[k] for k in ("cuda_graph_impl", "cuda_graph_warmup_steps", "use_te_rng_tracker",
                                   "tp_comm_overlap", modules)} == \
        {"cuda_graph_impl": "local", "cuda_graph_warmup_steps": 2, "use_te_rng_tracker": True,
         "tp_comm_overlap": True, modules: ["attn", "mlp"]}
    assert gpu_features.seed_kwargs(args) == {"te_rng_tracker": True, "use_cudagraphable_rng": True}
    assert "--tp-comm-overlap needs --sequence-parallel" in _refused(
        _base("--tensor-model-parallel-size", "2", "--tp-comm-overlap"), capsys, world_size=2)
    assert "--tp-comm-overlap-cfg nowhere.yaml: no such file" in _refused(
        _base(*tp2, "--tp-comm-overlap", "--tp-comm-overlap-cfg", "nowhere.yaml"), capsys, world_size=2)
    assert "full_iteration is not supported here" in _refused(
        _base("--cuda-graph-impl", "full_iteration"), capsys)
    args = parse_args(_base("--fine-grained-activation-offloading", "--offload-modules", "core_attn",
                            "attn_proj"), world_size=1)
    config = flag_table.config_kwargs(args, arguments.FLAGS, "TransformerConfig")
    assert config["fine_grained_activation_offloading"] and config["offload_modules"] == ["core_attn",
                                                                                         "attn_proj"]
    assert "--fine-grained-activation-offloading needs --transformer-impl transformer_engine" in _refused(
        _base("--fine-grained-activation-offloading", "--transformer-impl", "local"), capsys)


def test_op_fuser_on_a_gpu_host_reaches_the_config_or_is_ignored_where_megatron_core_lacks_it(gpu_host,
                                                                                            capsys):
    args = parse_args(_base("--use-transformer-engine-op-fuser"), world_size=1)
    if "use_transformer_engine_op_fuser" in flag_table.config_fields("TransformerConfig"):  # 0.19
        assert flag_table.config_kwargs(args, arguments.FLAGS, "TransformerConfig")[
            "use_transformer_engine_op_fuser"]
        assert capsys.readouterr().err == ""
    else:  # megatron-core 0.16: the same run without Transformer Engine's fuser
        assert not args.use_transformer_engine_op_fuser
        assert capsys.readouterr().err.splitlines() == [
            "pretrain.py: warning: --use-transformer-engine-op-fuser only selects a GPU kernel (same "
            "results); ignored: the installed megatron-core 0.16.1's TransformerConfig has no "
            "use_transformer_engine_op_fuser"]


def test_megatron_defaults_of_the_new_flags():
    args = parse_args(_base(), world_size=1)
    expected = {"rotary_base": 10000, "rotary_percent": 1.0, "layernorm_epsilon": 1e-5,
                "layernorm_zero_centered_gamma": False, "attention_backend": "auto", "timing_log_level": 0,
                "timing_log_option": "minmax", "dist_ckpt_strictness": "assume_ok_unexpected",
                "async_strategy": "nvrx", "num_workers": 2, "mmap_bin_files": True,
                "lr_warmup_fraction": None, "moe_router_score_function": "softmax",
                "moe_router_bias_update_rate": 1e-3, "kv_lora_rank": 32, "qk_head_dim": 128,
                "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "mtp_loss_scaling_factor": 0.1,
                "overlap_p2p_comm": False, "use_gloo_process_groups": True, "ckpt_fully_parallel_save": True,
                "manual_gc_interval": 0, "log_loss_scale_to_tensorboard": True, "moe_layer_freq": 1,
                "expert_tensor_parallel_size": 1, "num_distributed_optimizer_instances": 1,
                "cp_comm_type": "p2p", "profile_step_start": 10, "profile_step_end": 12}
    assert {k: getattr(args, k) for k in expected} == expected


def test_megatron_adjustments_swiglu_ffn_size_bf16_grads_and_fp16_nan_checks(capsys):
    args = parse_args([*_drop(_base("--swiglu", "--bf16"), "--hidden-size"), "--hidden-size", "96"],
                      world_size=1)
    assert args.ffn_hidden_size == int((4 * 96 * 2 / 3) / 64) * 64  # Megatron-LM's swiglu default
    assert args.accumulate_allreduce_grads_in_fp32  # bf16: gradients in fp32 unless --grad-reduce-in-bf16
    args = parse_args(_base("--fp16"), world_size=1)
    assert not args.check_for_nan_in_loss_and_grad
    assert "dynamic loss scaling is being used" in capsys.readouterr().err


def test_moe_layer_freq_takes_megatrons_pattern_expressions(capsys):
    moe = ("--num-experts", "2", "--disable-bias-linear")
    args = parse_args(_base(*moe, "--moe-layer-freq", "([0]*1+[1]*1)"), world_size=1)
    assert args.moe_layer_freq == [0, 1]
    assert "--moe-layer-freq" in _refused(_base("--moe-layer-freq", "__import__('os')"), capsys)
    line = _refused(_base(*moe, "--moe-layer-freq", "[1]*3"), capsys)
    assert "lists 3 layers, not --num-layers 2" in line


# Every form of --moe-layer-freq in Megatron-LM's functional-test configs and example scripts, with the
# layers it makes (the config's --num-layers).
MEGATRON_LM_LAYER_PATTERNS = {
    "([0]*3+[1]*11)": [0] * 3 + [1] * 11, "([0]*1+[1]*15)": [0] + [1] * 15,
    "([0]*4+[1]*9)": [0] * 4 + [1] * 9, "([0]*3+[1]*12)": [0] * 3 + [1] * 12, "([0]*1+[1]*1)": [0, 1],
    "([0]*3+[1]*13)": [0] * 3 + [1] * 13,
    "([0]*3+[1]*5)": [0] * 3 + [1] * 5, "[0]*3+[1]*58": [0] * 3 + [1] * 58, "([0]+[1]*26)": [0] + [1] * 26,
    "([0,1]*24)": [0, 1] * 24, "[0]*1+[1]*60": [0] + [1] * 60, "[1, 0, 1]": [1, 0, 1],
    "([1]*3+[0]*2)*2": [1, 1, 1, 0, 0] * 2, "1": 1, "3": 3,
}


def test_moe_layer_freq_is_read_by_a_grammar_never_evaluated(capsys):
    """Megatron-LM evaluates the text; here every form its configs use reads as there, and what is no list
    of layers, or more layers than any model has, is refused in one line before anything is built."""
    from megatron_resil.arguments import build_parser
    from megatron_resil.arguments.layer_pattern import MAX_LAYERS

    parser = build_parser()
    for text, layers in MEGATRON_LM_LAYER_PATTERNS.items():
        assert parser.parse_args([*_base(), "--moe-layer-freq", text]).moe_layer_freq == layers, text
    for text, why in (("[0]*99**99", "a power"), ("9**9**9", "N, or a list expression"),
                      ("[0]*1000000000", "1000000000 is not between 1 and"),
                      (f"[0]*{MAX_LAYERS}+[1]", f"it makes {MAX_LAYERS + 1} layers, more than any model has"),
                      ("(" * 100 + "[1]" + ")" * 100, "nested more than"),
                      ("[2]*4", "a list holds 0 (dense) and 1 only"),
                      ("0", "0 is not between 1 and")):
        line = _refused(_base("--moe-layer-freq", text), capsys)
        assert line.startswith("pretrain.py: error: argument --moe-layer-freq: invalid moe layer pattern "
                               "value:") and why in line, line


def test_a_flag_the_installed_megatron_core_lacks_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(flag_table, "config_fields", lambda config: frozenset())
    line = _refused(_base("--rotary-interleaved"), capsys)
    assert "--rotary-interleaved needs a megatron-core whose TransformerConfig has rotary_interleaved" in line


def test_interleaved_schedule_groups_of_microbatches_as_megatron_core_checks_them(capsys):
    layout = ("--num-layers", "4", "--pipeline-model-parallel-size", "2",
              "--num-layers-per-virtual-pipeline-stage", "1")
    args = parse_args(_base(*layout, "--global-batch-size", "10", "--micro-batch-size", "2",
                            "--microbatch-group-size-per-virtual-pipeline-stage", "5"), world_size=2)
    assert args.num_microbatches == 5 and args.overlap_p2p_comm  # Megatron-LM's default for interleaving
    line = _refused(_base(*layout, "--global-batch-size", "6", "--micro-batch-size", "2"), capsys,
                    world_size=2)
    assert "microbatches (3" in line


def test_table_rows_reach_megatron_cores_configs():
    """What the flags say is what megatron-core's TransformerConfig, OptimizerConfig, DDP config and the
    scheduler get."""
    from megatron_resil import model, optimizer

    args = parse_args(_base("--apply-layernorm-1p", "--qk-layernorm", "--norm-epsilon", "1e-6",
                            "--rotary-interleaved", "--position-embedding-type", "rope",
                            "--attention-softmax-in-fp32", "--calculate-per-token-loss", "--num-experts", "4",
                            "--disable-bias-linear", "--moe-ffn-hidden-size", "32", "--moe-router-dtype",
                            "fp32",
                            "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                            "--moe-z-loss-coeff", "1e-3", "--squared-relu", "--decoupled-lr", "5e-4",
                            "--log-num-zeros-in-grad", "--ddp-bucket-size", "1000"), world_size=1)
    config = model.transformer_config(args)
    assert (config.layernorm_zero_centered_gamma, config.qk_layernorm, config.layernorm_epsilon) == \
        (True, True, 1e-6)
    assert config.rotary_interleaved and config.attention_softmax_in_fp32 and config.calculate_per_token_loss
    assert (config.num_moe_experts, config.moe_ffn_hidden_size, config.moe_router_dtype) == (4, 32, "fp32")
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert config.moe_z_loss_coeff == 1e-3 and not config.add_bias_linear
    from megatron.core.activations import squared_relu
    assert config.activation_func is squared_relu
    opt = optimizer.optimizer_config(args)
    assert opt.decoupled_lr == 5e-4 and opt.log_num_zeros_in_grad and opt.lr == 1e-3
    assert optimizer.ddp_config(args).bucket_size == 1000


def test_lr_warmup_fraction_is_a_fraction_of_the_decay_as_in_megatron():
    from megatron_resil import optimizer

    args = parse_args(_base("--lr-warmup-fraction", "0.25", "--lr-warmup-iters", "0"), world_size=1)
    args.lr_warmup_iters = 0

    class FakeOptimizer:
        param_groups = [{"lr": 0.0, "weight_decay": 0.0}]

    scheduler = optimizer.build_scheduler(FakeOptimizer(), args)
    assert scheduler.lr_warmup_steps == 0.25 * args.lr_decay_iters * args.global_batch_size


TINY_CONFIG = ("  --num-layers: 2\n  --hidden-size: 64\n  --num-attention-heads: 4\n  --seq-length: 32\n"
               "  --max-position-embeddings: 32\n  --micro-batch-size: 1\n  --train-iters: 4\n  --lr: 1e-3\n"
               "  --mock-data: true\n  --tokenizer-type: NullTokenizer\n  --vocab-size: 128\n")


def test_coverage_script_reads_a_snapshot_and_counts_accepted_configs(tmp_path):
    """benchmarks/megatron_flag_coverage.py on a small Megatron-LM tree: a config counts as accepted whole
    only through every start-up check up to its model (built on the meta device), with its ENV_VARS, at the
    world size of the CI recipe that lists it, and with no flag ignored."""
    tree = tmp_path / "Megatron-LM"
    cases = tree / "tests/functional_tests/test_cases"
    configs = {
        "gpt/tiny_ok": "MODEL_ARGS:\n" + TINY_CONFIG + "  --log-params-norm: true\n"
                       "  --sequence-parallel: true\n",
        "moe/tiny_fsdp": "MODEL_ARGS:\n  --num-layers: 2\n  --use-megatron-fsdp: true\n  --no-such-flag: 3\n",
        # Refused by our checks only with its own environment.
        "gpt/tiny_fsdp2_env": "ENV_VARS:\n  CUDA_DEVICE_MAX_CONNECTIONS: 1\nMODEL_ARGS:\n" + TINY_CONFIG
                              + "  --use-torch-fsdp2: true\n  --untie-embeddings-and-output-weights: true\n"
                                "  --no-gradient-accumulation-fusion: true\n",
        # Its recipe runs it on 2 GPUs, which tensor parallelism 4 does not fit (it would at 4 or 8).
        "gpt/tiny_tp4": "MODEL_ARGS:\n" + TINY_CONFIG + "  --tensor-model-parallel-size: 4\n",
        # Parses; megatron-core's TransformerConfig refuses it.
        "moe/tiny_router_groups": "MODEL_ARGS:\n" + TINY_CONFIG + "  --num-experts: 4\n"
                                  "  --disable-bias-linear: true\n  --moe-router-num-groups: 3\n"
                                  "  --moe-router-group-topk: 1\n",
        # Runs only with a flag ignored (a GPU kernel, on this host): not accepted whole.
        "gpt/tiny_kernel": "MODEL_ARGS:\n" + TINY_CONFIG + "  --cross-entropy-loss-fusion: true\n",
    }
    for name, text in configs.items():
        (cases / name).mkdir(parents=True)
        (cases / name / "model_config.yaml").write_text(text)
    recipe = tree / "tests/test_utils/recipes/h100/gpt.yaml"
    recipe.parent.mkdir(parents=True)
    recipe.write_text("spec:\n  model: gpt\n  nodes: 1\n  gpus: 2\nproducts:\n  - test_case: [tiny_tp4]\n"
                      "    products:\n      - environment: [dev]\n")
    (cases / "gpt/tiny_inference").mkdir(parents=True)
    (cases / "gpt/tiny_inference/model_config.yaml").write_text("MODE: inference\nMODEL_ARGS:\n  --x: 1\n")
    script = "torchrun --nproc_per_node 1 pretrain_gpt.py --num-layers 2 --hidden-size 64 " \
             "--num-attention-heads 4 --seq-length 32 --micro-batch-size 1 --train-iters 4 --lr 1e-3 " \
             "--mock-data --tokenizer-type NullTokenizer --vocab-size 128\n"
    for example in ("gpt3/train_gpt3_175b_distributed.sh", "llama/train_llama3_8b_h100_fp8.sh",
                    "mixtral/train_mixtral_8x7b_distributed.sh"):
        (tree / "examples" / example).parent.mkdir(parents=True, exist_ok=True)
        (tree / "examples" / example).write_text(script)
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks/megatron_flag_coverage.py"), str(tree),
                             "--cpu", "--json", str(report)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    import json
    summary = json.loads(report.read_text())
    counts = (summary["configs"], summary["configs_accepted_whole"], summary["configs_all_flags_known"],
              summary["configs_accepted_whole_model_built"])
    assert counts == (6, 1, 5, 1)
    refused = summary["configs_refused"]
    source = "tests/functional_tests/test_cases/"
    assert {"--no-such-flag", "--use-megatron-fsdp"} <= set(refused[source + "moe/tiny_fsdp"])
    assert refused[source + "gpt/tiny_fsdp2_env"] == ["--use-torch-fsdp2"]
    reasons = {row["flag"]: row["first_reason"] for row in summary["refused_flags"]}
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in reasons["--use-torch-fsdp2"]
    assert refused[source + "gpt/tiny_tp4"] == ["--tensor-model-parallel-size"]
    assert summary["world_size_of"][source + "gpt/tiny_tp4"] == [2, "tests/test_utils/recipes/h100/gpt.yaml"]
    assert summary["world_size_of"][source + "gpt/tiny_ok"] == [8, "--world-size"]  # no recipe lists it
    [groups] = refused[source + "moe/tiny_router_groups"]
    assert groups.startswith("megatron-core") and "moe_router_num_groups" in groups
    assert list(summary["configs_dropping_flags"]) == [source + "gpt/tiny_kernel"]
    assert all(v["accepted"] for v in summary["examples"].values())
    assert "accepted whole: 1/6 = 16.7%" in result.stdout


# --- training (slow) -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_three_example_scripts_train_4_iterations_on_cpu(tmp_path):
    """Each example's flags (shrunk; the dropped and stood-in ones listed in EXAMPLES) train 4 iterations on
    2 ranks, end with exit 0 and a checkpoint, and log what their logging flags ask for."""
    outputs = {}
    for name in EXAMPLES:
        run_dir = tmp_path / name
        run_dir.mkdir()
        result = launch.run(cpu_command_line(name, run_dir), nproc=2, timeout=300)
        outputs[name] = result.stdout
        assert result.returncode == 0, f"{name}:\n{result.stdout[-4000:]}"
        losses = launch.losses(result.stdout)
        assert sorted(losses) == [1, 2, 3, 4], (name, losses)
        assert all(float(loss) == float(loss) and float(loss) < 20 for loss, _ in losses.values()), losses
        assert (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
        assert any((run_dir / "tb").iterdir()), f"{name}: no TensorBoard events"
    assert SP_WARNING in outputs["llama3_8b_fp8"] and SP_WARNING in outputs["mixtral_8x7b"]
    assert "throughput per GPU (TFLOP/s/GPU):" in outputs["llama3_8b_fp8"]  # --log-throughput
    assert "--cross-entropy-loss-fusion only selects a GPU kernel" in outputs["llama3_8b_fp8"]
    assert "--moe-grouped-gemm only selects a GPU kernel" in outputs["mixtral_8x7b"]
    assert "load_balancing_loss:" in outputs["mixtral_8x7b"]
    # --fp16 with a dynamic loss scale: Megatron-LM's adjustment, with its warning.
    assert "check_for_nan_in_loss_and_grad to False since dynamic loss scaling" in outputs["gpt3_175b"]
    assert "global batch size 2 -> 4 at 4 consumed samples" in outputs["gpt3_175b"], outputs["gpt3_175b"]


@pytest.mark.slow
def test_a_configuration_megatron_core_refuses_is_one_line_and_exit_2_on_every_rank(tmp_path):
    """megatron-core checks some combinations only when its config is built (after the rendezvous): its
    message, in one line on rank 0, exit 2 (every rank stops there; the launcher may SIGTERM the slower
    one first), no traceback."""
    result = launch.run([*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "4",
                         "--num-experts", "2", "--moe-router-topk", "1", "--disable-bias-linear"],
                        nproc=2, timeout=180)
    lines = [ln for ln in result.stdout.splitlines() if "refuses this model configuration" in ln]
    assert len(lines) == 1 and lines[0].startswith("pretrain.py: error: megatron-core ") and \
        "--moe-router-pre-softmax" in lines[0], result.stdout[-3000:]
    assert "exitcode  : 2" in result.stdout, result.stdout[-3000:]
    assert "[rank0]: Traceback" not in result.stdout and "[rank1]: Traceback" not in result.stdout


@pytest.mark.slow
def test_two_distributed_optimizer_instances_train_as_one_does():
    """--num-distributed-optimizer-instances 2 on 2 data-parallel ranks: megatron-core builds the instances'
    groups (with einops, a dependency now) and each rank holds a whole optimizer replica; the losses and
    gradient norms are those of the one-instance run."""
    runs = {}
    for instances in ("1", "2"):
        result = launch.run(_base("--use-distributed-optimizer", "--global-batch-size", "4",
                                  "--num-distributed-optimizer-instances", instances), nproc=2, timeout=240)
        assert result.returncode == 0, result.stdout[-3000:]
        runs[instances] = launch.losses(result.stdout)
    assert sorted(runs["2"]) == [1, 2, 3, 4] and runs["2"] == runs["1"], runs


def test_pipeline_layout_is_checked_as_megatron_lm_checks_it(capsys):
    pp2 = ("--num-layers", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4")
    args = parse_args(_base(*pp2, "--pipeline-model-parallel-layout", "E,t|(t|)*2,tL"), world_size=2)
    assert args.virtual_pipeline_model_parallel_size == 2 and args.overlap_p2p_comm
    assert parse_args(_base(*pp2, "--pipeline-model-parallel-layout", "Ettt|tL"),
                      world_size=2).virtual_pipeline_model_parallel_size is None
    assert "places 3 transformer layers, not --num-layers 4" in _refused(
        _base(*pp2, "--pipeline-model-parallel-layout", "Ett|tL"), capsys, world_size=2)
    assert "has 3 stages, not a multiple of --pipeline-model-parallel-size 2" in _refused(
        _base(*pp2, "--pipeline-model-parallel-layout", "Et|tt|tL"), capsys, world_size=2)
    assert "unknown layer x" in _refused(
        _base(*pp2, "--pipeline-model-parallel-layout", "Etx|tttL"), capsys, world_size=2)
    assert "gives the whole split" in _refused(
        _base(*pp2, "--pipeline-model-parallel-layout", "Ett|ttL", "--decoder-first-pipeline-num-layers",
              "2"), capsys, world_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("layers, layout, same_split", [
    ("3", "Ett|tL", ("--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "1")),
    ("4", "Et|t|t|tL", ("--num-layers-per-virtual-pipeline-stage", "1")),
])
def test_a_pipeline_layout_trains_as_the_same_split_given_by_megatron_lms_other_flags(layers, layout,
                                                                                       same_split):
    """PP 2 on 2 CPU ranks: an uneven split (3 layers, 2 then 1) and an interleaved one (4 virtual stages of
    one layer), given as a layout, train with the losses and gradient norms of the same split given the
    older way; megatron-core's config reads the layout (3 layers do not split evenly over 2 stages)."""
    runs = []
    for split in (("--pipeline-model-parallel-layout", layout), same_split):
        argv = [*_drop(_base(), "--num-layers"), "--num-layers", layers, "--pipeline-model-parallel-size",
                "2", "--global-batch-size", "4", *split]
        result = launch.run(argv, nproc=2, timeout=240)
        assert result.returncode == 0, result.stdout[-3000:]
        runs.append(launch.losses(result.stdout))
    assert sorted(runs[0]) == [1, 2, 3, 4] and runs[0] == runs[1], runs
