"""Result validation and straggler detection: what they cost on step time (issue 5's goal: <= 1%).

    python benchmarks/bench_validation.py [--quick] [--json OUT]

Two ranks under torchrun (gloo on loopback, one torch thread each), the same GPTModel, the same
`train_step` pretrain.py calls, alternating single steps in the same processes:

- A: `--rerun-mode validate_results` with the NaN/Inf checks of every microbatch loss and of the local
  grad norm (the machine's agreement collective included), plus `--log-straggler`: each rank times its
  own work and, every `--report-interval` A-steps, the ranks all-gather their timings and rank 0 prints
  the report;
- B: `--rerun-mode disabled`, no NaN checks, no straggler detection.

Steps alternate A B, B A, ... so both see the same machine; a block's figure is the median of its
steps, and the result is the median over blocks of A / B. Absolute times on this shared machine are
noise; the ratio is the result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import harness


def worker(opts: argparse.Namespace) -> None:
    import logging

    import torch

    logging.getLogger("megatron.core.rerun_state_machine").setLevel(logging.ERROR)  # a line per switch

    harness.start_worker()  # what pretrain.py installs at start-up
    from megatron_resil import parallel
    from megatron_resil.progress import TrainProgress
    from megatron_resil.resilience import rerun
    from megatron_resil.resilience.straggler import TimedRanks

    torch.set_num_threads(1)
    argv = [*harness.gpt_argv(opts.layers, opts.hidden, 4, opts.seq, 1024, opts.mbs),
            "--global-batch-size", str(2 * opts.mbs), "--train-iters", "100000", "--lr", "1e-4",
            "--log-straggler", "--straggler-report-interval", str(opts.report_interval),
            "--log-interval", "100000"]
    # The machine is configured for each step (A or B) below.
    engine = harness.build(argv, int(os.environ["WORLD_SIZE"]), validation=False)
    args, model = engine.args, engine.model
    progress = TrainProgress()  # not advanced: every step draws the same microbatch, on both sides
    # Its hook stays installed on both sides; without iteration_started (side B) it records nothing.
    stragglers = TimedRanks(args, model)
    validating = rerun.RerunConfig(mode="validate_results", check_nan=True)
    plain = rerun.RerunConfig(mode="disabled", check_nan=False)
    a_steps = 0

    def step(with_checks: bool) -> float:
        nonlocal a_steps
        rerun.initialize(validating if with_checks else plain)
        torch.distributed.barrier()
        began = time.perf_counter()
        if with_checks:
            stragglers.iteration_started()
        engine.train_step(progress)
        if with_checks:
            a_steps += 1
            stragglers.report(a_steps)
        return time.perf_counter() - began

    for _ in range(opts.warmup):
        step(True)
        step(False)
    blocks = []
    for _ in range(opts.blocks):
        times: dict[str, list[float]] = {"A": [], "B": []}
        for i in range(opts.block):
            for side in (("A", "B") if i % 2 == 0 else ("B", "A")):
                times[side].append(step(side == "A"))
        blocks.append({k: statistics.median(v) for k, v in times.items()})
        if parallel.is_rank0():
            print(f"[bench] block {len(blocks)}: A {blocks[-1]['A'] * 1e3:.1f} ms, "
                  f"B {blocks[-1]['B'] * 1e3:.1f} ms", flush=True)
    harness.write_results(opts.out, {"blocks": blocks, "a_steps": a_steps})
    parallel.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few steps (a smoke run)")
    parser.add_argument("--json", default=None, help="also write the results here")
    harness.worker_flags(parser)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--report-interval", type=int, default=8)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts)
        return 0
    if opts.quick:
        opts.hidden, opts.layers, opts.seq, opts.mbs, opts.blocks, opts.block = 64, 2, 64, 2, 2, 4
    began = time.time()
    result = harness.run_workers(__file__, 2, [f"--{k.replace('_', '-')}={v}" for k, v in vars(opts).items()
                                               if k in ("hidden", "layers", "seq", "mbs", "blocks", "block",
                                                        "warmup", "report_interval")])
    ratio = harness.ratios([b["A"] for b in result["blocks"]], [b["B"] for b in result["blocks"]])
    summary = {
        "workload": f"2 ranks, {opts.layers} layers, hidden {opts.hidden}, seq {opts.seq}, "
                    f"micro batch {opts.mbs}",
        "A_ms": round(statistics.median(b["A"] for b in result["blocks"]) * 1e3, 1),
        "B_ms": round(statistics.median(b["B"] for b in result["blocks"]) * 1e3, 1),
        "ratio_median": round(ratio["median"], 4), "ratio_min": round(ratio["min"], 4),
        "ratio_max": round(ratio["max"], 4), "blocks": ratio["n"], "steps_per_block": opts.block,
        "straggler_reports": result["a_steps"] // opts.report_interval, "seconds": round(time.time() - began),
    }
    print("\nvalidation + straggler detection (A) / neither (B), median step time per block:")
    for key, value in summary.items():
        print(f"  {key}: {value}")
    print(f"  goal <= 1.01: {'met' if summary['ratio_median'] <= 1.01 else 'NOT met'}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
