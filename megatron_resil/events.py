"""Resiliency decisions (fallback, quarantine, cleanup, retention, saves, exits), each reported once
with its reason: one `[resil] <event>: <message>` line printed by rank 0, so operators can grep a
run's decisions, and, when the run saves checkpoints, one JSON line appended to `<save>/events.jsonl`
that outlives the job's console log across restarts and requeues.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

EVENT_LOG_NAME = "events.jsonl"
_event_log_path: str | None = None


def configure(save_dir: str | None) -> None:
    """Where the JSON event log goes: beside the checkpoints, or nowhere without --save."""
    global _event_log_path
    _event_log_path = os.path.join(save_dir, EVENT_LOG_NAME) if save_dir else None


def _is_rank0() -> bool:
    # Imported here, not at the top: the tools that read the event log (requeue, timeline) import this
    # module for its names and must start fast; parallel pulls in torch and megatron-core (~20 s on a
    # loaded machine, which a launch script pays after every job step).
    from megatron_resil import parallel

    return parallel.is_rank0()


def print_rank_0(message: str) -> None:
    if _is_rank0():
        print(message, flush=True)


def decision(event: str, message: str, **fields) -> None:
    """One resiliency decision, one line: `[resil] <event>: <message>`, and one event-log record."""
    print_rank_0(f"[resil] {event}: {message}")
    record(event, message=message, **fields)


def record(event: str, **fields) -> None:
    """Append one event to the JSON event log (rank 0; a no-op without --save)."""
    if _event_log_path is None or not _is_rank0():
        return
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "unix": round(time.time(), 3),
             "event": event, "host": socket.gethostname(), "pid": os.getpid(), **fields}
    try:
        os.makedirs(os.path.dirname(_event_log_path), exist_ok=True)
        # One write of one line in append mode: concurrent or interrupted writers never interleave
        # within a line, and a torn last line is simply skipped by readers.
        with open(_event_log_path, "a") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
    except OSError as err:  # the event log must never be the reason a run fails
        warn(f"could not append to {_event_log_path}: {err}")


def warn(message: str) -> None:
    if _is_rank0():
        print(f"WARNING: {message}", file=sys.stderr, flush=True)
