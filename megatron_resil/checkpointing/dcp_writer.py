"""Accommodations for megatron-core's torch_dist writer, so a save survives preemption and costs less.

Its writer reports through a queue. megatron-core makes it a queue served by a spawned Manager process,
which costs every rank a fresh interpreter that imports torch (seconds on two cores) and dies with the
job-wide SIGTERM. Here no save needs one: a synchronous save reports within the process that runs it, and
an async save's worker sends its results back with its own reply (shard_writer, global_tier), so each save
gets an in-process queue. And torch.save's own per-record CRC, which nothing checks on load, is skipped
while our manifest's CRC covers the same bytes.

The queue is megatron-core's private `filesystem_async._results_queue` (a dependency the patches check at
start-up; where it is gone, megatron-core's own queue is left in place).
"""

from __future__ import annotations

import contextlib
import queue

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async


@contextlib.contextmanager
def without_torch_record_crc():
    """torch.save computes a CRC32 for every zip record, which nothing in the load path checks
    (torch.load does not); our manifest's CRC32 covers the same bytes. Skipping torch's saves ~15% of
    the save time (BENCHMARKS.md). Restored afterwards, so other torch.save calls are unaffected."""
    serialization = torch.serialization
    if not hasattr(serialization, "set_crc32_options"):
        yield
        return
    previous = serialization.get_crc32_options()
    serialization.set_crc32_options(False)
    try:
        yield
    finally:
        serialization.set_crc32_options(previous)


@contextlib.contextmanager
def results_in_this_process():
    """Within, megatron-core's writer reports to a queue in this process: a synchronous save writes here,
    and an async save's results come back from its worker with the worker's reply."""
    if not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


# ---- rank 0's own writes inside a collective save ------------------------------------------------

_late_failures: list[BaseException] | None = None


@contextlib.contextmanager
def rank0_writes_fail_late():
    """Inside a synchronous save, rank 0 alone writes `common.pt` (before the collective shard write),
    DCP's `.metadata` (between the shard-write gather and the broadcast of its outcome) and
    `metadata.json` (before a barrier). An error raised there
    (a full disk) would leave every other rank waiting in that collective. Within this context such an
    error is held, the collectives complete, and it is raised on leaving; the caller agrees on it with
    the other ranks."""
    global _late_failures
    _late_failures = []
    try:
        yield
        if _late_failures:
            raise _late_failures[0]
    finally:
        _late_failures = None


def failing_late(write):
    """`write` (one of rank 0's writes above), holding its error while `rank0_writes_fail_late` is open.
    Installed in megatron-core at start-up (patches/megatron_core.py)."""
    def call(*args, **kwargs):
        if _late_failures is None:
            return write(*args, **kwargs)
        try:
            return write(*args, **kwargs)
        except (OSError, RuntimeError) as err:
            _late_failures.append(err)
            return None
    call.__wrapped__ = write
    return call

