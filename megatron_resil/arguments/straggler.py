"""Straggler detection flags: Megatron-LM's --log-straggler family, plus our report interval, NVRx's
score thresholds and an opt-in stop (see megatron_resil/resilience/straggler.py)."""

from __future__ import annotations

import argparse

from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags

FLAGS = (
    Flag("--log-straggler",
         help="time each rank's own work per iteration and report slow ranks (stragglers)"),
    Flag("--straggler-ctrlr-port", 65535, int,
         "rank 0 listens on this TCP port: each connection (e.g. curl HOST:PORT) switches detection on or "
         "off at the next report"),
    Flag("--straggler-minmax-count", 1, int,
         "how many worst and best ranks each report lists (all ranks when there are at most twice as many)"),
    Flag("--disable-straggler-on-startup",
         help="start with detection off; switch it on through --straggler-ctrlr-port"),
    Flag("--straggler-report-interval", None, int,
         "report every N iterations, one small all-gather each time (default: --log-interval, as Megatron "
         "reports)"),
    # Defaults are NVRx's (Report.identify_stragglers: gpu_rel_threshold, gpu_indiv_threshold = 0.75).
    Flag("--straggler-relative-threshold", 0.75, float,
         "a rank whose time is more than 1/T of the fastest rank's (score below T) is a straggler; 0 turns "
         "this check off"),
    Flag("--straggler-individual-threshold", 0.75, float,
         "a rank whose time is more than 1/T of its own best so far is a straggler; 0 turns this check off"),
    Flag("--straggler-stop-if-detected",
         help="when a straggler is detected, save a checkpoint and exit with code 0, recorded as 'requeue' "
              "in the event log, so the job can continue on other nodes"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "straggler detection", FLAGS)


def validate(args: argparse.Namespace, world_size: int) -> None:
    if not 1 <= args.straggler_ctrlr_port <= 65535:
        raise ArgumentError(f"--straggler-ctrlr-port {args.straggler_ctrlr_port}: give a TCP port, 1-65535")
    if args.straggler_minmax_count < 1:
        raise ArgumentError("--straggler-minmax-count must be at least 1")
    if args.straggler_report_interval is None:
        args.straggler_report_interval = args.log_interval
    elif args.straggler_report_interval < 1:
        raise ArgumentError("--straggler-report-interval must be positive")
    for flag, value in (("--straggler-relative-threshold", args.straggler_relative_threshold),
                        ("--straggler-individual-threshold", args.straggler_individual_threshold)):
        if not 0.0 <= value <= 1.0:  # scores are at most 1: above 1, every rank would be a straggler
            raise ArgumentError(f"{flag} {value}: give a score between 0 and 1 (NVRx's default 0.75)")
    if args.straggler_stop_if_detected:
        if not args.log_straggler:
            raise ArgumentError("--straggler-stop-if-detected needs --log-straggler")
        if args.save is None:
            raise ArgumentError("--straggler-stop-if-detected saves before it stops: pass --save DIR")
