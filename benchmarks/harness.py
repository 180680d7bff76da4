"""What the benchmarks share: starting their workers under torchrun on loopback, the worker's prologue (the
patches, the command line, megatron-core's groups, the engine pretrain.py builds), a time taken between
barriers, the bare megatron-core step they compare train_step with, and median (min-max) figures.

Imported by the benchmark scripts as `harness` (their directory is on the path when they run). Nothing
heavy is imported at module level: megatron-core's checkpoint writer re-imports a worker's script, and so
this module, in the processes it spawns.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the benchmarks import megatron_resil from this checkout
    sys.path.insert(0, str(REPO))
WORKER = "--worker"  # the hidden flag a benchmark's own workers are started with
OUT = "--out"  # where rank 0 of the workers writes its results (JSON)


# ---- launching -------------------------------------------------------------------------------------

def child_env(**extra: str) -> dict[str, str]:
    """The environment of every launch: gloo on loopback, one OpenMP thread per rank (torchrun's own default
    for several ranks), warnings off, output unbuffered, this checkout first on the path."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH")
                                     else "")
    return env


def torchrun(nproc: int) -> list[str]:
    """torch.distributed.run on this machine alone, `nproc` ranks; the script and its arguments follow."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc)]


def run_workers(script: str, nproc: int, args: Sequence[str] = (), *, timeout: float | None = None,
                quiet: bool = False) -> dict:
    """`script --worker --out FILE ARGS` on `nproc` ranks under torchrun; what rank 0 wrote to FILE (see
    `write_results`). A failed launch ends the benchmark with the command in its message."""
    with tempfile.TemporaryDirectory(prefix="bench_results_") as scratch:
        out = os.path.join(scratch, "results.json")
        cmd = [*torchrun(nproc), os.path.abspath(script), WORKER, OUT, out, *args]
        done = subprocess.run(cmd, env=child_env(), cwd=REPO, timeout=timeout,
                              stdout=subprocess.DEVNULL if quiet else None)
        if done.returncode != 0:
            raise SystemExit(f"benchmark workers failed ({done.returncode}): {' '.join(cmd)}")
        with open(out) as f:
            return json.load(f)


def worker_flags(parser: argparse.ArgumentParser) -> None:
    """The hidden flags `run_workers` starts a benchmark's own script with."""
    parser.add_argument(WORKER, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(OUT, default=None, help=argparse.SUPPRESS)


# ---- in a worker -------------------------------------------------------------------------------------

def start_worker(args: argparse.Namespace | None = None, quiet: bool = False) -> None:
    """A worker's first step, before megatron-core is imported: the patches pretrain.py installs at start-up
    (those its `args` need; without: all of them)."""
    from megatron_resil import patches

    patches.install(args, quiet=quiet)


def gpt_argv(layers: int, hidden: int, heads: int, seq: int, vocab: int, mbs: int = 1) -> list[str]:
    """pretrain.py's flags for a GPT of this shape on mock data, with the NullTokenizer and no evaluation."""
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--tokenizer-type",
            "NullTokenizer", "--vocab-size", str(vocab), "--micro-batch-size", str(mbs), "--mock-data",
            "--eval-iters", "0"]


@dataclass
class Engine:
    """What pretrain.py trains: the parsed arguments, its model chunks, optimizer, scheduler and data."""

    args: argparse.Namespace
    vocab_size: int  # the tokenizer's
    model: list
    optimizer: Any
    scheduler: Any
    train_ds: Any = None

    @property
    def parameters(self) -> int:
        return sum(p.numel() for chunk in self.model for p in chunk.parameters())

    def train_step(self, progress=None) -> None:
        """One step of pretrain.py's train_step (a fresh progress: the first microbatch again)."""
        from megatron_resil.progress import TrainProgress
        from megatron_resil.training import train_step

        train_step(self.args, self.model, self.optimizer, self.scheduler, self.train_ds,
                   progress if progress is not None else TrainProgress())


def build(argv: Sequence[str] | argparse.Namespace, world_size: int | None = None, *, validation: bool = True,
          data: bool = True, first_step: bool = False) -> Engine:
    """The engine pretrain.py builds from `argv` (or arguments parsed already), world size from the
    environment unless given: megatron-core's groups (once per process), the rerun
    state machine (`validation`: as pretrain.py configures it; otherwise megatron-core's implicit one),
    model, optimizer, scheduler and (`data`) the training data; `first_step`: one train_step, so the
    optimizer holds its state as in training."""
    from megatron.core import parallel_state

    from megatron_resil import parallel
    from megatron_resil.arguments import parse_args
    from megatron_resil.data import build_datasets
    from megatron_resil.resilience import rerun
    from megatron_resil.tokenizer import build_tokenizer
    from megatron_resil.training import build_engine

    args = argv if isinstance(argv, argparse.Namespace) else parse_args(list(argv), world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel.initialize(args)
    if validation:
        rerun.initialize(rerun.RerunConfig.from_args(args))
    tokenizer = build_tokenizer(args)
    model, optimizer, scheduler = build_engine(args, tokenizer.vocab_size)
    train_ds = build_datasets(args, tokenizer)[0] if data else None
    engine = Engine(args, tokenizer.vocab_size, model, optimizer, scheduler, train_ds)
    if first_step:
        engine.train_step()
    return engine


def timed(fn: Callable[[], Any]) -> float:
    """Seconds `fn` takes on every rank: from a barrier before it to a barrier after it."""
    import torch.distributed as dist

    dist.barrier()
    began = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - began


def bare_step(engine: Engine, tokens, position_ids, labels, rerun_loop: bool = False) -> Callable[[], None]:
    """A step of a bare megatron-core loop on the same engine, as megatron-core's own examples step it:
    zero the gradient buffers, its pipeline schedule's forward and backward with a plain mean loss on one
    fixed batch, optimizer.step(), scheduler.step(). `rerun_loop`: the schedule inside the rerun state
    machine's loop, as Megatron-LM's train_step runs it (DDP's NaN check reports to the machine)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    args, model, optimizer, scheduler = engine.args, engine.model, engine.optimizer, engine.scheduler
    schedule = get_forward_backward_func()
    machine = get_rerun_state_machine()

    def forward_step(data, chunk):
        next(data)
        output = chunk(tokens, position_ids, None, labels=labels)
        return output, lambda out: (out.float().mean(), {"lm loss": out.detach().float().mean()})

    def forward_backward() -> None:
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        schedule(forward_step_func=forward_step, data_iterator=iter(range(args.num_microbatches)),
                 model=model, num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                 micro_batch_size=args.micro_batch_size, forward_only=False)

    def step() -> None:
        if rerun_loop:
            while machine.should_run_forward_backward(None):
                forward_backward()
        else:
            forward_backward()
        updated, _, _ = optimizer.step()
        if updated:
            scheduler.step(increment=args.global_batch_size)

    return step


def write_results(path: str | None, results: dict) -> None:
    """Rank 0's results for `run_workers` (the other ranks write nothing)."""
    from megatron_resil import parallel

    if path is not None and parallel.is_rank0():
        with open(path, "w") as f:
            json.dump(results, f)


# ---- figures -------------------------------------------------------------------------------------------

def summarize(values: Sequence[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def ratios(a: Sequence[float], b: Sequence[float]) -> dict:
    """The per-repeat ratios a/b, summarized."""
    return summarize([x / y for x, y in zip(a, b, strict=True)])


def spread(values: Sequence[float], digits: int = 3) -> str:
    """"median (min-max)"."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"
