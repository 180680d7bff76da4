"""Hang detection flags (Megatron-LM's --enable-ft-package, --calc-ft-timeouts, --ft-num-warmup-iters,
plus our --ft-timeouts-floor-secs). The timeouts themselves are ft_launcher's options (--ft-*)."""

from __future__ import annotations

import argparse
import os

from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags

# Set by ft_launcher in every worker: where the rank's monitor listens.
RANK_MONITOR_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"


FLAGS = (
    Flag("--enable-ft-package",
         help="report this rank's phases (sections setup, step, checkpointing) to ft_launcher's rank "
              "monitor, which kills a rank stuck in one past its timeout so ft_launcher restarts the workers "
              "from the newest checkpoint; needs ft_launcher"),
    Flag("--calc-ft-timeouts",
         help="calculate section timeouts from observed times (after the warm-up iterations, after each save "
              "and at the end) and keep them in <save>/ft_state.json for the next run"),
    Flag("--ft-num-warmup-iters", 5, int,
         "the first N iterations of each process are not timed by the step section (they are slower); the "
         "first step timeout is calculated after N timed ones"),
    Flag("--ft-timeouts-floor-secs", 60.0, float,
         "(ours) no calculated timeout, whether just calculated or loaded from ft_state.json, is used or "
         "kept below this: a timeout calculated from a fast run (ms) would kill a slower next run's healthy "
         "start"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "fault tolerance (NVRx ft_launcher)", FLAGS)


def validate(args: argparse.Namespace, world_size: int) -> None:
    if args.ft_num_warmup_iters < 0:
        raise ArgumentError("--ft-num-warmup-iters must be >= 0")
    if args.ft_timeouts_floor_secs <= 0:
        raise ArgumentError("--ft-timeouts-floor-secs must be positive")
    if args.calc_ft_timeouts and not args.enable_ft_package:
        raise ArgumentError("--calc-ft-timeouts needs --enable-ft-package (and ft_launcher)")
    if args.calc_ft_timeouts and args.save is None:
        raise ArgumentError("--calc-ft-timeouts keeps the timeouts in <save>/ft_state.json: pass --save DIR")
    # --check-args-only checks a command line before it is launched (the launch scripts run it outside
    # ft_launcher, which will provide the rank monitor).
    if (args.enable_ft_package and not os.environ.get(RANK_MONITOR_SOCKET_ENV)
            and not getattr(args, "check_args_only", False)):
        raise ArgumentError(f"--enable-ft-package needs ft_launcher's rank monitor "
                            f"({RANK_MONITOR_SOCKET_ENV} is not set): launch with ft_launcher, or drop "
                            "--enable-ft-package")
