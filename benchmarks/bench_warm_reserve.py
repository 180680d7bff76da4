"""What a rank's process killed with SIGKILL costs: with a warm reserve and same-step recovery, with a warm
reserve alone, and without (issue 37, items 1 and 5).

    python benchmarks/bench_warm_reserve.py               # 3 rounds of each, ~8 minutes, idle 2 cores
    python benchmarks/bench_warm_reserve.py --rounds 1    # smoke run
    python benchmarks/bench_warm_reserve.py --nvrx-intervals 0.1 --ways same-step reserve
                                                          # NVRx's detection intervals shortened

Both ways run under scripts/run_local.sh (our ft_launcher, loopback, gloo) with the tests' tiny GPT, 2
training ranks and a checkpoint every 4 iterations. Before iteration 7 rank 0's process kills itself with
SIGKILL (`--inject-fault kill`):

    same-step the reserve way with --recover-from-replicas: the reserve receives rank 1's state of
              iteration 6 and training goes on at iteration 7, no checkpoint read
    reserve   --inprocess-restart --inprocess-active-world-size 2 with 3 processes: the other processes go on
              and the reserve takes rank 0's place in the same job step (in-process restart)
    in-job    2 processes, no in-process restart, MAX_RESTARTS=1: ft_launcher ends the survivor and starts
              both ranks again (today's path for a lost process)

The two reload ways resume from the checkpoint of iteration 4 and so recompute iterations 5 and 6.

The figures, from the run's own event log, from the kill (its `fault_injected` event):
    next      to the first `progress` event after it (iteration 5 reloaded, or 7 kept), the issue's "kill to
              the next logged iteration"
    new       to the `progress` event of iteration 7, the first iteration not taken before the kill
the median per way and their ratios. Rounds rotate the order of the ways. Results go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import launch  # noqa: E402 - the tests' tiny model and environment

RUN_LOCAL = REPO / "scripts" / "run_local.sh"
RESERVE = ["--inprocess-restart", "--inprocess-active-world-size", "2", "--inprocess-granularity", "rank",
           "--inprocess-heartbeat-interval", "5", "--inprocess-heartbeat-timeout", "60",
           "--inprocess-soft-timeout", "60", "--inprocess-hard-timeout", "90",
           "--inprocess-barrier-timeout", "180", "--inprocess-completion-timeout", "180"]


def _events(save: Path) -> list[dict]:
    path = save / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


WAYS = ("same-step", "reserve", "in-job")
_INTERVALS = ("monitor-thread-interval", "last-call-wait", "monitor-process-interval",
              "progress-watchdog-interval")


def _intervals(seconds: float) -> list[str]:
    return [flag for name in _INTERVALS for flag in (f"--inprocess-{name}", str(seconds))]


def one(way: str, work: Path, intervals: float | None = None) -> dict[str, float]:
    """Seconds from the kill of rank 0's process to the next iteration logged and to iteration 7."""
    save, log = work / "ckpt", work / "run.log"
    reserve = way != "in-job"
    args = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "10", "--save", str(save),
            "--load", str(save), "--save-interval", "4", "--inject-fault", "kill",
            "--inject-fault-iteration", "7", *(RESERVE if reserve else []),
            *(["--recover-from-replicas"] if way == "same-step" else []),
            *(_intervals(intervals) if intervals is not None and reserve else [])]
    env = {**launch.env(standby=False), "NPROC_PER_NODE": "3" if reserve else "2",
           "MAX_RESTARTS": "0" if reserve else "1", "MAX_REQUEUES": "0",
           "RESIL_PYTHON": sys.executable}
    with open(log, "w") as out:
        run = subprocess.Popen(["bash", str(RUN_LOCAL), *args], env=env, cwd=REPO, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if run.wait(timeout=600) != 0:
            raise RuntimeError(f"{way}: exit code {run.returncode}:\n{log.read_text()[-3000:]}")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    events = _events(save)
    [killed] = [e["unix"] for e in events if e["event"] == "fault_injected"]
    after = [e for e in events if e["event"] == "progress" and e["unix"] > killed]
    loads = [e for e in events if e["event"] == "loaded" and e["unix"] > killed]
    if way == "same-step" and loads:
        raise RuntimeError(f"same-step: a checkpoint was read after the kill: {loads}")
    return {"next": min(e["unix"] for e in after) - killed,
            "new": min(e["unix"] for e in after if e.get("iteration") == 7) - killed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--nvrx-intervals", type=float, default=None,
                        help="seconds for NVRx's monitor thread and process intervals, progress watchdog "
                             "interval and last-call wait (default: Megatron's, 1 s each)")
    opts = parser.parse_args()
    ways = tuple(opts.ways)
    seconds: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory(prefix="bench_warm_reserve_") as tmp:
        for n in range(opts.rounds):
            for way in ways[n % len(ways):] + ways[:n % len(ways)]:
                work = Path(tmp) / f"{way}{n}"
                work.mkdir()
                seconds[way].append(one(way, work, opts.nvrx_intervals))
                print(f"round {n + 1} {way}: {seconds[way][-1]['next']:.2f} s from the kill to the next "
                      f"iteration, {seconds[way][-1]['new']:.2f} s to iteration 7", flush=True)
    print(f"load average now {os.getloadavg()[0]:.2f}")
    median = {}
    for what in ("next", "new"):
        median[what] = {way: statistics.median(r[what] for r in rounds) for way, rounds in seconds.items()}
        for way, rounds in seconds.items():
            print(f"{what:4s} {way:9s} median {median[what][way]:.2f} s  "
                  f"({', '.join(f'{r[what]:.2f}' for r in rounds)})")
    for what in ("next", "new"):
        m = median[what]
        print(f"{what}: " + ", ".join(f"{a} / {b} {m[a] / m[b]:.3f}" for a, b in (
            ("same-step", "reserve"), ("same-step", "in-job"), ("reserve", "in-job")) if a in m and b in m))


if __name__ == "__main__":
    main()
