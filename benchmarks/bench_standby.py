"""What a rank forked from a standby saves (docs/standby.md): the same 2-rank torchrun launch of the tiny
model, cold and forked, alternated, in one run; CPU (user+sys of every process of the launch, the
forked ranks included) and wall time, and their ratios.

    python benchmarks/bench_standby.py [--rounds 5] [--ranks 2] [--iters 4]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import harness

from megatron_resil import rank_process
from megatron_resil.launch import standby

ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data", "--log-interval", "1",
        "--eval-interval", "1000", "--eval-iters", "1"]


def _env() -> dict[str, str]:
    env = harness.child_env()
    env.pop(standby.ENV, None)
    return env


def _children_cpu(pid: int) -> float:
    """CPU seconds of the reaped children of `pid` (the standby's: its forked ranks)."""
    return rank_process.proc_stat(pid).children_cpu_ticks / os.sysconf("SC_CLK_TCK")


def _launch(ranks: int, iters: int, env: dict[str, str], standby_pid: int | None) -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = _children_cpu(standby_pid) if standby_pid else 0.0
    started = time.monotonic()
    done = subprocess.run([*harness.torchrun(ranks), str(harness.REPO / "pretrain.py"), *ARGS,
                           "--train-iters", str(iters)], env=env, cwd=harness.REPO, capture_output=True,
                          text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"a launch failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - own.ru_utime - own.ru_stime
    if standby_pid:
        cpu += _children_cpu(standby_pid) - forked
    return cpu, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=4)
    args = parser.parse_args()
    name = f"bench-{os.getpid()}"
    env = _env()
    server = subprocess.Popen([sys.executable, "-m", "megatron_resil.launch.standby", "--name", name],
                              env=env, cwd=harness.REPO, stdout=subprocess.DEVNULL)
    value = f"{name}@{server.pid}"  # as a launcher's standby is named
    try:
        while not standby.ping(value):
            if server.poll() is not None:
                raise SystemExit("the standby did not start")
            time.sleep(0.1)
        cold, forked = [], []
        for _ in range(args.rounds):  # alternated, so load on the machine falls on both alike
            cold.append(_launch(args.ranks, args.iters, env, None))
            forked.append(_launch(args.ranks, args.iters, {**env, standby.ENV: value}, server.pid))
    finally:
        server.terminate()
        server.wait()
    for label, runs in (("cold", cold), ("forked", forked)):
        cpu, wall = statistics.median(c for c, _ in runs), statistics.median(w for _, w in runs)
        print(f"{label:7s} {args.ranks} ranks, {args.iters} iterations: CPU {cpu:.2f} s, wall {wall:.2f} s "
              f"(median of {args.rounds})")
    cpu_ratio = statistics.median(c for c, _ in forked) / statistics.median(c for c, _ in cold)
    wall_ratio = statistics.median(w for _, w in forked) / statistics.median(w for _, w in cold)
    print(f"forked / cold: CPU {cpu_ratio:.2f}, wall {wall_ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
