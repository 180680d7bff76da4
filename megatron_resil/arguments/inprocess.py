"""In-process restart flags: Megatron-LM's --inprocess-* names and defaults (NVRx's inprocess.Wrapper).

NVRx asserts its timing constraints in the Wrapper's constructor; they are checked here instead, so a bad
combination ends in one line naming the flags, before any process group starts.
"""

from __future__ import annotations

import argparse

from megatron_resil.arguments.errors import ArgumentError
from megatron_resil.arguments.flag_table import Flag, add_flags

FLAGS = (
    Flag("--inprocess-restart",
         help="an exception (or a soft timeout) on any rank restarts training on every rank inside the same "
              "processes: process groups are rebuilt and the newest checkpoint is loaded"),
    # Megatron's default is no limit: a fault that comes back from the newest checkpoint then restarts
    # forever (Megatron-LM #5281). Ours is bounded; an explicit large value is still allowed.
    Flag("--inprocess-max-iterations", 4, int,
         "attempts allowed in all, the first one included (NVRx's RetryController); when they are used up "
         "the run exits with code 8. Default 4 (Megatron: no limit)"),
    Flag("--inprocess-monitor-thread-interval", 1.0, float,
         "seconds between the monitor thread's checks for a failure on any rank"),
    Flag("--inprocess-monitor-process-interval", 1.0, float,
         "seconds between the monitor process's checks of this rank"),
    Flag("--inprocess-progress-watchdog-interval", 1.0, float,
         "seconds between the automatic progress timestamps of the training thread"),
    Flag("--inprocess-heartbeat-interval", 30, float,
         "seconds between heartbeats used to detect an unresponsive rank"),
    Flag("--inprocess-soft-timeout", 60, float,
         "seconds without progress after which a rank asks every rank to restart"),
    Flag("--inprocess-hard-timeout", 90, float,
         "seconds without progress after which a rank is terminated (needs an outer restart layer: the job "
         "cannot continue in-process without it)"),
    Flag("--inprocess-heartbeat-timeout", 60, float,
         "seconds of missing heartbeats after which a rank counts as lost"),
    Flag("--inprocess-barrier-timeout", 120, float,
         "seconds for the wrapper's internal barriers between attempts"),
    Flag("--inprocess-completion-timeout", 120, float,
         "seconds for the barrier at which every rank reports completion"),
    Flag("--inprocess-last-call-wait", 1, float,
         "seconds to collect failures on other ranks before restarting, so concurrent failures are handled "
         "by one restart"),
    Flag("--inprocess-termination-grace-time", 1, float,
         "seconds between SIGTERM and SIGKILL when the hard timeout terminates a rank"),
    Flag("--inprocess-granularity", "node", str, choices=("node", "rank"),
         help="node: a lost rank takes its whole node out of the job; rank: only itself"),
    Flag("--inprocess-active-world-size", None, int,
         "ranks that train; the rest of the world wait as warm reserves (imports done), and one takes the "
         "place of a rank whose process is lost, at the next in-process restart. Default: the world size"),
    Flag("--inprocess-empty-cuda-cache",
         help="release cached GPU memory between attempts (nothing to do on CPU)"),
    # Ours, not Megatron-LM's (docs/failures.md, "Same-step recovery").
    Flag("--recover-from-replicas",
         help="after an in-process restart, go on at the interrupted iteration with no checkpoint read: the "
              "surviving ranks keep their state, and a rank that lost it (a warm reserve in a lost rank's "
              "place) receives it from a data-parallel replica, checked tensor by tensor; where no replica "
              "holds it, the newest checkpoint is loaded, with the reason. Needs --inprocess-restart"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "in-process restart (NVRx inprocess.Wrapper)", FLAGS)


_POSITIVE = ("monitor_thread_interval", "monitor_process_interval", "progress_watchdog_interval",
             "heartbeat_interval", "soft_timeout", "hard_timeout", "heartbeat_timeout", "barrier_timeout",
             "completion_timeout")
_NON_NEGATIVE = ("last_call_wait", "termination_grace_time")


def _flag(name: str) -> str:
    return "--inprocess-" + name.replace("_", "-")


def training_world_size(args: argparse.Namespace, launcher_world_size: int) -> int:
    """The ranks that train: the launcher's world less the warm reserves. Every size the other flag groups
    derive (data-parallel size, batch split) is of this world, as NVRx's Wrapper sets WORLD_SIZE to it."""
    active = args.inprocess_active_world_size
    if active is None or not args.inprocess_restart:
        return launcher_world_size
    if not 1 <= active <= launcher_world_size:
        raise ArgumentError(f"--inprocess-active-world-size {active}: give at least 1 and at most the world "
                            f"size ({launcher_world_size}); the ranks beyond it wait as warm reserves")
    return active


def validate(args: argparse.Namespace, world_size: int) -> None:
    """`world_size`: the training world (training_world_size)."""
    if args.inprocess_active_world_size is None:
        args.inprocess_active_world_size = world_size
    if args.recover_from_replicas and not args.inprocess_restart:
        raise ArgumentError("--recover-from-replicas needs --inprocess-restart: only an in-process restart "
                            "keeps the surviving ranks' processes, and their state, today")
    if not args.inprocess_restart:
        return
    value = {name: getattr(args, f"inprocess_{name}") for name in _POSITIVE + _NON_NEGATIVE}
    for name in _POSITIVE:
        if value[name] <= 0:
            raise ArgumentError(f"{_flag(name)} must be positive")
    for name in _NON_NEGATIVE:
        if value[name] < 0:
            raise ArgumentError(f"{_flag(name)} must be >= 0")
    if args.inprocess_max_iterations is not None and args.inprocess_max_iterations < 1:
        raise ArgumentError("--inprocess-max-iterations must be >= 1 (the first attempt counts)")
    # NVRx's Wrapper asserts each of these "a < b" (and fails with a bare ValueError deep in its constructor).
    for smaller, larger in (("soft_timeout", "hard_timeout"), ("hard_timeout", "barrier_timeout"),
                            ("heartbeat_interval", "heartbeat_timeout"),
                            ("heartbeat_timeout", "barrier_timeout"),
                            ("monitor_process_interval", "heartbeat_timeout"),
                            ("monitor_process_interval", "soft_timeout"),
                            ("monitor_thread_interval", "soft_timeout"),
                            ("progress_watchdog_interval", "soft_timeout")):
        if not value[smaller] < value[larger]:
            raise ArgumentError(f"{_flag(smaller)} ({value[smaller]:g}) must be less than {_flag(larger)} "
                                f"({value[larger]:g}); NVRx needs soft timeout < hard timeout < barrier "
                                "timeout, heartbeat interval < heartbeat timeout < barrier timeout, and "
                                "every interval below the soft timeout")
    # With --enable-ft-package the in-process restarts nest inside ft_launcher's in-job restart, as in
    # Megatron-LM: each attempt connects to the rank's monitor afresh (resilience/fault_tolerance.py).
