"""Job-level resiliency, measured on 2 ranks (gloo, loopback), each as a ratio within one run:

    python benchmarks/bench_recovery.py            # full run (~15 minutes on an idle 2-core box)
    python benchmarks/bench_recovery.py --repeats 2  # the run recorded in BENCHMARKS.md
    python benchmarks/bench_recovery.py --quick    # smoke run, numbers not meaningful

1. Recovery: wall time from a failure to the next completed iteration, for the same failure (an
   exception on rank 0 before iteration FAULT_AT, injected with --inject-fault exception) recovered
   three ways:
   - in-job restart: ft_launcher (--enable-ft-package, --max-restarts 1) restarts the worker group;
   - in-process restart: --inprocess-restart under torchrun restarts training inside the same processes;
   - cold start: the launcher gives up (--max-restarts 0) and scripts/run_local.sh requeues the job,
     which starts a fresh launcher (what a Slurm requeue costs, without the queue wait).
   Measured from the run's own event log: the `fault_injected` event's time to the first `progress`
   event of iteration FAULT_AT (the iteration the fault interrupted). Every run resumes from the same
   checkpoint (iteration FAULT_AT - 1), so the recomputed work is the same. Reported: median seconds
   per way and the ratios to the cold start.
2. FT monitoring overhead: median step time with --enable-ft-package / without, both under
   ft_launcher, runs interleaved (A, B, B, A, ...); the first iterations of each run are skipped.

Results go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import harness

from megatron_resil.launch.ports import free_loopback_port

PRETRAIN = str(harness.REPO / "pretrain.py")
FAULT_AT = 5
FT_SECTIONS = ("--ft-rank-section-timeouts", "setup:600,step:180,checkpointing:420")
_STEP_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")



def _model(hidden: int, iters: int) -> list[str]:
    return [*harness.gpt_argv(2, hidden, 4, 64, 256, mbs=2), "--lr", "1e-3", "--log-interval", "1",
            "--train-iters", str(iters)]


def _ft_launcher(max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher", "--nnodes", "1",
            "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_loopback_port()}",
            "--local-addr", "127.0.0.1", "--max-restarts", str(max_restarts), "--ft-enable-nic-monitor",
            "false", *FT_SECTIONS]


def _run(cmd: list[str], extra_env: dict | None = None, timeout: float = 600) -> str:
    done = subprocess.run(cmd, env=harness.child_env(**(extra_env or {})), cwd=harness.REPO, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return done.stdout


def _events(save: str) -> list[dict]:
    with open(os.path.join(save, "events.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def recovery_seconds(save: str) -> float:
    events = _events(save)
    struck = next(e["unix"] for e in events if e["event"] == "fault_injected")
    done = next(e["unix"] for e in events if e["event"] == "progress" and e["unix"] > struck
                and e["iteration"] == FAULT_AT)
    return done - struck


def recover(way: str, workdir: str, hidden: int) -> float:
    save = tempfile.mkdtemp(prefix=f"{way}-", dir=workdir)
    args = [*_model(hidden, FAULT_AT + 1), "--save", save, "--load", save,
            "--save-interval", str(FAULT_AT - 1), "--inject-fault", "exception",
            "--inject-fault-iteration", str(FAULT_AT), "--inject-fault-ranks", "0"]
    if way == "in-job restart":
        out = _run([*_ft_launcher(1), PRETRAIN, *args, "--enable-ft-package"])
    elif way == "in-process restart":
        out = _run([*harness.torchrun(2), PRETRAIN, *args, "--inprocess-restart"])
    else:
        out = _run(["bash", str(harness.REPO / "scripts" / "run_local.sh"), *args],
                   {"RESIL_PYTHON": sys.executable, "MAX_RESTARTS": "0", "MAX_REQUEUES": "1"})
    try:
        return recovery_seconds(save)
    except (StopIteration, OSError) as err:
        raise SystemExit(f"{way}: no recovery found in {save} ({err}); output tail:\n{out[-3000:]}") from None
    finally:
        shutil.rmtree(save, ignore_errors=True)


def step_ms(with_ft: bool, hidden: int, iters: int, skip: int) -> float:
    ft = ["--enable-ft-package"] if with_ft else []
    out = _run([*_ft_launcher(0), PRETRAIN, *_model(hidden, iters), *ft])
    times = [float(ms) for it, ms in _STEP_MS.findall(out) if int(it) > skip]
    if not times:
        raise SystemExit(f"no step times (with_ft={with_ft}); output tail:\n{out[-3000:]}")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--repeats", type=int, default=None, help="default: 1 with --quick, else 3")
    opts = parser.parse_args()
    repeats, hidden, iters = (1, 64, 12) if opts.quick else (3, 256, 40)
    repeats = opts.repeats or repeats
    workdir = tempfile.mkdtemp(prefix="bench_recovery_", dir=opts.workdir)
    results: dict = {"repeats": repeats, "hidden": hidden}
    try:
        ways = ["in-job restart", "in-process restart", "cold start"]
        seconds = {way: [] for way in ways}
        for r in range(repeats):
            for way in (ways if r % 2 == 0 else ways[::-1]):
                seconds[way].append(recover(way, workdir, hidden))
                print(f"  recovery, {way}: {seconds[way][-1]:.1f} s", flush=True)
        cold = statistics.median(seconds["cold start"])
        results["recovery_s"] = {way: statistics.median(v) for way, v in seconds.items()}
        results["recovery_all_s"] = seconds
        results["recovery_ratio_to_cold_start"] = {way: statistics.median(v) / cold
                                                   for way, v in seconds.items()}
        ratios = []
        for r in range(repeats):
            order = (True, False) if r % 2 == 0 else (False, True)
            measured = {flag: step_ms(flag, hidden, iters, skip=5) for flag in order}
            ratios.append(measured[True] / measured[False])
            print(f"  step time with FT / without: {measured[True]:.1f} / {measured[False]:.1f} ms "
                  f"= {ratios[-1]:.3f}", flush=True)
        results["ft_step_time_ratio"] = statistics.median(ratios)
        results["ft_step_time_ratios"] = ratios
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nrecovery: failure -> next completed iteration (median of {repeats})")
    for way in ways:
        print(f"  {way:20s} {results['recovery_s'][way]:7.1f} s   ratio to cold start "
              f"{results['recovery_ratio_to_cold_start'][way]:.2f}")
    print("FT monitoring: step time with / without --enable-ft-package = "
          f"{results['ft_step_time_ratio']:.3f} (goal <= 1.01)")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    started = time.monotonic()
    main()
    print(f"({time.monotonic() - started:.0f} s)")
