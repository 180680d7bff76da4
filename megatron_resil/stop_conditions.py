"""Requested stops that save first: --exit-interval and --exit-duration-in-mins, as in Megatron.

Checked once per iteration; the duration is judged on rank 0's clock and shared, so every rank
stops at the same iteration.
"""

from __future__ import annotations

import argparse
import time

from megatron_resil import parallel


class StopConditions:
    def __init__(self, args: argparse.Namespace) -> None:
        self.exit_interval = args.exit_interval
        self.deadline = (time.monotonic() + 60.0 * args.exit_duration_in_mins
                         if args.exit_duration_in_mins else None)

    def reason_to_stop(self, iteration: int) -> str | None:
        if self.exit_interval and iteration % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval} reached at iteration {iteration}"
        if self.deadline is not None:
            expired = parallel.broadcast_object(time.monotonic() >= self.deadline
                                                if parallel.is_rank0() else None)
            if expired:
                return f"--exit-duration-in-mins elapsed at iteration {iteration}"
        return None
