"""Accommodations for megatron-core's torch_dist writer, so a save survives preemption and costs less.

Its writer reports through a queue. megatron-core makes it a queue served by a spawned Manager process,
which costs every rank a fresh interpreter that imports torch (seconds on two cores) and dies with the
job-wide SIGTERM. Here no save needs one: a synchronous save reports within the process that runs it, and
an async save's worker sends its results back with its own reply (shard_writer, global_tier), so each save
gets an in-process queue. And torch.save's own per-record CRC, which nothing checks on load, is skipped
while our manifest's CRC covers the same bytes.

megatron-core's writer asks its module's queue getter for the queue at each save; a record in
patches/megatron_core.py has it answered by `results_queue_from` with ours, at start-up. Where that record
stood down, megatron-core's own queue is left in place.
"""

from __future__ import annotations

import contextlib
import functools
import queue
from collections.abc import Callable

import torch


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


_this_save_queue: queue.Queue | None = None  # the save's own, while results_in_this_process is open


def results_queue_from(megatron_getter: Callable) -> Callable:
    """megatron-core's write-results queue getter, answering with the queue of the save under way in this
    process (`results_in_this_process`), else as megatron-core does. Installed at start-up
    (patches/megatron_core.py)."""
    @functools.wraps(megatron_getter)
    def results_queue(*args, **kwargs):
        if _this_save_queue is not None:
            return _this_save_queue
        return megatron_getter(*args, **kwargs)

    return results_queue


@contextlib.contextmanager
def results_in_this_process():
    """Within, megatron-core's writer reports to a queue in this process: a synchronous save writes here,
    and an async save's results come back from its worker with the worker's reply."""
    global _this_save_queue
    previous, _this_save_queue = _this_save_queue, queue.Queue()
    try:
        yield
    finally:
        _this_save_queue = previous


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

