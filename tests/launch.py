"""Starting real pretrain.py runs under torchrun on loopback, and reading their Megatron-format logs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = str(REPO / "pretrain.py")

TINY_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "32", "--max-position-embeddings", "32",
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
TINY_TRAINING = ["--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4",
                 "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
                 "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1"]

_LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update({"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
              "MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1"})
    return e


def torchrun_cmd(args: list[str], nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), PRETRAIN, *args]


def run(args: list[str], nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run to completion; stdout and stderr together in .stdout."""
    return subprocess.run(torchrun_cmd(args, nproc), env=env(), cwd=REPO, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start(args: list[str], nproc: int = 2, log_path: Path | None = None) -> subprocess.Popen:
    """Start torchrun in its own session, output to a file. Signalling that group reaches only the
    agent (torchrun puts each rank in a session of its own); the agent forwards SIGTERM to the ranks.
    To kill the ranks too, kill them by pid (see test_crash_consistency._kill_run)."""
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    return subprocess.Popen(torchrun_cmd(args, nproc), env=env(), cwd=REPO, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def run_single(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """pretrain.py as a plain process (argument errors are caught before torch.distributed starts)."""
    return subprocess.run([sys.executable, PRETRAIN, *args], env=env(), cwd=REPO, timeout=timeout,
                          capture_output=True, text=True)


def losses(output: str) -> dict[int, tuple[str, str]]:
    """iteration -> (lm loss, grad norm) as printed, so comparisons are exact to the printed digits."""
    return {int(m.group(1)): (m.group(2), m.group(3)) for m in _LOSS_LINE.finditer(output)}
