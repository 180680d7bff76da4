"""Runs under scripts/run_local.sh with warm reserves (--inprocess-active-world-size below the world size):
3 processes, 2 of them training, no requeue; shared by the tests of warm reserves and of same-step
recovery."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from megatron_resil.events import EVENT_LOG_NAME
from megatron_resil.rank_process import descendants_of

try:
    from tests import launch  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

RUN_LOCAL = launch.REPO / "scripts" / "run_local.sh"
# Timeouts that leave a loaded 2-core host room (a kill is found by NVRx's monitor process, not by these).
INPROCESS = ["--inprocess-restart", "--inprocess-active-world-size", "2", "--inprocess-granularity", "rank",
             "--inprocess-heartbeat-interval", "5", "--inprocess-heartbeat-timeout", "60",
             "--inprocess-soft-timeout", "60", "--inprocess-hard-timeout", "90",
             "--inprocess-barrier-timeout", "180", "--inprocess-completion-timeout", "180"]


def args(save: Path, *extra: str) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "10", "--save", str(save),
            "--load", str(save), "--save-interval", "4", *extra]


def events(save: Path) -> list[dict]:
    path = save / EVENT_LOG_NAME
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@contextlib.contextmanager
def running(save: Path, log: Path, max_restarts: int, extra: list[str] = (),
            env: dict[str, str] | None = None, processes: int = 3) -> Iterator[subprocess.Popen]:
    """run_local.sh with 3 processes (or `processes`), 2 of them training; on the way out (a failed
    assertion), it and every process below it are killed: the workers are in sessions of their own. `env`:
    added to the processes'."""
    env = {**launch.env(standby=False), "NPROC_PER_NODE": str(processes), "MAX_RESTARTS": str(max_restarts),
           "MAX_REQUEUES": "0", "RESIL_PYTHON": sys.executable, **(env or {})}
    with open(log, "w") as out:
        run = subprocess.Popen(["bash", str(RUN_LOCAL), *args(save, *INPROCESS, *extra)], env=env,
                               cwd=launch.REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield run
    finally:
        for pid in {run.pid} | descendants_of(run.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run.wait()


def wait_for(run: subprocess.Popen, log: Path, text: str) -> None:
    """Until `text` is in the log, polling it: the event, however long it takes."""
    while text not in log.read_text():
        assert run.poll() is None, log.read_text()[-4000:]
        time.sleep(0.2)
