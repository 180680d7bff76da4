"""Accommodations for megatron-core's torch_dist writer, so a save survives preemption and costs less.

Its writer reports through a queue. megatron-core makes it a queue served by a spawned Manager process,
which costs every rank a fresh interpreter that imports torch (seconds on two cores) and dies with the
job-wide SIGTERM. A synchronous save reports within the process that runs it, so it gets an in-process
queue; only --async-save, whose worker is another process, needs the Manager: we start that one
ourselves, early and deaf to termination signals. And torch.save's own per-record CRC, which nothing
checks on load, is skipped while our manifest's CRC covers the same bytes.

The queue is megatron-core's private `filesystem_async._results_queue` (a dependency the patches check at
start-up; where it is gone, megatron-core's own queue is left in place).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import queue
import threading
from multiprocessing.managers import SyncManager

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_resil.checkpointing import write_queue_server


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
    """For a synchronous save: megatron-core's writer runs in this process (its forked helpers report
    to it through their own queue), so its results queue need not cross a process boundary."""
    if not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


def _start_write_queue() -> None:
    """megatron-core's torch_dist writer reports through a queue served by a spawned Manager process.
    A preemption signals every process of the job, and a Manager with default handlers dies at once,
    breaking the very save that --exit-signal-handler asked for. Start it ourselves, deaf to SIGTERM
    and SIGINT (it exits with this process), and hand it to megatron-core."""
    if getattr(filesystem_async, "_results_queue", "absent") is not None:
        return  # already created, or this megatron-core has no such queue
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=write_queue_server.ignore_termination_signals)
    filesystem_async._results_queue = manager.Queue()
    _MANAGERS.append(manager)  # keep it alive for the life of the process


_MANAGERS: list[SyncManager] = []
_queue_starter: threading.Thread | None = None


def prepare_for_saving() -> None:
    """Start the Manager for async saves in the background, so the first save does not wait for it."""
    global _queue_starter
    if _queue_starter is None:
        _queue_starter = threading.Thread(target=_start_write_queue, name="ckpt-write-queue", daemon=True)
        _queue_starter.start()
        # An exit while the helper is still starting would leave multiprocessing waiting on a
        # half-started Manager; let the start finish first (atexit runs this before multiprocessing's
        # own exit handler, which then shuts the Manager down).
        atexit.register(_queue_starter.join)


def ensure_write_queue() -> None:
    prepare_for_saving()
    _queue_starter.join()
    _start_write_queue()  # no-op if the background start succeeded; raises here if it failed


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

