"""A standby that imports megatron-core ahead (megatron_resil/launch/standby_warmup.py): the ranks of the run
it imported for are forked with megatron-core and their patches in memory and say what a rank that imported
for itself says; a run whose patch records differ is refused with one line and imports for itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from megatron_resil.launch import standby
from tests import launch

pytestmark = [pytest.mark.slow, pytest.mark.compat]

RUN = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "3"]


def _run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    out = subprocess.run(launch.torchrun_cmd(args, nproc=1), env=env, cwd=launch.REPO, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "iteration        3/" in out.stdout
    return out


def _lines(out: subprocess.CompletedProcess, prefix: str) -> list[str]:
    return [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith(prefix)]


def _startup(save) -> dict:
    events = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines()]
    (record,) = [e for e in events if e["event"] == "restart_phases"]
    return record["details"]


def test_the_first_runs_ranks_start_with_megatron_core_and_another_runs_import_it_themselves(tmp_path):
    name = f"tests-warm-{os.getpid()}"
    log = tmp_path / "standby.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "megatron_resil.launch.standby", "--name", name,
                                   "--import-megatron-core"], env=launch.env(standby=False), cwd=launch.REPO,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not standby.ping(name):
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        env = {**launch.env(standby=False), standby.ENV: name}

        first = _run([*RUN, "--save", str(tmp_path / "a")], env)
        assert "megatron-core imported ahead" in log.read_text(), log.read_text()
        assert "and its mock data's datasets built;" in log.read_text(), log.read_text()
        assert _lines(first, "[resil] standby:") == []
        details = _startup(tmp_path / "a")
        assert details["standby"] is True and details["megatron_core_ahead"] is True, details
        assert details["datasets_kept"] is True, details  # the standby's, inherited: none built here
        # The patch lines the standby kept quiet are said by the rank, as a rank of its own says them.
        cold = _run([*RUN, "--save", str(tmp_path / "cold")], launch.env(standby=False))
        assert _lines(first, "[resil] patch:") == _lines(cold, "[resil] patch:")
        assert _startup(tmp_path / "cold")["megatron_core_ahead"] is False
        assert _startup(tmp_path / "cold")["datasets_kept"] is False
        assert launch.losses(first.stdout) == launch.losses(cold.stdout) != {}

        # The same patch records, other data (another seed): forked, but the datasets are its own.
        reseeded = _run([*RUN, "--save", str(tmp_path / "seed"), "--seed", "7"], env)
        details = _startup(tmp_path / "seed")
        assert details["megatron_core_ahead"] is True and details["datasets_kept"] is False, details
        reseeded_cold = _run([*RUN, "--save", str(tmp_path / "seed_cold"), "--seed", "7"],
                             launch.env(standby=False))
        reseeded_losses = launch.losses(reseeded.stdout)
        assert reseeded_losses == launch.losses(reseeded_cold.stdout) != launch.losses(cold.stdout)

        # --tensorboard-dir needs megatron-core's timers to import TensorBoard: another set of records.
        other = _run([*RUN, "--save", str(tmp_path / "b"), "--tensorboard-dir", str(tmp_path / "tb")], env)
        (line,) = _lines(other, "[resil] standby:")
        assert line.startswith(f"[resil] standby: {standby.ENV}={name} not used: it imported megatron-core "
                               "for another run's patch records (TensorBoard not imported by "), line
        assert line.endswith("differs); this rank imports torch itself"), line
        assert _startup(tmp_path / "b")["standby"] is False
    finally:
        server.terminate()
        server.wait(timeout=30)
