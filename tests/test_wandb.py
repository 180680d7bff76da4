"""Weights & Biases (--wandb-project and its flags) as Megatron-LM logs to it: a real run in wandb's offline
mode, its .wandb file read back record by record (the LevelDB-style log wandb writes, each record's CRC
checked, each parsed with wandb's own protobuf classes); and the refusals where W&B cannot run."""

from __future__ import annotations

import glob
import json
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_resil.arguments import parse_args

try:
    from tests import launch  # tests/ is a package
except ImportError:  # tests/ on sys.path instead
    import launch

wandb_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="wandb is not installed "
                                "(pip install -e .[test])")

# A .wandb file: a 7-byte header, then records in 32 KiB blocks, each record (or fragment) behind a 7-byte
# header: CRC-32 of its type byte and data, length, type (1 full, 2 first, 3 middle, 4 last).
_BLOCK, _FULL, _LAST = 32768, 1, 4


def wandb_records(path: Path) -> list:
    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), data[:7]
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (crc, length, kind) == (0, 0, 0):
            break
        chunk = data[pos + 7:pos + 7 + length]
        assert len(chunk) == length and zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"at {pos}"
        pending += chunk
        pos += 7 + length
        if kind in (_FULL, _LAST):
            record = wandb_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _history(records: list) -> dict[int, dict]:
    """step -> {metric: value} (a step logged in several calls is one row of wandb's history)."""
    rows: dict[int, dict] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            rows.setdefault(record.history.step.num, {}).update(row)
    return rows


def _wandb_env(tmp: Path) -> dict[str, str]:
    """No network (offline), and wandb's own directories (settings, cache, data) under the test's tmp."""
    env = launch.env()
    env.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                "WANDB_CONFIG_DIR": str(tmp / "wandb-config"), "WANDB_CACHE_DIR": str(tmp / "wandb-cache"),
                "WANDB_DATA_DIR": str(tmp / "wandb-data"),
                "WANDB_DISABLE_GIT": "true", "SLURM_JOB_NAME": "wandb-test"})
    env.pop("WANDB_DIR", None)
    env.pop("WANDB_API_KEY", None)
    return env


@pytest.mark.slow  # first lane only (CI time): the second lane's tier runs this file's fast tests
def test_an_offline_run_logs_megatron_lms_metrics_at_its_iterations_under_the_named_dir(tmp_path):
    """2 ranks, 4 iterations, validation at 2 and 4: the run (named, in its project and entity, every
    argument in its config) is under --wandb-save-dir only, and its history has Megatron-LM's names at the
    iterations, with the losses the iteration lines print."""
    save_dir, tb = tmp_path / "wandb-here", tmp_path / "tb"
    args = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "4", "--eval-interval", "2",
            "--tensorboard-dir", str(tb), "--log-timers-to-tensorboard", "--timing-log-level", "1",
            "--log-throughput", "--wandb-project", "resil-tests", "--wandb-exp-name", "tiny-run",
            "--wandb-entity", "a-team", "--wandb-save-dir", str(save_dir)]
    before = set(os.listdir(launch.REPO))
    result = subprocess.run(launch.torchrun_cmd(args, 2), env=_wandb_env(tmp_path), cwd=launch.REPO,
                            timeout=240, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert result.returncode == 0, result.stdout[-4000:]
    assert set(os.listdir(launch.REPO)) == before  # no ./wandb of the working directory

    (run_file,) = glob.glob(str(save_dir / "wandb" / "offline-run-*" / "run-*.wandb"))  # one rank logs
    written = {p for p in tmp_path.rglob("*") if p.is_file()}
    outside = {p for p in written if not p.is_relative_to(save_dir) and not p.is_relative_to(tb)
               and not p.name.startswith(".") and p.parts[len(tmp_path.parts)] not in
               ("wandb-config", "wandb-cache", "wandb-data")}
    assert not outside, outside

    records = wandb_records(Path(run_file))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, run.entity) == ("resil-tests", "tiny-run", "a-team")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["num_layers"] == 2 and config["wandb_save_dir"] == str(save_dir), config
    assert config["world_size"] == 2 and config["train_iters"] == 4
    updates = {i.key: json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "config"
               for i in r.config.update}
    assert updates.get("slurm_job_name") == "wandb-test", updates  # as Megatron-LM adds it after set-up

    history = _history(records)
    assert sorted(history) == [1, 2, 3, 4], sorted(history)
    printed = {it: float(loss) for it, (loss, _) in launch.losses(result.stdout).items()}
    every_step = {"lm loss", "learning-rate", "batch-size", "samples vs steps", "grad-norm", "loss-scale",
                  "iteration-time", "throughput", "forward-backward-time", "optimizer-time"}
    for step, row in history.items():
        assert every_step <= set(row), (step, sorted(row))
        assert row["batch-size"] == 4 and row["samples vs steps"] == 4 * step, row
        assert row["lm loss"] == pytest.approx(printed[step], rel=1e-5), (row["lm loss"], printed[step])
        assert ("lm loss validation" in row) == (step % 2 == 0), (step, sorted(row))
        # what Megatron-LM writes to TensorBoard only, or not at all here
        assert not {k for k in row if k.endswith(" vs samples") or k.startswith("mem-") or "ppl" in k
                    or k == "world-size"}, sorted(row)
    printed_lr = {int(it): float(lr) for it, lr in
                  re.findall(r"iteration\s+(\d+)/.*?\| learning rate: (\S+) \|", result.stdout)}
    assert {step: pytest.approx(lr, rel=1e-5) for step, lr in printed_lr.items()} == \
        {step: row["learning-rate"] for step, row in history.items()}  # warm-up, then the decay


