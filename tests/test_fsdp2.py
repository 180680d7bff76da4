"""torch FSDP2 (--use-torch-fsdp2), as Megatron-LM's functional tests gpt3_mcore_*_fsdp2_resume_torch_dist run
it: megatron-core's TorchFullyShardedDataParallel in place of its DDP, under bf16, saved with torch_dist and
--async-save, resumed. Here on CPU over gloo, two data-parallel ranks each holding half of every weight.

One job trains 4 iterations and saves at 2 and 4; a second job starts from a copy of its iteration-2
checkpoint and must print the same loss and grad norm at iterations 3 and 4 and write a bitwise-identical
iteration-4 checkpoint (weights, Adam moments, fp32 main parameters, RNG states). The checkpoint itself
shows the sharding: every weight is stored as two halves, one written by each rank. Megatron-LM's checks
of the flag refuse what it refuses, in one line.
"""

from __future__ import annotations

import shutil

import pytest
from torch.distributed.checkpoint import FileSystemReader

from megatron_resil.arguments import parse_args

try:
    from tests import launch  # tests/ is a package
    from tests.test_resume import _assert_checkpoints_identical
except ImportError:  # tests/ on sys.path instead
    import launch
    from test_resume import _assert_checkpoints_identical

FSDP2 = ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--no-gradient-accumulation-fusion"]
TRACKER = "latest_checkpointed_iteration.txt"


def _base(*extra: str) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "4", *FSDP2, *extra]


def _run_ok(args: list[str]) -> str:
    result = launch.run(args)
    assert result.returncode == 0, f"run failed ({result.returncode}):\n{result.stdout[-6000:]}"
    return result.stdout


@pytest.mark.slow
@pytest.mark.compat
def test_fsdp2_run_resumed_from_its_checkpoint_continues_exactly_as_the_uninterrupted_one(tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    # As the functional tests: bf16, async saves, the parameter norm and the gradient's zeros logged.
    job = ["--bf16", "--async-save", "--save-interval", "2", "--log-params-norm", "--log-num-zeros-in-grad"]
    out_whole = _run_ok(_base(*job, "--save", str(whole)))

    # Each of the two ranks wrote its own half of every weight: FSDP2 sharded them.
    metadata = FileSystemReader(str(whole / "iter_0000002")).read_metadata().state_dict_metadata
    embedding = metadata["embedding.word_embeddings.weight"]
    rows = embedding.size[0]
    assert sorted((chunk.offsets[0], chunk.sizes[0]) for chunk in embedding.chunks) == \
        [(0, rows // 2), (rows // 2, rows // 2)], embedding.chunks

    resumed.mkdir()
    shutil.copytree(whole / "iter_0000002", resumed / "iter_0000002")
    (resumed / TRACKER).write_text("2")
    out_resumed = _run_ok(_base(*job, "--save", str(resumed), "--load", str(resumed)))
    assert "successfully loaded checkpoint" in out_resumed and "at iteration 2" in out_resumed

    whole_losses, resumed_losses = launch.losses(out_whole), launch.losses(out_resumed)
    assert sorted(whole_losses) == [1, 2, 3, 4] and sorted(resumed_losses) == [3, 4]
    assert {i: whole_losses[i] for i in (3, 4)} == resumed_losses
    _assert_checkpoints_identical(whole / "iter_0000004", resumed / "iter_0000004", tmp_path / "scratch")


def test_no_reshard_after_forward_is_megatron_lms_zero2_switch():
    assert parse_args(_base(), world_size=2).torch_fsdp2_reshard_after_forward
    args = parse_args(_base("--torch-fsdp2-no-reshard-after-forward"), world_size=2)
    assert args.use_torch_fsdp2 and not args.torch_fsdp2_reshard_after_forward


@pytest.mark.parametrize("flags, named", [
    (("--pipeline-model-parallel-size", "2"), "pipeline parallelism"),
    (("--use-distributed-optimizer",), "--use-distributed-optimizer"),
    (("--fp16",), "--fp16"),
    (("--ckpt-format", "zarr"), "--ckpt-format torch_dist"),
])
def test_what_megatron_lm_refuses_with_fsdp2_is_refused_in_one_line(flags, named, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(_base(*flags), world_size=2)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "--use-torch-fsdp2" in lines[0] and named in lines[0], lines


@pytest.mark.parametrize("dropped, named", [
    ("--untie-embeddings-and-output-weights", "--untie-embeddings-and-output-weights"),
    ("--no-gradient-accumulation-fusion", "--no-gradient-accumulation-fusion"),
])
def test_fsdp2_needs_what_megatron_lm_needs(dropped, named, capsys):
    argv = [flag for flag in _base() if flag != dropped]
    with pytest.raises(SystemExit) as stop:
        parse_args(argv, world_size=2)
    assert stop.value.code == 2
    line, = capsys.readouterr().err.splitlines()
    assert "--use-torch-fsdp2" in line and named in line


def test_cuda_device_max_connections_of_one_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(SystemExit):
        parse_args(_base(), world_size=2)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in capsys.readouterr().err
