"""The command line of pretrain.py: Megatron flag names and defaults, and bad input ending in ONE line.

Every bad-input case is checked in-process through `parse_args(argv, world_size=...)` (fast); a few
representative ones also run the real `pretrain.py` as a subprocess, WORLD_SIZE in its environment,
to prove the whole path: exit code 2, exactly one `pretrain.py: error: ...` line naming the flag on
stderr, no traceback, and nothing created on disk.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_resil.arguments import parse_args

try:
    from tests import launch  # tests/ is a package
except ImportError:  # tests/ on sys.path instead
    import launch

CUDA = torch.cuda.is_available()
HAVE_TE = CUDA and importlib.util.find_spec("transformer_engine") is not None

# A valid Megatron-style command line: --flag value pairs (value None: a store_true flag).
# "{tmp}" and "{file}" are replaced by the test's scratch directory and an existing plain file in it.
BASE: dict[str, str | list[str] | None] = {
    "--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4",
    "--seq-length": "32", "--max-position-embeddings": "32",
    "--tokenizer-type": "NullTokenizer", "--vocab-size": "128",
    "--micro-batch-size": "2", "--train-iters": "10", "--lr": "1e-3", "--min-lr": "1e-4",
    "--mock-data": None, "--save": "{tmp}/ckpt",
}
FILE_NAME = "a_plain_file.txt"


def build_argv(tmp: Path, set_: dict | None = None, drop: tuple[str, ...] = (),
               extra: tuple[str, ...] = ()) -> list[str]:
    flags = {k: v for k, v in BASE.items() if k not in drop}
    flags.update(set_ or {})
    argv: list[str] = []
    for flag, value in flags.items():
        argv.append(flag)
        if value is None:
            continue
        argv.extend(value if isinstance(value, list) else [value])
    argv.extend(extra)
    return [a.format(tmp=tmp, file=tmp / FILE_NAME) for a in argv]


class Case:
    def __init__(self, id: str, *, set_: dict | None = None, drop: tuple[str, ...] = (),
                 extra: tuple[str, ...] = (), world_size: int = 1, names: tuple[str, ...],
                 marks=()):
        self.id, self.set_, self.drop, self.extra = id, set_, drop, extra
        self.world_size, self.names, self.marks = world_size, names, marks

    def param(self):
        return pytest.param(self, id=self.id, marks=self.marks)


BAD = {c.id: c for c in [
    Case("unknown-flag", extra=("--no-such-flag",), names=("--no-such-flag",)),
    Case("megatron-abbreviation-not-accepted", drop=("--num-layers",), extra=("--num-lay", "2"),
         names=("--num-lay",)),
    Case("heads-not-divisible-by-tp",
         set_={"--hidden-size": "96", "--num-attention-heads": "3", "--tensor-model-parallel-size": "2"},
         world_size=2, names=("--num-attention-heads 3", "--tensor-model-parallel-size 2")),
    Case("world-size-not-divisible-by-tp", set_={"--tensor-model-parallel-size": "2"}, world_size=3,
         names=("world size 3", "--tensor-model-parallel-size 2")),
    Case("save-interval-without-save", drop=("--save",), set_={"--save-interval": "5"},
         names=("--save-interval", "--save")),
    Case("global-batch-not-divisible-by-micro-x-dp", set_={"--global-batch-size": "6"}, world_size=2,
         names=("--global-batch-size 6", "--micro-batch-size 2")),
    Case("load-is-a-file", set_={"--load": "{file}"}, names=("--load", FILE_NAME)),
    Case("save-is-a-file", set_={"--save": "{file}"}, names=("--save", FILE_NAME)),
    Case("save-under-proc", set_={"--save": "/proc/x/ckpt"}, names=("--save", "/proc", "pseudo file system")),
    Case("seq-length-exceeds-max-position-embeddings", set_={"--seq-length": "64"},
         names=("--seq-length 64", "--max-position-embeddings 32")),
    Case("bf16-with-fp16", extra=("--bf16", "--fp16"), names=("--bf16", "--fp16")),
    Case("missing-train-iters", drop=("--train-iters",), names=("--train-iters",)),
    Case("missing-data", drop=("--mock-data",), names=("--data-path", "--mock-data")),
    Case("mock-data-with-data-path", set_={"--data-path": "{tmp}/corpus"},
         names=("--mock-data", "--data-path")),
    Case("data-path-nonexistent-prefix", drop=("--mock-data",), set_={"--data-path": "{tmp}/nope"},
         names=("--data-path", "nope")),
    Case("ckpt-format-torch-dcp-unsupported", set_={"--ckpt-format": "torch_dcp"},
         names=("--ckpt-format torch_dcp",)),
    Case("async-save-with-torch-format", set_={"--ckpt-format": "torch"}, extra=("--async-save",),
         names=("--async-save", "--ckpt-format", "torch")),
    Case("verify-integrity-with-torch-format", set_={"--ckpt-format": "torch"}, extra=("--verify-integrity",),
         names=("--verify-integrity", "--ckpt-format", "torch")),
    Case("torch-format-distributed-optimizer-without-gloo", set_={"--ckpt-format": "torch"},
         extra=("--use-distributed-optimizer", "--disable-gloo-process-groups"),
         names=("--ckpt-format torch", "--disable-gloo-process-groups")),
    Case("overlap-with-optimizer-step-with-torch-dist",
         set_={"--num-layers": "4", "--pipeline-model-parallel-size": "2",
               "--num-layers-per-virtual-pipeline-stage": "1", "--global-batch-size": "4"},
         extra=("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                "--overlap-param-gather-with-optimizer-step"), world_size=2,
         names=("--overlap-param-gather-with-optimizer-step", "--ckpt-format torch")),
    Case("overlap-with-optimizer-step-without-interleaving", set_={"--ckpt-format": "torch"},
         extra=("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                "--overlap-param-gather-with-optimizer-step"),
         names=("--overlap-param-gather-with-optimizer-step", "interleaved")),
    Case("async-save-with-zarr", set_={"--ckpt-format": "zarr", "--save": "{tmp}/ckpt"},
         extra=("--async-save",), names=("--async-save", "--ckpt-format", "zarr")),
    Case("transformer-engine-on-cpu", set_={"--transformer-impl": "transformer_engine"},
         names=("--transformer-impl",),
         marks=pytest.mark.skipif(HAVE_TE, reason="Transformer Engine and CUDA are present")),
    Case("nccl-without-cuda", set_={"--distributed-backend": "nccl"}, names=("--distributed-backend",),
         marks=pytest.mark.skipif(CUDA, reason="CUDA is present")),
    Case("exit-on-missing-checkpoint-without-load", extra=("--exit-on-missing-checkpoint",),
         names=("--exit-on-missing-checkpoint", "--load")),
    Case("ckpt-keep-last-0", set_={"--ckpt-keep-last": "0"}, names=("--ckpt-keep-last",)),
    Case("split-garbage", set_={"--split": "lots,some"}, names=("--split",)),
    Case("null-tokenizer-without-vocab-size", drop=("--vocab-size",),
         names=("--vocab-size", "NullTokenizer")),
    Case("wsd-without-wsd-decay-iters", set_={"--lr-decay-style": "WSD"},
         names=("--lr-wsd-decay-iters",)),
    Case("np-interval-without-type", set_={"--non-persistent-save-interval": "2"},
         names=("--non-persistent-save-interval",)),
    Case("np-local-without-dir", set_={"--non-persistent-ckpt-type": "local"},
         names=("--non-persistent-ckpt-type local", "--non-persistent-local-ckpt-dir")),
    Case("np-local-dir-is-a-file", set_={"--non-persistent-ckpt-type": "local",
                                         "--non-persistent-local-ckpt-dir": "{file}"},
         names=("--non-persistent-local-ckpt-dir",)),
    Case("replication-without-local", extra=("--replication",),
         names=("--replication", "--non-persistent-ckpt-type local")),
    Case("replication-without-jump", set_={"--non-persistent-ckpt-type": "local",
                                           "--non-persistent-local-ckpt-dir": "{tmp}/local"},
         extra=("--replication",), names=("--replication-jump",)),
    Case("replication-factor-1", set_={"--non-persistent-ckpt-type": "local",
                                       "--non-persistent-local-ckpt-dir": "{tmp}/local",
                                       "--replication-jump": "1", "--replication-factor": "1"},
         extra=("--replication",), names=("--replication-factor",)),
    Case("replication-does-not-divide-world", set_={"--non-persistent-ckpt-type": "local",
                                                    "--non-persistent-local-ckpt-dir": "{tmp}/local",
                                                    "--replication-jump": "2"},
         extra=("--replication",), world_size=2, names=("--replication-jump 2", "world size 2")),
    Case("canary-negative", set_={"--non-persistent-canary-iters": "-1"},
         names=("--non-persistent-canary-iters",)),
    Case("np-global-without-any-dir", set_={"--non-persistent-ckpt-type": "global"}, drop=("--save",),
         names=("--non-persistent-ckpt-type",)),
    Case("fault-without-iteration", set_={"--inject-fault": "kill"}, names=("--inject-fault",)),
    Case("fault-rank-out-of-range", set_={"--inject-fault": "kill", "--inject-fault-iteration": "2",
                                          "--inject-fault-ranks": "5"}, names=("--inject-fault-ranks",)),
    Case("fault-once-needs-save", set_={"--inject-fault": "kill", "--inject-fault-iteration": "2"},
         drop=("--save",), names=("--inject-fault",)),
    Case("warmup-as-long-as-decay", set_={"--lr-warmup-iters": "10"}, names=("--lr-warmup-iters",)),
    Case("exit-signal-unknown", set_={"--exit-signal": "SIGNOPE"}, names=("--exit-signal",)),
    Case("exit-signal-uncatchable", set_={"--exit-signal": "SIGKILL"}, names=("--exit-signal",)),
    Case("grace-without-handler", set_={"--exit-signal-grace-secs": "5"},
         names=("--exit-signal-grace-secs",)),
    Case("min-lr-above-lr", set_={"--min-lr": "1e-2"}, names=("--min-lr", "--lr")),
    # Beyond the brief: more flags a user gets wrong.
    Case("non-integer-value", set_={"--num-layers": "two"}, names=("--num-layers",)),
    Case("unknown-ckpt-format", set_={"--ckpt-format": "pickle"}, names=("--ckpt-format",)),
    Case("hidden-not-divisible-by-heads", set_={"--hidden-size": "66"},
         names=("--hidden-size 66", "--num-attention-heads 4")),
    # The engine's parallel layout (issue 12): combinations megatron-core would reject deep inside.
    Case("layers-not-divisible-by-pp", set_={"--num-layers": "3", "--pipeline-model-parallel-size": "2"},
         world_size=2, names=("--num-layers 3", "--pipeline-model-parallel-size 2")),
    Case("virtual-stage-layers-do-not-divide",
         set_={"--num-layers": "4", "--pipeline-model-parallel-size": "2",
               "--num-layers-per-virtual-pipeline-stage": "3"}, world_size=2,
         names=("--num-layers-per-virtual-pipeline-stage 3", "--num-layers 4")),
    Case("virtual-stages-without-pipeline", set_={"--num-virtual-stages-per-pipeline-rank": "2"},
         names=("--pipeline-model-parallel-size",)),
    Case("both-virtual-stage-flags", set_={"--num-layers": "4", "--pipeline-model-parallel-size": "2",
                                           "--num-layers-per-virtual-pipeline-stage": "1",
                                           "--num-virtual-stages-per-pipeline-rank": "2"}, world_size=2,
         names=("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank")),
    Case("interleaved-microbatches-not-multiple-of-pp",
         set_={"--num-layers": "4", "--pipeline-model-parallel-size": "2",
               "--num-layers-per-virtual-pipeline-stage": "1", "--global-batch-size": "6"}, world_size=2,
         names=("microbatches (3", "--pipeline-model-parallel-size 2")),
    Case("world-not-divisible-by-tp-x-pp", set_={"--tensor-model-parallel-size": "2",
                                                 "--pipeline-model-parallel-size": "2"}, world_size=6,
         names=("world size 6", "--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2")),
    Case("context-parallel-on-cpu", set_={"--context-parallel-size": "2"}, world_size=2,
         names=("--context-parallel-size",),
         marks=pytest.mark.skipif(CUDA, reason="CUDA is present")),
    Case("overlap-param-gather-without-distributed-optimizer",
         extra=("--overlap-grad-reduce", "--overlap-param-gather"),
         names=("--overlap-param-gather", "--use-distributed-optimizer")),
    Case("overlap-param-gather-without-overlap-grad-reduce",
         extra=("--use-distributed-optimizer", "--overlap-param-gather"),
         names=("--overlap-param-gather", "--overlap-grad-reduce")),
    Case("expert-parallel-without-experts", set_={"--expert-model-parallel-size": "2"}, world_size=2,
         names=("--expert-model-parallel-size", "--num-experts")),
    Case("experts-not-divisible-by-ep", set_={"--num-experts": "3", "--expert-model-parallel-size": "2"},
         extra=("--disable-bias-linear",), world_size=2,
         names=("--num-experts 3", "--expert-model-parallel-size 2")),
    Case("ep-does-not-divide-ranks", set_={"--num-experts": "4", "--expert-model-parallel-size": "4"},
         extra=("--disable-bias-linear",), world_size=2, names=("--expert-model-parallel-size 4",)),
    Case("moe-with-bias", set_={"--num-experts": "4"}, names=("--num-experts", "--disable-bias-linear")),
    # Sizes of zero (a ZeroDivisionError traceback before) or beyond any model, and a layer pattern that
    # Megatron-LM's eval would take to an OverflowError: refused before anything divides or allocates.
    Case("zero-query-groups", set_={"--num-query-groups": "0"}, extra=("--group-query-attention",),
         names=("--num-query-groups 0", "must be positive")),
    Case("zero-kv-channels", set_={"--kv-channels": "0"}, names=("--kv-channels 0", "must be positive")),
    Case("zero-moe-router-topk", set_={"--moe-router-topk": "0"}, names=("--moe-router-topk 0",)),
    Case("hidden-size-beyond-any-model", set_={"--hidden-size": str(1 << 21)},
         names=(f"--hidden-size {1 << 21}", "more than any model has")),
    Case("moe-layer-freq-power", set_={"--moe-layer-freq": "[0]*99**99"},
         names=("--moe-layer-freq", "a power")),
    Case("moe-topk-above-experts", set_={"--num-experts": "2", "--moe-router-topk": "3"},
         extra=("--disable-bias-linear",), names=("--moe-router-topk 3", "--num-experts 2")),
    Case("loss-scale-not-positive", set_={"--loss-scale": "0"}, extra=("--fp16",), names=("--loss-scale",)),
    Case("save-retain-interval-without-save", drop=("--save",), set_={"--save-retain-interval": "5"},
         names=("--save-retain-interval", "--save")),
    Case("tensorboard-dir-is-a-file", set_={"--tensorboard-dir": "{file}"}, names=("--tensorboard-dir",)),
    Case("weighted-data-path-one-prefix-missing", drop=("--mock-data",),
         set_={"--data-path": ["0.3", "{tmp}/corpus_a", "0.7", "{tmp}/corpus_b"]},
         names=("--data-path", "corpus_a")),
    # megatron-core reads --split with re.findall(r"[.0-9]+"): "1e-3,1,1" becomes four numbers and an
    # AssertionError traceback when the datasets are built; "nan,1,1" silently becomes 1,1,0.
    Case("split-scientific-notation", set_={"--split": "1e-3,1,1"}, names=("--split",)),
    Case("split-nan", set_={"--split": "nan,1,1"}, names=("--split",)),
    # Caught up front rather than at the first save, after training.
    Case("save-under-a-file", set_={"--save": "{file}/ckpt"}, names=("--save",)),
]}

SUBPROCESS_CASES = ("unknown-flag", "heads-not-divisible-by-tp", "load-is-a-file", "missing-data",
                    "virtual-stage-layers-do-not-divide")


def _scratch(tmp: Path) -> Path:
    """The scratch directory every case starts from: one plain file, nothing else."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / FILE_NAME).write_text("not a directory\n")
    return tmp


