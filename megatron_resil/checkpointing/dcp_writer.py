"""Accommodations for megatron-core's torch_dist writer, so a save survives preemption and costs less.

Its writer reports through a queue. megatron-core makes it a queue served by a spawned Manager process,
which costs every rank a fresh interpreter that imports torch (seconds on two cores) and dies with the
job-wide SIGTERM. A synchronous save reports within the process that runs it, so it gets an in-process
queue; only --async-save, whose worker is another process, needs the Manager: we start that one
ourselves, early and deaf to termination signals. And torch.save's own per-record CRC, which nothing
checks on load, is skipped while our manifest's CRC covers the same bytes.

megatron-core's writer asks its module's private queue getter for the queue at each save; a record in
patches/megatron_core.py has it answered by `results_queue_from` with ours, at start-up. Where that record
stood down, megatron-core's own queue is left in place and nothing here starts one.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable
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


_answering = False  # megatron-core's queue getter answers with ours (the record was applied)
_this_save_queue: queue.Queue | None = None  # a synchronous save's, while it runs
_manager_queue = None  # async saves': served by our Manager, once started


def results_queue_from(megatron_getter: Callable) -> Callable:
    """megatron-core's write-results queue getter, answering with this process's queue for a synchronous
    save, else our Manager's once started, else megatron-core's own. Installed at start-up
    (patches/megatron_core.py)."""
    global _answering
    _answering = True

    @functools.wraps(megatron_getter)
    def results_queue(*args, **kwargs):
        if _this_save_queue is not None:
            return _this_save_queue
        if _manager_queue is not None:
            return _manager_queue
        return megatron_getter(*args, **kwargs)

    return results_queue


def async_results_queue():
    """The queue async saves' results travel through, None before one exists: ours, or megatron-core's
    own where the record stood down."""
    return _manager_queue if _answering else getattr(filesystem_async, "_results_queue", None)


@contextlib.contextmanager
def results_in_this_process():
    """For a synchronous save: megatron-core's writer runs in this process (its forked helpers report
    to it through their own queue), so its results queue need not cross a process boundary."""
    global _this_save_queue
    _this_save_queue = queue.Queue()
    try:
        yield
    finally:
        _this_save_queue = None


def _start_write_queue() -> None:
    """megatron-core's torch_dist writer reports through a queue served by a spawned Manager process.
    A preemption signals every process of the job, and a Manager with default handlers dies at once,
    breaking the very save that --exit-signal-handler asked for. Start it ourselves, deaf to SIGTERM
    and SIGINT (it exits with this process), for megatron-core's getter to answer with."""
    global _manager_queue
    if _manager_queue is not None or not _answering:
        return  # already started, or megatron-core's own queue is in use
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=write_queue_server.ignore_termination_signals)
    _manager_queue = manager.Queue()
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

