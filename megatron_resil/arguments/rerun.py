"""Result validation flags: megatron-core's rerun state machine, with Megatron-LM's names and defaults."""

from __future__ import annotations

import argparse
import os

from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags

MODES = ("disabled", "validate_results", "report_determinism_stats")
# Megatron-LM offers `report_stats` but passes it to RerunMode(), whose value is `report_determinism_stats`,
# so that choice raises there. We accept both spellings.
MEGATRON_STATS_SPELLING = "report_stats"
INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")


FLAGS = (
    Flag("--rerun-mode", "validate_results", str, choices=(*MODES, MEGATRON_STATS_SPELLING),
         help="validate_results: a rejected loss or grad norm reruns the step in place; after a fatal check "
              "(NaN, Inf), reproduced: save and exit 16 (resume on another device), not reproduced: save and "
              "exit 17; after a spike: continue. report_determinism_stats (or Megatron's report_stats): run "
              "every step twice and report how much results vary. disabled: a rejected NaN or Inf raises"),
    Flag("--error-injection-rate", 0, int, "drills: reject about 1 in N validated results (0: never)"),
    Flag("--error-injection-type", None, str, choices=INJECTION_TYPES,
         help="what an injected rejection behaves like on the reruns (default: transient_error)"),
    Flag("--no-check-for-nan-in-loss-and-grad", True,
         help="do not validate each microbatch loss and the local grad norm for NaN and Inf"),
    Flag("--rerun-max-same-device-retries", 2, int,
         "ours (Megatron has no bound): after a fault reproduced in place and exit 16, how many times the "
         "job may resume on the same node and device and fail again; then it falls back to the newest "
         "verified persistent checkpoint older than the diagnostic one, and if the fault reproduces from "
         "there too it exits 8 (do not requeue). Counted in <save>/rerun_escape.json across restarts and "
         "requeues"),
    Flag("--check-for-spiky-loss",
         help="reject a microbatch loss 10x above the largest of the job's first 100 (not fatal)"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "result validation (megatron-core's rerun state machine)", FLAGS)


def validate(args: argparse.Namespace, world_size: int) -> None:
    if args.rerun_mode == MEGATRON_STATS_SPELLING:
        args.rerun_mode = "report_determinism_stats"
        if os.environ.get("RANK", "0") == "0":
            print("pretrain.py: note: --rerun-mode report_stats is Megatron-LM's spelling (which fails "
                  "there); running report_determinism_stats", flush=True)
    checks = args.check_for_nan_in_loss_and_grad or args.check_for_spiky_loss
    if args.rerun_max_same_device_retries < 0:
        raise ArgumentError("--rerun-max-same-device-retries must not be negative (0: fall back at the first "
                            "same-device failure)")
    if args.error_injection_rate < 0:
        raise ArgumentError("--error-injection-rate must not be negative (0: no injection)")
    if args.error_injection_type is not None and not args.error_injection_rate:
        raise ArgumentError(f"--error-injection-type {args.error_injection_type} needs "
                            "--error-injection-rate N (N > 0)")
    args.error_injection_type = args.error_injection_type or "transient_error"
    if args.error_injection_rate:
        if args.rerun_mode != "validate_results":
            raise ArgumentError("--error-injection-rate injects only under --rerun-mode validate_results, "
                                f"not {args.rerun_mode}")
        if not checks:
            raise ArgumentError("--error-injection-rate: no result is validated with "
                                "--no-check-for-nan-in-loss-and-grad and without --check-for-spiky-loss")
    if args.rerun_mode == "report_determinism_stats" and not checks:
        raise ArgumentError("--rerun-mode report_determinism_stats compares validated results, and none are "
                            "with --no-check-for-nan-in-loss-and-grad and without --check-for-spiky-loss")