def _assert_nothing_created(tmp: Path) -> None:
    assert sorted(p.name for p in tmp.iterdir()) == [FILE_NAME]
    assert (tmp / FILE_NAME).read_text() == "not a directory\n"


def _assert_one_line_naming(stderr: str, names: tuple[str, ...]) -> None:
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and stderr.endswith("\n"), f"expected one line on stderr, got {stderr!r}"
    line = lines[0]
    assert line.startswith("pretrain.py: error: ") and line.strip() != "pretrain.py: error:", line
    for name in names:
        assert name in line, f"{name!r} not named in {line!r}"


@pytest.mark.parametrize("case", [c.param() for c in BAD.values()])
def test_bad_input_in_process(case: Case, tmp_path: Path, capsys) -> None:
    tmp = _scratch(tmp_path)
    argv = build_argv(tmp, case.set_, case.drop, case.extra)
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=case.world_size)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    _assert_one_line_naming(err, case.names)
    _assert_nothing_created(tmp)


# --- the real process, WORLD_SIZE from the environment -------------------------------------------------

@pytest.fixture(scope="module")
def subprocess_runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Start the representative cases all at once (the torch import dominates), then collect them."""
    started = {}
    for case_id in SUBPROCESS_CASES:
        case = BAD[case_id]
        tmp = _scratch(tmp_path_factory.mktemp(case_id))
        env = launch.env()
        env["WORLD_SIZE"] = str(case.world_size)
        argv = [sys.executable, launch.PRETRAIN, *build_argv(tmp, case.set_, case.drop, case.extra)]
        proc = subprocess.Popen(argv, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        started[case_id] = (tmp, argv, proc)
    results = {}
    for case_id, (tmp, argv, proc) in started.items():
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[case_id] = (tmp, subprocess.CompletedProcess(argv, proc.returncode, out, err))
    return results


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_bad_input_subprocess(case_id: str, subprocess_runs) -> None:
    tmp, result = subprocess_runs[case_id]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stdout
    assert result.stdout == ""
    _assert_one_line_naming(result.stderr, BAD[case_id].names)
    _assert_nothing_created(tmp)


def test_subprocess_world_size_comes_from_env(tmp_path: Path) -> None:
    """The same line is fine at WORLD_SIZE=1: the TP error above really came from WORLD_SIZE=2."""
    case = BAD["heads-not-divisible-by-tp"]
    tmp = _scratch(tmp_path)
    argv = build_argv(tmp, {**case.set_, "--tensor-model-parallel-size": "1"}, case.drop, case.extra)
    args = parse_args(argv, world_size=2)
    assert args.world_size == 2 and args.data_parallel_size == 2


# --- good input: Megatron defaults ----------------------------------------------------------------------

def test_valid_megatron_command_line_gets_megatron_defaults(tmp_path: Path, capsys) -> None:
    tmp = _scratch(tmp_path)
    argv = build_argv(tmp, drop=("--max-position-embeddings",),
                      set_={"--hidden-size": "64", "--seq-length": "48", "--save-interval": "5",
                            "--ckpt-keep-last": "2", "--load": "{tmp}/ckpt"})
    args = parse_args(argv, world_size=2)
    assert isinstance(args, argparse.Namespace)
    assert args.ffn_hidden_size == 4 * 64
    assert args.max_position_embeddings == 48 == args.seq_length
    assert args.kv_channels == 64 // 4
    assert args.num_query_groups == args.num_attention_heads == 4
    assert args.world_size == 2 and args.data_parallel_size == 2
    assert args.global_batch_size == 2 * 2 and args.num_microbatches == 1
    assert args.lr_decay_iters == args.train_iters == 10
    assert args.ckpt_format == "torch_dist"
    assert args.split == "969, 30, 1"
    assert args.seed == 1234 and args.log_interval == 100
    if not CUDA:
        assert args.distributed_backend == "gloo"
        assert args.transformer_impl == "local"
    assert capsys.readouterr() == ("", "")
    _assert_nothing_created(tmp)  # neither --save nor --load was created by parsing


def test_explicit_values_are_kept(tmp_path: Path) -> None:
    tmp = _scratch(tmp_path)
    argv = build_argv(tmp, set_={"--ffn-hidden-size": "100", "--max-position-embeddings": "64",
                                 "--global-batch-size": "8", "--lr-decay-iters": "7",
                                 "--distributed-backend": "gloo", "--transformer-impl": "local"})
    args = parse_args(argv, world_size=2)
    assert args.ffn_hidden_size == 100 and args.max_position_embeddings == 64
    assert args.global_batch_size == 8 and args.num_microbatches == 2
    assert args.lr_decay_iters == 7
    assert args.distributed_backend == "gloo" and args.transformer_impl == "local"


def test_weighted_data_path_with_existing_files_parses(tmp_path: Path) -> None:
    tmp = _scratch(tmp_path / "scratch")
    data = tmp_path / "data"
    data.mkdir()
    for prefix in ("a", "b"):
        for suffix in (".bin", ".idx"):
            (data / (prefix + suffix)).write_bytes(b"")
    argv = build_argv(tmp, drop=("--mock-data",),
                      set_={"--data-path": ["0.3", str(data / "a"), "0.7", str(data / "b")]})
    args = parse_args(argv, world_size=1)
    assert args.data_path == ["0.3", str(data / "a"), "0.7", str(data / "b")]
    assert not args.mock_data


def test_engine_flags_get_megatron_defaults(tmp_path: Path) -> None:
    args = parse_args(build_argv(_scratch(tmp_path)), world_size=1)
    assert not args.use_distributed_optimizer and not args.overlap_grad_reduce
    assert not args.overlap_param_gather and not args.accumulate_allreduce_grads_in_fp32
    assert args.ddp_bucket_size is None and args.clip_grad == 1.0 and args.weight_decay == 0.01
    assert (args.adam_beta1, args.adam_beta2, args.adam_eps) == (0.9, 0.999, 1e-8)
    assert args.initial_loss_scale == 2.0**32 and args.min_loss_scale == 1.0 and args.hysteresis == 2
    assert args.loss_scale is None and args.loss_scale_window == 1000
    assert args.pipeline_model_parallel_size == 1 and args.virtual_pipeline_model_parallel_size is None
    assert args.num_experts is None and args.moe_router_topk == 2 and args.expert_model_parallel_size == 1
    assert args.moe_token_dispatcher_type == "allgather" and args.moe_router_load_balancing_type == "aux_loss"
    assert args.moe_aux_loss_coeff == 0.0 and not args.sequence_parallel and args.context_parallel_size == 1


def test_parallel_layout_sizes(tmp_path: Path) -> None:
    """Data-parallel size is what TP x PP leave; virtual stages from either Megatron flag."""
    tmp = _scratch(tmp_path)
    layout = {"--num-layers": "8", "--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
              "--global-batch-size": "8"}
    args = parse_args(build_argv(tmp, {**layout, "--num-layers-per-virtual-pipeline-stage": "2"}),
                      world_size=8)
    assert args.data_parallel_size == 2 and args.virtual_pipeline_model_parallel_size == 2
    assert args.num_microbatches == 2
    args = parse_args(build_argv(tmp, {**layout, "--num-virtual-stages-per-pipeline-rank": "4"}),
                      world_size=8)
    assert args.virtual_pipeline_model_parallel_size == 4
    args = parse_args(build_argv(tmp, {"--num-experts": "4", "--expert-model-parallel-size": "2"},
                                 extra=("--disable-bias-linear",)), world_size=2)
    assert args.data_parallel_size == 2 and args.expert_model_parallel_size == 2


def test_load_missing_directory_is_fine(tmp_path: Path) -> None:
    """Megatron starts from scratch when --load has no checkpoint (unless --exit-on-missing-checkpoint)."""
    tmp = _scratch(tmp_path)
    args = parse_args(build_argv(tmp, set_={"--load": "{tmp}/nothing_here"}), world_size=1)
    assert args.load == str(tmp / "nothing_here")
    _assert_nothing_created(tmp)


def test_zarr_with_distributed_optimizer_is_refused_up_front(tmp_path: Path, capsys) -> None:
    """It used to fail at the first save (exit 4, "offset ... is not on a chunk boundary")."""
    tmp = _scratch(tmp_path)
    argv = build_argv(tmp, set_={"--ckpt-format": "zarr"}, extra=("--use-distributed-optimizer",))
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=2)
    assert exc.value.code == 2
    _assert_one_line_naming(capsys.readouterr().err, ("--ckpt-format zarr", "--use-distributed-optimizer",
                                                      "torch_dist"))
    _assert_nothing_created(tmp)
    import importlib.util
    if importlib.util.find_spec("megatron.core.dist_checkpointing.strategies.base"):  # not in 0.19
        parse_args(build_argv(tmp, set_={"--ckpt-format": "zarr"}), world_size=2)  # zarr alone is fine


def test_context_parallel_needs_a_sequence_that_splits_into_twice_as_many_chunks(monkeypatch):
    """megatron-core's load-balanced split cuts each sequence into 2 x CP chunks (a GPU-only path:
    checked with CUDA pretended, before, a bad length failed at the first batch with a traceback)."""
    from megatron_resil.arguments import distributed
    from megatron_resil.arguments.errors import ArgumentError
    monkeypatch.setattr(distributed, "cuda_available", lambda: True)
    args = argparse.Namespace(tensor_model_parallel_size=1, sequence_parallel=False, context_parallel_size=2,
                              transformer_impl="transformer_engine", seq_length=30, cp_comm_type=["p2p"],
                              hierarchical_context_parallel_sizes=None)
    with pytest.raises(ArgumentError, match="--seq-length 30 divisible by 4"):
        distributed._validate_sequence_and_context(args)
    args.seq_length = 32
    distributed._validate_sequence_and_context(args)


def test_every_flag_of_pretrain_is_a_row_of_one_table() -> None:
    """One way to declare a flag: every option pretrain.py takes is a flag_table.Flag row of its concern's
    FLAGS (the parser's own --help and --check-args-only aside), so the same rows build the parser and
    feed the start-up checks."""
    from megatron_resil.arguments import FLAGS, build_parser

    rows = {flag.name for flag in FLAGS}
    options = {option for action in build_parser()._actions for option in action.option_strings}
    assert options - rows == {"-h", "--help", "--check-args-only"}
    assert len(rows) == len(FLAGS)  # each flag once
