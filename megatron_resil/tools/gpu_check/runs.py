"""Launching pretrain.py (or the bare megatron-core loop) under torchrun, world size 1, for the GPU check:
each launch bounded in time, its output kept in a log file, and its whole process tree (agent, rank, async
writer) killed with SIGKILL on request or at its time limit. Also reads what a run left: its Megatron-format
loss lines and its event log."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_resil import rank_process

REPO = Path(__file__).resolve().parents[3]
PRETRAIN = REPO / "pretrain.py"
BARE_LOOP = REPO / "benchmarks" / "bare_mcore_loop.py"

_LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): (\S+) \|"
                        r".*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")


@dataclass
class Run:
    """A finished (or killed) launch: torchrun's exit code (None: killed at its time limit), its output."""
    name: str
    returncode: int | None
    output: str
    seconds: float
    log: Path

    def tail(self, chars: int = 600) -> str:
        return self.output[-chars:].strip() or "(no output)"

    def rank_exit_code(self) -> int | None:
        """The rank's own exit code as torchrun reports a failed rank ("exitcode  : 17"); 0 when all went
        well; None when neither can be told."""
        if self.returncode == 0:
            return 0
        found = re.findall(r"exitcode\s*:\s*(-?\d+)", self.output)
        return int(found[-1]) if found else None


class Launcher:
    """Starts runs with one environment; their logs go under `log_dir`."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)

    def command(self, args: list[str], script: Path = PRETRAIN, wrapper: tuple[str, ...] = ()) -> list[str]:
        """`wrapper`: what runs torchrun (a standby: `python -m megatron_resil.launch.standby --`)."""
        return [*wrapper, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", "1", str(script), *args]

    def start(self, name: str, args: list[str], script: Path = PRETRAIN,
              wrapper: tuple[str, ...] = ()) -> tuple[subprocess.Popen, Path]:
        log = self.log_dir / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(self.command(args, script, wrapper), env=self.env, cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return proc, log

    def run(self, name: str, args: list[str], timeout: float, script: Path = PRETRAIN,
            wrapper: tuple[str, ...] = ()) -> Run:
        began = time.monotonic()
        proc, log = self.start(name, args, script, wrapper)
        try:
            code = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            code = None
        return Run(name, code, log.read_text(errors="replace"), time.monotonic() - began, log)


def python_probe(env: dict[str, str], code: str, timeout: float = 120.0) -> dict:
    """Run `code` (which prints one JSON object) in a fresh interpreter with `env`; {"error": ...} if not."""
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]}
    return json.loads(lines[-1])


# ---- killing a run ---------------------------------------------------------------------------------
def _groups_of_tree(root: int) -> set[int]:
    """Process groups of `root` and its descendants: torchrun starts its rank in a session of its own, and
    the rank's async writer lives in the rank's group."""
    table = rank_process.processes()
    tree = {root} | rank_process.descendants_of(root)
    return {table[pid].group for pid in tree if pid in table} - {os.getpgrp(), 0, 1}


def kill_tree(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGKILL every process of the run at once (the agent gets no say) and wait until none is left."""
    groups = _groups_of_tree(proc.pid)
    deadline = time.monotonic() + timeout
    while True:
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        alive = [pid for pid, stat in rank_process.processes().items()
                 if stat.group in groups and stat.state not in ("Z", "X")]
        if not alive or time.monotonic() > deadline:
            return


# ---- what a run left ---------------------------------------------------------------------------------
def losses(output: str) -> dict[int, tuple[str, str]]:
    """iteration -> (lm loss, grad norm) as printed: compared as text, exact to the printed digits."""
    return {int(m.group(1)): (m.group(3), m.group(4)) for m in _LOSS_LINE.finditer(output)}


def iteration_ms(output: str) -> dict[int, float]:
    """iteration -> the log line's elapsed time per iteration (ms), averaged over its log interval."""
    return {int(m.group(1)): float(m.group(2)) for m in _LOSS_LINE.finditer(output)}


class EventTail:
    """A running job's event log, read as it grows: each call parses only the lines appended since the last
    (polled every few milliseconds without taking a core from the run)."""

    def __init__(self, save_dir: Path) -> None:
        self.path = save_dir / "events.jsonl"
        self.offset = 0
        self.seen: list[dict] = []

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.seen
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits for the next call
        self.offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            try:
                self.seen.append(json.loads(line))
            except ValueError:
                pass
        return self.seen


def events(save_dir: Path) -> list[dict]:
    path = save_dir / "events.jsonl"
    if not path.exists():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            pass  # a line cut short by a SIGKILL
    return found


def named(log: list[dict], event: str) -> list[dict]:
    return [e for e in log if e.get("event") == event]
