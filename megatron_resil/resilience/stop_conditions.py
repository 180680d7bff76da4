"""Requested stops that save first: --exit-interval and --exit-duration-in-mins (as in Megatron), and
--exit-signal-handler's signal.

Checked once per iteration. The duration is judged on rank 0's clock and a signal on any rank counts
for all, each shared by one collective, so every rank stops at the same iteration.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from megatron_resil import exit_codes, parallel, rank_process
from megatron_resil.resilience import signal_handler


def _process_start() -> float:
    """When the process the launcher started began, on the monotonic clock. The time budget counts from
    it, as Megatron's does from its process's start: an in-process restart does not get a fresh budget
    (the allocation's end does not move), and a rank forked from a standby, which may have imported this
    module long before, counts from its client's start."""
    started = rank_process.started_unix(rank_process.launched_pid())
    now = time.monotonic()
    return now if started is None else now - max(0.0, time.time() - started)


@dataclass(frozen=True)
class Stop:
    reason: str
    exit_code: int
    # Whether the launch scripts should requeue the job: yes after a preemption signal or the time
    # budget (--exit-duration-in-mins exists to stop before the allocation ends), no after
    # --exit-interval (a deliberate stop).
    requeue: bool


class StopConditions:
    def __init__(self, args: argparse.Namespace) -> None:
        self.exit_interval = args.exit_interval
        self.deadline = (_process_start() + 60.0 * args.exit_duration_in_mins
                         if args.exit_duration_in_mins else None)
        self.signals = signal_handler.install_from_args(args)  # pretrain() installed it already

    def signalled(self, iteration: int) -> Stop | None:
        """Before the first iteration: a signal that arrived during set-up or the load."""
        if self.signals is not None and parallel.any_rank(self.signals.received):
            self.signals.agreed()
            return Stop(f"{self.signals.signal_name} received (on at least one rank) during set-up, before "
                        f"iteration {iteration + 1}", exit_codes.SIGNAL_SAVED, requeue=True)
        return None

    def check(self, iteration: int) -> Stop | None:
        if self.signals is not None and parallel.any_rank(self.signals.received):
            self.signals.agreed()  # every rank answered: none is gone
            return Stop(f"{self.signals.signal_name} received (on at least one rank) by iteration "
                        f"{iteration}", exit_codes.SIGNAL_SAVED, requeue=True)
        if self.exit_interval and iteration % self.exit_interval == 0:
            return Stop(f"--exit-interval {self.exit_interval} reached at iteration {iteration}",
                        exit_codes.FINISHED, requeue=False)
        if self.deadline is not None:
            expired = parallel.broadcast_object(time.monotonic() >= self.deadline
                                                if parallel.is_rank0() else None)
            if expired:
                return Stop(f"--exit-duration-in-mins elapsed at iteration {iteration}", exit_codes.FINISHED,
                            requeue=True)
        return None
