"""--async-save: training goes on while a background worker writes the checkpoint; the atomic
publish (manifest, rename, tracker) happens only once every rank's worker has written and
checksummed its shards.

One persistent worker process per rank (Megatron's --use-persistent-ckpt-worker; ours is always
persistent). Not megatron-core's: its worker calls `torch.cuda.set_device` and dies on CPU, and a
dead worker leaves the trainer blocked forever. Here every wait is bounded: a worker that died, or
has not finished within --async-save-timeout-secs, is reported, that save is dropped (never
published, the previous checkpoints intact), and the next save starts a fresh worker. Training
continues. The end of training and every exit path wait for the pending save first.

Each iteration the ranks agree, in one small all-reduce while a save is pending, whether every
worker is done; so finalisation happens at the same iteration on every rank.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import queue
import resource
import signal
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from megatron_resil import events, parallel, patches
from megatron_resil.checkpointing.tier import AsyncSaveJob, CheckpointSaveError, CheckpointTier

WORKER_NAME = b"resil-ckpt-wkr"  # the process name (comm) operators and tests see in ps
_READY = -1  # the tag of the worker's first message: started and imported, ready to write


def trainer_device_index() -> int | None:
    """The CUDA device this rank trains on (the LOCAL_RANK parallel.initialize chose); None without CUDA."""
    device = parallel.device()
    return device.index if device.type == "cuda" else None


def bind_device(index: int | None) -> None:
    """Put the worker on its trainer's GPU before anything in it touches CUDA. megatron-core's preload
    (an async save's first step) calls torch.cuda.synchronize(): in a process that never chose a device
    that opens a CUDA context on GPU 0, so every rank's worker would crowd GPU 0's memory."""
    if index is not None:
        torch.cuda.set_device(index)


def _worker_loop(trainer_pid: int, device_index: int | None, requests, results) -> None:
    """Run the write jobs the trainer sends (each tier's `AsyncSaveJob.work`), report. Deaf to the job-wide
    SIGTERM/SIGINT (so a preemption does not break the save it asks for), gone with its trainer."""
    bind_device(device_index)  # first: before any CUDA call
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The tiers' modules (megatron-core, NVRx) are imported before "ready", not inside a save.
    import megatron_resil.checkpointing.global_tier  # noqa: F401
    import megatron_resil.checkpointing.local_tier  # noqa: F401
    results.put((_READY, None, None, None))
    try:
        ctypes.CDLL(None).prctl(15, WORKER_NAME, 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
    while True:
        try:
            item = requests.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != trainer_pid:
                return  # orphaned: the trainer is gone
            continue
        if item is None:
            return
        tag, work, work_args = item
        began, cpu_began = time.monotonic(), _cpu_seconds()
        try:
            outcome = (None, work(*work_args))
        except BaseException as err:  # noqa: BLE001 - reported to the trainer, which decides
            outcome = (f"{type(err).__name__}: {err}", None)
        del item, work_args
        # What the write cost: the worker's and its forked writers' CPU time (taken from the training
        # ranks where the cores are all busy), and its wall time.
        results.put((tag, *outcome, (_cpu_seconds() - cpu_began, time.monotonic() - began)))


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


# A new worker imports torch and megatron-core before it takes its first save: seconds, or tens of seconds
# on a loaded machine. That start-up is bounded apart, so --async-save-timeout-secs bounds the writing.
WORKER_STARTUP_GRACE_SECS = 120.0


class WriterProcess:
    """This rank's persistent worker, started on first use and restarted after a failure."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self.process = None
        self._requests = self._results = None
        self._atexit_registered = False
        self._killed_by_us = False
        self.started_at: float = 0.0
        self.ready_at: float | None = None  # start-up (imports) does not count against a save
        self.last_costs: tuple[float, float] | None = None  # the last job's (CPU seconds, wall seconds)

    def start(self) -> str | None:
        """Make sure a worker is running; returns why an earlier one had to be replaced, if so."""
        if self.process is not None and self.process.is_alive():
            return None
        replaced = None
        if self.process is not None and not self._killed_by_us:
            replaced = f"its worker (pid {self.process.pid}) had died, exit code {self.process.exitcode}"
        self._requests, self._results = self._ctx.Queue(), self._ctx.Queue()
        # Not a daemon: megatron-core's writer forks its own writers. So that an exiting trainer
        # never waits on it, it is killed at exit (a pending save is unpublishable then anyway).
        # Its patches (the trainer's) go in before its first import of megatron-core.
        self.process = self._ctx.Process(target=patches.call_installed,
                                         args=(f"{__name__}:_worker_loop", patches.applied(), os.getpid(),
                                               trainer_device_index(), self._requests, self._results))
        self.process.start()
        self.started_at, self.ready_at = time.monotonic(), None
        self._killed_by_us = False
        if not self._atexit_registered:
            atexit.register(self.kill)
            self._atexit_registered = True
        return replaced

    def submit(self, tag: int, work, work_args: tuple) -> None:
        self._requests.put((tag, work, work_args))

    def poll(self, tag: int) -> tuple[str, object]:
        """("running", None), ("done", result) or ("failed", why) for request `tag`."""
        try:
            got, error, result, self.last_costs = self._results.get_nowait()
            if got == _READY:
                self.ready_at = time.monotonic()
                return "running", None
        except queue.Empty:
            if self.process.is_alive():
                return "running", None
            try:  # it may have reported just before exiting
                got, error, result, self.last_costs = self._results.get(timeout=0.5)
            except queue.Empty:
                return "failed", (f"the worker (pid {self.process.pid}) died, exit code "
                                  f"{self.process.exitcode}")
        assert got == tag, (got, tag)
        return ("failed", error) if error else ("done", result)

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self._killed_by_us = True
            self.process.kill()
            self.process.join(5)

    def close(self) -> None:
        if self.process is not None and self.process.is_alive():
            self._requests.put(None)
            self.process.join(30)
        self.kill()


@dataclass
class _Pending:
    tier: CheckpointTier
    job: AsyncSaveJob
    tag: int
    started: float
    on_published: object
    blocking: dict  # seconds the trainer spent on this save, by part: prepare, stage, wait, finalize


class AsyncSaves:
    def __init__(self, timeout_secs: float, max_failures: int = 3) -> None:
        self.timeout_secs = timeout_secs
        self.max_failures = max_failures
        self.failures_in_a_row = 0
        self.worker = WriterProcess()
        self.pending: _Pending | None = None
        self._tag = 0
        self._verdict: tuple[str, object] | None = None

    def submit(self, tier, sharded_state: dict, iteration: int, on_published,
               prepared_s: float = 0.0) -> None:
        """Collective: stage the save and hand the writing to the worker. One save at a time: a
        pending one is finalised first (that wait counts against the pending one). `prepared_s`: the
        trainer's time building `sharded_state`, counted as this save's blocking time."""
        self.wait()
        started = time.monotonic()
        restarts = parallel.all_gather_object(self.worker.start())
        replaced = [f"rank {rank}: {why}" for rank, why in enumerate(restarts) if why]
        if replaced:
            events.decision("save", "async checkpoint worker restarted before the save of iteration "
                            f"{iteration} (" + "; ".join(replaced) + ")", iteration=iteration,
                            reasons=replaced)
        try:
            job = tier.save_async(sharded_state, iteration)
        except CheckpointSaveError as err:  # agreed on every rank: dropped like a failed write
            self._failed(tier.name, iteration, err)
            return
        self._tag += 1
        self.worker.submit(self._tag, job.work, job.work_args)
        now = time.monotonic()
        self.pending = _Pending(tier, job, self._tag, now, on_published,
                                {"prepare": prepared_s, "stage": now - started})
        self._verdict = None

    def _local_status(self) -> tuple[str, object]:
        # The verdict is kept: the worker reports once, but the ranks may agree only later.
        if self._verdict is not None:
            return self._verdict
        status, payload = self.worker.poll(self.pending.tag)
        ready = self.worker.ready_at
        if status == "running" and ready is None and \
                time.monotonic() - self.worker.started_at > self.timeout_secs + WORKER_STARTUP_GRACE_SECS:
            self.worker.kill()
            status, payload = "failed", (
                f"the worker did not start within {WORKER_STARTUP_GRACE_SECS:g} s plus "
                f"--async-save-timeout-secs {self.timeout_secs:g} and was killed")
        elif status == "running" and ready is not None and \
                time.monotonic() - max(self.pending.started, ready) > self.timeout_secs:
            self.worker.kill()
            status, payload = "failed", (f"the worker did not finish within --async-save-timeout-secs "
                                         f"{self.timeout_secs:g} and was killed")
        if status != "running":
            self._verdict = (status, payload)
        return status, payload

    def poll(self, blocking: bool = False) -> bool:
        """Collective: finalise the pending save if every rank's worker is through with it.
        Returns True if a save was published."""
        if self.pending is None:
            return False
        started = time.monotonic()
        status, payload = self._local_status()
        while blocking and status == "running":
            time.sleep(0.05)
            status, payload = self._local_status()
        waited = time.monotonic() - started
        if not parallel.all_ranks_agree(status != "running"):
            return False
        pending, self.pending = self.pending, None
        job, name = pending.job, pending.tier.name
        gathered = parallel.all_gather_object((status, payload, self.worker.last_costs))
        verdicts = [(verdict, why) for verdict, why, _ in gathered]
        costs = [cost for _, _, cost in gathered if cost is not None]
        failures = [f"rank {rank}: {why}" for rank, (verdict, why) in enumerate(verdicts)
                    if verdict == "failed"]
        try:
            if failures:
                job.abandon()
                raise CheckpointSaveError("; ".join(failures))
            path = job.publish([result for _, result in verdicts])
        except CheckpointSaveError as err:
            self.worker.start()  # a fresh one now where one failed, so its start-up overlaps training
            self._failed(name, job.iteration, err)
            return False
        self.failures_in_a_row = 0
        now = time.monotonic()
        parts = {**pending.blocking, "wait": waited, "finalize": now - started - waited}
        worker = {}
        if costs:
            worker = {"cpu_seconds": max(c for c, _ in costs), "seconds": max(w for _, w in costs)}
        whole = now - pending.started + parts["prepare"] + parts["stage"]  # from the save's start
        pending.on_published(pending.tier, job.iteration, path, whole, blocking=parts,
                             worker=worker)
        return True

    def _failed(self, name: str, iteration: int, err: CheckpointSaveError) -> None:
        """One failed async save is dropped; --async-save-max-failures in a row end the job (exit 4)."""
        self.failures_in_a_row += 1
        if self.failures_in_a_row >= self.max_failures:  # a disk that stays full, a dead file system
            raise CheckpointSaveError(f"{self.failures_in_a_row} async saves in a row failed "
                                      f"(--async-save-max-failures {self.max_failures}), the last of {name} "
                                      f"iteration {iteration}: {err}") from None
        events.decision("save", f"async save of {name} iteration {iteration} failed ({err}); nothing was "
                        "published, the previous checkpoints are intact; training continues "
                        f"({self.failures_in_a_row} of at most {self.max_failures - 1} failures in a row)",
                        tier=name, iteration=iteration, reason=str(err))

    def wait(self) -> bool:
        return self.poll(blocking=True)

    def close(self) -> None:
        self.wait()
        self.worker.close()
