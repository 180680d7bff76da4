"""Megatron-LM's Muon: `--optimizer muon` is megatron-core's TensorParallelMuon on the 2-D weights (Adam on
the rest); with --use-distributed-optimizer, or by its deprecated name dist_muon, megatron-core's layer-wise
distributed optimizer. Where the stack has it (megatron-core 0.19 and emerging_optimizers, which needs
Python 3.12: the second lane) a tiny MoE with expert parallelism 2 trains with it, saves through the
torch_dist global tier, and a job resumed from the saved iteration prints the same losses and grad norms
as the uninterrupted one, which it cannot without Muon's momentum (saved in the checkpoint); the node-local
tier resumes the layer-wise optimizer the same way. Where the stack lacks it (the first lane) the command
line is refused in one line naming what is needed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import sys

import pytest
from packaging.version import Version
from torch.distributed.checkpoint import FileSystemReader

from megatron_resil.arguments import parse_args
from megatron_resil.arguments.training import muon_support_missing

try:
    from tests import launch
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

from tests.test_resume import TRACKER, _iter_dir

MISSING = muon_support_missing()
needs_muon = pytest.mark.skipif(bool(MISSING), reason=f"megatron-core's Muon is not installed ({MISSING}): "
                                                      "the first lane refuses --optimizer muon")

N, K = 4, 2
# Megatron-LM's gpt3_moe_mcore_te_ep8_resume_torch_dist_*muon configs, shrunk: MoE with the allgather
# dispatcher, bf16, Muon's flags as they give them.
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--disable-bias-linear", "--moe-token-dispatcher-type", "allgather", "--moe-router-dtype", "fp32",
       "--bf16", "--global-batch-size", "8"]
MUON = ["--optimizer", "muon", "--muon-momentum", "0.9", "--muon-extra-scale-factor", "0.2",
        "--muon-scale-mode", "spectral"]
MODES = {
    # ..._torch_dist_muon: plain Muon, each rank stepping every parameter
    "muon": [*MUON, "--check-weight-hash-across-dp-replicas-interval", "1"],
    # ..._torch_dist_dist_muon_param_layout: the layer-wise distributed optimizer on shard-aligned DDP
    # buffers (whole Muon matrices per data-parallel shard), the other parameters in a distributed optimizer
    "distributed": [*MUON, "--use-distributed-optimizer"],
    # ..._torch_dist_dist_muon: the layer-wise optimizer on Megatron-LM's legacy layout (each rank steps
    # whole parameters of its own and all-gathers them in uneven pieces, which gloo needs padded), here by
    # the deprecated name
    "legacy_layout": ["--optimizer", "dist_muon", "--muon-momentum", "0.9", "--muon-extra-scale-factor",
                      "0.2", "--no-use-layer-wise-param-layout"],
}
def _argv(*extra: str) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(N), *extra]


def _run_ok(args: list[str]) -> str:
    result = launch.run(args, nproc=2, timeout=240)
    assert result.returncode == 0, f"run failed ({result.returncode}):\n{result.stdout[-6000:]}"
    return result.stdout


# Muon exists on the second lane only (megatron-core 0.19, emerging_optimizers on Python 3.12), so each of
# these runs there (compat); on the first they skip. The legacy layout is the one whose all-gather of
# uneven pieces needs patches/megatron_core_cpu.py's padding on gloo.
@pytest.mark.slow
@pytest.mark.compat
@needs_muon
@pytest.mark.parametrize("mode", list(MODES))
def test_muon_saved_and_resumed_through_torch_dist_continues_exactly(mode, tmp_path):
    common = _argv(*MOE, *MODES[mode], "--save-interval", str(K))
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = launch.losses(_run_ok([*common, "--save", str(full_dir)]))
    assert sorted(full) == list(range(1, N + 1))

    saved = FileSystemReader(str(_iter_dir(full_dir, K))).read_metadata().state_dict_metadata
    momentum = sorted(key for key in saved if ".optimizer.state.momentum_buffer." in f".{key}")
    assert any("experts" in k for k in momentum) and any("linear_qkv" in k for k in momentum), momentum

    resumed_dir.mkdir()
    shutil.copytree(_iter_dir(full_dir, K), _iter_dir(resumed_dir, K))
    (resumed_dir / TRACKER).write_text(f"{K}\n")
    out = _run_ok([*common, "--save", str(resumed_dir), "--load", str(resumed_dir)])
    assert f"at iteration {K}" in out
    resumed = launch.losses(out)
    assert sorted(resumed) == list(range(K + 1, N + 1)), out[-3000:]
    assert resumed == {i: full[i] for i in resumed}


@pytest.mark.compat
@needs_muon
def test_muon_arguments_take_megatron_lms_meanings_and_defaults(capsys):
    """dist_muon and --use-distributed-optimizer both mean the layer-wise optimizer (Megatron-LM turns the
    plain distributed optimizer off for it); Megatron-LM's defaults reach OptimizerConfig where
    megatron-core's own differ (momentum 0.9, not 0.95; TP mode duplicated, not blockwise)."""
    from megatron_resil.optimizer import optimizer_config

    args = parse_args(_argv("--optimizer", "dist_muon"), world_size=2)
    assert (args.optimizer, args.use_layer_wise_distributed_optimizer, args.use_distributed_optimizer) == \
        ("muon", True, False)
    assert capsys.readouterr().err.splitlines() == [
        "pretrain.py: warning: --optimizer dist_muon is deprecated (as in Megatron-LM): use --optimizer muon "
        "--use-distributed-optimizer instead"]
    args = parse_args(_argv("--optimizer", "muon", "--use-distributed-optimizer"), world_size=2)
    assert (args.use_layer_wise_distributed_optimizer, args.use_distributed_optimizer) == (True, False)
    config = optimizer_config(parse_args(_argv("--optimizer", "muon", "--muon-extra-scale-factor", "0.2"),
                                         world_size=2))
    assert (config.optimizer, config.use_layer_wise_distributed_optimizer) == ("muon", False)
    assert (config.muon_momentum, config.muon_tp_mode, config.muon_extra_scale_factor,
            config.muon_split_qkv) == (0.9, "duplicated", 0.2, True)


