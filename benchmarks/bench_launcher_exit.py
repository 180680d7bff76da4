"""What a launcher's own end costs the next job step (megatron_resil/process_exit.py): the same 2-rank
ft_launcher launch of the tiny model, to the end of training, under NVRx's `ft_launcher` as it is (its
interpreter's teardown) and under `python -m megatron_resil.launch.ft_launcher` (which ends without it),
alternated, in one run. Measured: from the run's `finished` record (rank 0, the last thing it writes) to
the launcher's exit, as the next job step waits for it; the median of each and their ratio.

    python benchmarks/bench_launcher_exit.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

from megatron_resil.launch import standby

ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data", "--train-iters", "4"]
NVRX = [sys.executable, "-c", "import sys; from nvidia_resiliency_ext.fault_tolerance.launcher import main; "
        "sys.argv[0] = 'ft_launcher'; sys.exit(main())"]  # the `ft_launcher` console script
OURS = [sys.executable, "-m", "megatron_resil.launch.ft_launcher"]


def _end_after_finished(launcher: list[str], save: Path, port: int) -> float:
    env = harness.child_env()
    env.pop(standby.ENV, None)
    done = subprocess.run([*launcher, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                           "--nnodes", "1", "--nproc-per-node", "2", "--ft-enable-nic-monitor", "false",
                           str(harness.REPO / "pretrain.py"), *ARGS, "--save", str(save)],
                          env=env, cwd=harness.REPO, capture_output=True, text=True)
    ended = time.time()
    if done.returncode != 0:
        raise SystemExit(f"a launch failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines()]
    (finished,) = [r for r in records if r["event"] == "finished"]
    return ended - finished["unix"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from megatron_resil.launch.ports import free_loopback_port

    scratch = Path(tempfile.mkdtemp(prefix="bench_launcher_exit_"))
    theirs, ours = [], []
    try:
        for i in range(args.rounds):  # alternated, so load on the machine falls on both alike
            theirs.append(_end_after_finished(NVRX, scratch / f"nvrx{i}", free_loopback_port()))
            ours.append(_end_after_finished(OURS, scratch / f"ours{i}", free_loopback_port()))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for label, runs in (("NVRx's ft_launcher", theirs), ("megatron_resil.launch.ft_launcher", ours)):
        print(f"{label:34s} finished -> launcher exit: median {statistics.median(runs):.2f} s "
              f"(min {min(runs):.2f}, max {max(runs):.2f})")
    print(f"ours / NVRx's: {statistics.median(ours) / statistics.median(theirs):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
