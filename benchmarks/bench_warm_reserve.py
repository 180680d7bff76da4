"""What a rank's process killed with SIGKILL costs, with a warm reserve and without (issue 37, item 1).

    python benchmarks/bench_warm_reserve.py               # 3 rounds of each, ~6 minutes, idle 2 cores
    python benchmarks/bench_warm_reserve.py --rounds 1    # smoke run

Both ways run under scripts/run_local.sh (our ft_launcher, loopback, gloo) with the tests' tiny GPT, 2
training ranks and a checkpoint every 4 iterations. Before iteration 7 rank 0's process kills itself with
SIGKILL (`--inject-fault kill`); both ways resume from the checkpoint of iteration 4, so they recompute the
same work:

    reserve   --inprocess-restart --inprocess-active-world-size 2 with 3 processes: the other processes go on
              and the reserve takes rank 0's place in the same job step (in-process restart)
    in-job    2 processes, no in-process restart, MAX_RESTARTS=1: ft_launcher ends the survivor and starts
              both ranks again (today's path for a lost process)

The figure: the time from the kill (its `fault_injected` event) to the first `progress` event of
iteration 5 after it (the run's own event log), the median per way, and their ratio (reserve / in-job).
Rounds alternate the two ways, the order reversed every other round. Results go to BENCHMARKS.md.
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


def one(way: str, work: Path) -> float:
    """Seconds from the kill of rank 0's process to iteration 5 logged again."""
    save, log = work / "ckpt", work / "run.log"
    args = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "10", "--save", str(save),
            "--load", str(save), "--save-interval", "4", "--inject-fault", "kill",
            "--inject-fault-iteration", "7", *(RESERVE if way == "reserve" else [])]
    env = {**launch.env(standby=False), "NPROC_PER_NODE": "3" if way == "reserve" else "2",
           "MAX_RESTARTS": "0" if way == "reserve" else "1", "MAX_REQUEUES": "0",
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
    again = [e["unix"] for e in events
             if e["event"] == "progress" and e.get("iteration") == 5 and e["unix"] > killed]
    return min(again) - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    seconds: dict[str, list[float]] = {"reserve": [], "in-job": []}
    with tempfile.TemporaryDirectory(prefix="bench_warm_reserve_") as tmp:
        for n in range(opts.rounds):
            for way in (("reserve", "in-job") if n % 2 == 0 else ("in-job", "reserve")):
                work = Path(tmp) / f"{way}{n}"
                work.mkdir()
                seconds[way].append(one(way, work))
                print(f"round {n + 1} {way}: {seconds[way][-1]:.2f} s from the kill to iteration 5",
                      flush=True)
    median = {way: statistics.median(values) for way, values in seconds.items()}
    print(f"load average now {os.getloadavg()[0]:.2f}")
    for way, values in seconds.items():
        print(f"{way:8s} median {median[way]:.2f} s  ({', '.join(f'{v:.2f}' for v in values)})")
    print(f"ratio reserve / in-job: {median['reserve'] / median['in-job']:.3f}")


if __name__ == "__main__":
    main()