_BASE = [*launch.TINY_MODEL, "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data"]


@pytest.mark.parametrize("extra, hide, names", [
    (["--wandb-project", "p", "--save", "{tmp}/ckpt"], True, ("--wandb-project", "pip install")),
    (["--wandb-project", "p"], False, ("--wandb-project", "--wandb-save-dir", "--save")),
    (["--wandb-project", "p", "--save", "{tmp}/ckpt", "--wandb-exp-name", ""], False, ("--wandb-exp-name",)),
    (["--wandb-project", "p", "--wandb-save-dir", "{tmp}/a_file"], False, ("--wandb-save-dir",)),
], ids=["wandb-not-installed", "nowhere-to-write", "empty-exp-name", "save-dir-is-a-file"])
def test_what_wandb_cannot_do_is_refused_in_one_line(extra, hide, names, tmp_path, monkeypatch, capsys):
    if hide:  # as where the package is not installed: find_spec() says None and an import fails
        monkeypatch.setitem(sys.modules, "wandb", None)
    (tmp_path / "a_file").write_text("x\n")
    with pytest.raises(SystemExit) as exc:
        parse_args([*_BASE, *(a.format(tmp=tmp_path) for a in extra)], world_size=1)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("pretrain.py: error: ") and all(name in err for name in names), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing created


def test_an_empty_project_means_no_wandb_as_in_megatron_lm():
    args = parse_args([*_BASE, "--wandb-project", ""], world_size=1)
    assert args.wandb_project is None


def test_without_tensorboard_dir_wandb_gets_what_megatron_lm_logs_outside_its_tensorboard_block(
        tmp_path, monkeypatch):
    """Megatron-LM logs the per-step scalars and the validation loss to W&B inside its TensorBoard block:
    without --tensorboard-dir a run gets only the iteration time and the MTP losses there. One process
    (rank 0 of 1: the last rank), the logger given two steps' reports as training.StepReport has them."""
    from megatron_resil.train_log import TrainLogger

    for name, value in {**_wandb_env(tmp_path), "WANDB_CONSOLE": "off"}.items():
        if name.startswith("WANDB_"):
            monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("RANK", "0")
    args = parse_args([*_BASE, "--wandb-project", "p", "--save", str(tmp_path / "ckpt"),
                       "--log-interval", "2", "--log-timers-to-tensorboard"], world_size=1)
    logger = TrainLogger(args)
    for iteration in (1, 2):
        report = SimpleNamespace(loss=5.0 - iteration, grad_norm=1.0, updated=True, loss_scale=1.0,
                                 global_batch_size=2, num_zeros=None, params_norm=None,
                                 moe_losses={"load_balancing_loss": 0.5, "mtp_1 loss": 4.5 - iteration})
        logger.training_step(iteration, 2 * iteration, 1e-3, report)
    logger.validation(2, 3.25, 4)
    logger.close()
    import wandb

    wandb.teardown()  # its service closes the run's file (wandb.finish() may return before it is flushed)
    (run_file,) = (tmp_path / "ckpt" / "wandb").glob("wandb/offline-run-*/run-*.wandb")  # <save>/wandb
    history = {step: {k for k in row if not k.startswith("_")} for step, row in
               _history(wandb_records(run_file)).items()}
    assert history == {1: {"mtp_1 loss"}, 2: {"mtp_1 loss", "iteration-time"}}, history
