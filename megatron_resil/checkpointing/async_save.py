"""--async-save: training goes on while a background worker writes the checkpoint; the atomic
publish (manifest, rename, tracker) happens only once every rank's worker has written and
checksummed its shards.

What the trainer does for an async save is the staging alone (staging.py): the copy of what this rank
writes into reused host buffers, enqueued on a side stream on a GPU, and the tier's collective planning.
The copy is handed to the worker once it is complete, at the latest before the next optimizer step (or
anything else that changes the state) would overwrite what it reads. Serialising, checksumming, writing and
replicating happen in the worker.

One persistent worker process per rank (Megatron's --use-persistent-ckpt-worker; ours is always
persistent). Not megatron-core's: its worker calls `torch.cuda.set_device` and dies on CPU, and a
dead worker leaves the trainer blocked forever. Here every wait is bounded: a worker that died, or
has not finished within --async-save-timeout-secs, is reported, that save is dropped (never
published, the previous checkpoints intact), and the next save starts a fresh worker. Training
continues. The end of training and every exit path wait for the pending save first.

One save is in flight at a time. An interval save that comes due while the previous one is still being
written is skipped or waits for it, as --async-save-when-busy says (CheckpointManager), and the first such
collision is said in one line with its figures.

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
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from megatron_resil import events, parallel, patches
from megatron_resil.checkpointing import staging
from megatron_resil.checkpointing.staging import HostStaging
from megatron_resil.checkpointing.tier import AsyncSaveJob, CheckpointSaveError, CheckpointTier

WORKER_NAME = b"resil-ckpt-wkr"  # the process name (comm) operators and tests see in ps
_READY = -1  # the tag of the worker's first message: started and imported, ready to write
_ARENA = -2  # the tag of a request that hands the worker the staging arena (sent once per arena)
WHEN_BUSY = ("wait", "skip")  # --async-save-when-busy


def trainer_device_index() -> int | None:
    """The CUDA device this rank trains on (the LOCAL_RANK parallel.initialize chose); None without CUDA."""
    device = parallel.device()
    return device.index if device.type == "cuda" else None


def bind_device(index: int | None) -> None:
    """Put the worker on its trainer's GPU before anything in it touches CUDA: a process that never chose
    a device opens its CUDA context on GPU 0, so every rank's worker would crowd GPU 0's memory. (Staged
    tensors are host memory, so a save normally opens no context in the worker at all.)"""
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
    arenas: dict[int, torch.UntypedStorage] = {}  # the staging arena, mapped once and kept
    while True:
        try:
            item = requests.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != trainer_pid:
                return  # orphaned: the trainer is gone
            continue
        if item is None:
            return
        if item[0] == _ARENA:
            _, arena_id, view = item
            arenas = {arena_id: view.untyped_storage()}  # an older arena is no longer the trainer's
            continue
        tag, payload = item
        began, cpu_began = time.monotonic(), _cpu_seconds()
        try:
            work, work_args = staging.unpickle(payload, arenas)
            outcome = (None, work(*work_args))
        except BaseException as err:  # noqa: BLE001 - reported to the trainer, which decides
            outcome = (f"{type(err).__name__}: {err}", None)
        del item, payload
        work = work_args = None
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
        self.starts = 0  # how many workers this rank has started: a new one must be handed the arena
        self.started_at: float = 0.0
        self.ready_at: float | None = None  # start-up (imports) does not count against a save
        self.last_costs: tuple[float, float] | None = None  # the last job's (CPU seconds, wall seconds)
        self._arena_sent: int | None = None

    def start(self) -> str | None:
        """Make sure a worker is running; returns why an earlier one had to be replaced, if so."""
        if self.process is not None and self.process.is_alive():
            return None
        replaced = None
        if self.process is not None and not self._killed_by_us:
            replaced = f"its worker (pid {self.process.pid}) had died, exit code {self.process.exitcode}"
        self._requests, self._results = self._ctx.Queue(), self._ctx.Queue()
        # Not a daemon: megatron-core's writer may fork writers of its own. So that an exiting trainer
        # never waits on it, it is killed at exit (a pending save is unpublishable then anyway).
        # Its patches (the trainer's) go in before its first import of megatron-core.
        self.process = self._ctx.Process(target=patches.call_installed,
                                         args=(f"{__name__}:_worker_loop", patches.applied(), os.getpid(),
                                               trainer_device_index(), self._requests, self._results))
        self.process.start()
        self.starts += 1
        self.started_at, self.ready_at, self._arena_sent = time.monotonic(), None, None
        self._killed_by_us = False
        if not self._atexit_registered:
            atexit.register(self.kill)
            self._atexit_registered = True
        return replaced

    def submit(self, tag: int, payload: bytes, host: HostStaging) -> None:
        """Hand over a pickled job (`HostStaging.pickle`); the arena it refers to goes first, once."""
        if host.arena is not None and self._arena_sent != host.arena_id:
            # A tensor over the whole arena crosses as a handle to its shared memory, not as data.
            self._requests.put((_ARENA, host.arena_id, torch.empty(0, dtype=torch.uint8).set_(host.arena)))
            self._arena_sent = host.arena_id
        self._requests.put((tag, payload))

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
    started: float  # when the save began (before its state was built)
    on_published: object
    payload: bytes | None  # the pickled job, until it is handed to the worker
    # Seconds the trainer spent on this save, by part: prepare (building the sharded state), plan (the
    # tier's collective planning, the hand-over), copy (into the host buffers, or enqueueing that copy on a
    # GPU), copy_wait (for a device-to-host copy still running at the hand-over), wait (for the worker,
    # when something waited for it) and finalize.
    blocking: dict = field(default_factory=dict)
    handed_over: float | None = None  # when the worker was given it (its time limit runs from here)


class AsyncSaves:
    def __init__(self, timeout_secs: float, max_failures: int = 3, when_busy: str = "wait") -> None:
        assert when_busy in WHEN_BUSY, when_busy
        self.timeout_secs = timeout_secs
        self.max_failures = max_failures
        self.when_busy = when_busy
        self.failures_in_a_row = 0
        self.worker = WriterProcess()
        self.staging = HostStaging()
        self.pending: _Pending | None = None
        self.said_busy = False  # the first collision with a save still being written is said, once
        self._tag = 0
        self._verdict: tuple[str, object] | None = None
        self._job_id: str | None = None  # this job's name for its workers' replication groups

    def submit(self, tier, sharded_state: dict, iteration: int, on_published,
               prepared_s: float = 0.0) -> None:
        """Collective: stage the save and hand the writing to the worker. One save at a time: a
        pending one is finalised first (that wait counts against the pending one). `prepared_s`: the
        trainer's time building `sharded_state`, counted as this save's blocking time."""
        self.wait()
        began = time.monotonic()
        restarts = parallel.all_gather_object((self.worker.start(), self.worker.starts))
        replaced = [f"rank {rank}: {why}" for rank, (why, _) in enumerate(restarts) if why]
        if replaced:
            events.decision("save", "async checkpoint worker restarted before the save of iteration "
                            f"{iteration} (" + "; ".join(replaced) + ")", iteration=iteration,
                            reasons=replaced)
        if self._job_id is None:
            self._job_id = parallel.broadcast_object(os.urandom(6).hex())
        # Changes whenever any rank's worker is a new one: the workers' own process group is made anew.
        workers = f"{self._job_id}/" + "-".join(str(starts) for _, starts in restarts)
        self.staging.copy_seconds = 0.0
        try:
            job = tier.save_async(sharded_state, iteration, self.staging, workers)
        except CheckpointSaveError as err:  # agreed on every rank: dropped like a failed write
            self._failed(tier.name, iteration, err)
            return
        payload = self.staging.pickle((job.work, job.work_args))
        self._tag += 1
        copy = self.staging.copy_seconds
        blocking = {"prepare": prepared_s, "plan": time.monotonic() - began - copy, "copy": copy}
        self.pending = _Pending(tier, job, self._tag, began - prepared_s, on_published, payload, blocking)
        self._verdict = None
        if not self.staging.copying():
            self._hand_over()

    def _hand_over(self) -> None:
        """Give the pending save to the worker once its device-to-host copy is complete (waiting for it
        if it is not: the caller is about to change the state it copies)."""
        pending = self.pending
        began = time.monotonic()
        self.staging.wait_copied()
        pending.blocking["copy_wait"] = pending.blocking.get("copy_wait", 0.0) + time.monotonic() - began
        self.worker.submit(pending.tag, pending.payload, self.staging)
        pending.payload, pending.handed_over = None, time.monotonic()

    def before_state_changes(self) -> None:
        """Called before anything writes to the state a pending save may still be copying from (the
        optimizer step, a load): the copy is finished and the save handed to the worker."""
        if self.pending is not None and self.pending.handed_over is None:
            self._hand_over()

    def writing_for(self) -> float:
        """Seconds the pending save has been with the worker (0 if it has not been handed over)."""
        handed = self.pending.handed_over if self.pending is not None else None
        return 0.0 if handed is None else time.monotonic() - handed

    def _local_status(self) -> tuple[str, object]:
        # The verdict is kept: the worker reports once, but the ranks may agree only later.
        if self._verdict is not None:
            return self._verdict
        if self.pending.handed_over is None:
            if self.staging.copying():
                return "running", None
            self._hand_over()
        status, payload = self.worker.poll(self.pending.tag)
        ready = self.worker.ready_at
        if status == "running" and ready is None and \
                time.monotonic() - self.worker.started_at > self.timeout_secs + WORKER_STARTUP_GRACE_SECS:
            self.worker.kill()
            status, payload = "failed", (
                f"the worker did not start within {WORKER_STARTUP_GRACE_SECS:g} s plus "
                f"--async-save-timeout-secs {self.timeout_secs:g} and was killed")
        elif status == "running" and ready is not None and \
                time.monotonic() - max(self.pending.handed_over, ready) > self.timeout_secs:
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
        if blocking:
            self.before_state_changes()
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
            path = job.publish([result for _, (result, _) in verdicts])
        except CheckpointSaveError as err:
            self.worker.start()  # a fresh one now where one failed, so its start-up overlaps training
            self._failed(name, job.iteration, err)
            return False
        self.failures_in_a_row = 0
        now = time.monotonic()
        parts = {**pending.blocking, "wait": pending.blocking.get("wait", 0.0) + waited,
                 "finalize": now - started - waited}
        worker = {}
        if costs:
            worker = {"cpu_seconds": max(c for c, _ in costs), "seconds": max(w for _, w in costs)}
        # The worker's own phases (serialise, checksum, write, replicate), from its slowest rank.
        for _, (_, phases) in verdicts:
            for phase, seconds in (phases or {}).items():
                worker[f"{phase}_seconds"] = max(worker.get(f"{phase}_seconds", 0.0), seconds)
        pending.on_published(pending.tier, job.iteration, path, now - pending.started, blocking=parts,
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
