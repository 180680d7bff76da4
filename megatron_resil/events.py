"""Resiliency decisions (fallback, cleanup, retention, exit), each reported once with its reason.

Printed by rank 0 as one line starting with `[resil]` so operators can grep a run's decisions.
"""

from __future__ import annotations

import sys

from megatron_resil import parallel


def print_rank_0(message: str) -> None:
    if parallel.is_rank0():
        print(message, flush=True)


def decision(event: str, message: str) -> None:
    """One resiliency decision, one line: `[resil] <event>: <message>`."""
    print_rank_0(f"[resil] {event}: {message}")


def warn(message: str) -> None:
    if parallel.is_rank0():
        print(f"WARNING: {message}", file=sys.stderr, flush=True)
