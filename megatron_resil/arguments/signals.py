"""Signal-driven save-and-exit flags (Megatron-LM's --exit-signal-handler and --exit-signal)."""

from __future__ import annotations

import argparse
import signal

from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags

FLAGS = (
    Flag("--exit-signal-handler",
         help="on --exit-signal, save a checkpoint at the end of the current iteration and exit"),
    Flag("--exit-signal", "SIGTERM", str, "signal name, e.g. SIGTERM, SIGUSR1"),
    Flag("--exit-signal-grace-secs", None, float,
         "after the signal, force an exit if saving has not finished within this many seconds (the previous "
         "checkpoint stays intact); default: no deadline"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "exit signal", FLAGS)


def validate(args: argparse.Namespace, world_size: int) -> None:
    name = args.exit_signal.upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    try:
        signum = signal.Signals[name]
    except KeyError:
        raise ArgumentError(f"--exit-signal {args.exit_signal}: not a signal name (e.g. SIGTERM, SIGUSR1)") \
            from None
    if signum in (signal.SIGKILL, signal.SIGSTOP):
        raise ArgumentError(f"--exit-signal {args.exit_signal} cannot be caught; use SIGTERM or SIGUSR1")
    args.exit_signal = name
    if args.exit_signal_grace_secs is not None:
        if args.exit_signal_grace_secs <= 0:
            raise ArgumentError("--exit-signal-grace-secs must be positive")
        if not args.exit_signal_handler:
            raise ArgumentError("--exit-signal-grace-secs needs --exit-signal-handler")