@pytest.mark.compat
@needs_muon
@pytest.mark.parametrize("flags, start", [
    (("--muon-coefficient-type", "cubic"),
     "--muon-coefficient-type cubic: the installed emerging_optimizers has simple, quintic"),
    (("--muon-scalar-optimizer", "lion", "--use-distributed-optimizer"),  # megatron-core can train, not save
     "--muon-scalar-optimizer lion with --use-distributed-optimizer: "),
    (("--fp16",), "--optimizer muon does not support --fp16"),
    (("--ckpt-format", "zarr"), "--optimizer muon with --ckpt-format zarr: "),
])
def test_what_megatron_cores_muon_cannot_do_is_refused_in_one_line(flags, start, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(_argv("--optimizer", "muon", *flags), world_size=2)
    assert stop.value.code == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith(f"pretrain.py: error: {start}"), line


@pytest.mark.skipif(not MISSING, reason="this stack has megatron-core 0.19 and emerging_optimizers: "
                                        "--optimizer muon is accepted here")
@pytest.mark.parametrize("name", ["muon", "dist_muon"])
def test_muon_is_refused_in_one_line_naming_what_is_needed(name, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(_argv("--optimizer", name, "--muon-momentum", "0.9"), world_size=2)
    assert stop.value.code == 2
    core = importlib.metadata.version("megatron-core")
    lacking = [*([f"installed: megatron-core {core}"] if Version(core) < Version("0.19") else []),
               *(["emerging_optimizers is not installed"] if importlib.util.find_spec("emerging_optimizers")
                 is None else []),
               f"Python {sys.version_info.major}.{sys.version_info.minor}"]
    assert capsys.readouterr().err.splitlines() == [
        f"pretrain.py: error: --optimizer {name} needs megatron-core 0.19 or later and the "
        f"emerging_optimizers package, which needs Python 3.12 or later ({'; '.join(lacking)}): pip install "
        "emerging-optimizers==0.3.0 on Python 3.12, or use adam or sgd"]


@pytest.mark.slow
@pytest.mark.compat
@needs_muon
def test_layer_wise_muon_resumes_from_the_node_local_tier(tmp_path):
    """The node-local tier (--non-persistent-ckpt-type local) keeps the layer-wise optimizer's state too:
    a job whose persistent directory is empty resumes from the local checkpoint and continues as the
    uninterrupted job did (iteration K+2 on is where a lost momentum would show)."""
    n, k = 5, 3
    local = ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir",
             str(tmp_path / "local"), "--non-persistent-save-interval", str(k), "--save-interval", "100"]
    common = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(n), *MOE,
              *MODES["distributed"], *local]
    full = launch.losses(_run_ok([*common, "--save", str(tmp_path / "first")]))
    out = _run_ok([*common, "--save", str(tmp_path / "second"), "--load", str(tmp_path / "second")])
    assert f"at iteration {k} (local tier" in out, out[-3000:]
    resumed = launch.losses(out)
    assert sorted(resumed) == list(range(k + 1, n + 1)), out[-3000:]
    assert resumed == {i: full[i] for i in resumed}
