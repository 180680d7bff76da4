"""One job per checkpoint directory.

Two jobs started on one `--save` overwrite each other's checkpoints while both print "successfully
saved", and a job starting while another saves removes the other's live staging directory as
"leftovers". So each checkpoint directory a run writes (`--save`, the non-persistent directory, this
node's local directory) is locked at start, before any clean-up, and held for the job's life:

- `<dir>/.resil.lock` holds the holder (host, pid, the process's start time and the host's boot id,
  Slurm job id, torchrun run id, start time, lease renewal time) and is `flock`ed by the holder's
  process, so a holder that dies (even by SIGKILL) frees it on this host at once;
- the record is untrusted input (anyone who may write the directory may write it): one that does not
  read as a lock record is stale, and taken over with what is wrong with it;
- on this host, a recorded pid whose flock is free counts as the holder only if it is the same process
  (alive, with the recorded start time, since this boot): pids are reused, and a command line proves
  nothing;
- the holder renews its lease every LEASE_SECS / 4; a lock written on another host whose lease is older
  than LEASE_SECS is stale (that host or job is gone: a shared file system's flock cannot be trusted);
- a requeued or restarted attempt of the same job (the same Slurm job id, or the same torchrun run id
  for an in-job restart) takes the lock back without a fight.

A second job gets one line naming the holder and how to clear a stale lock, and exits 2 (the same
command would fail the same way). Every takeover is logged with its reason.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import math
import os
import socket
import threading
import time

from megatron_resil import rank_process

LOCK_NAME = ".resil.lock"
LEASE_SECS = 300.0
CLOCK_SKEW_SECS = 60.0  # how far ahead of ours another host's clock may run before its lease is a lie
_RECORD_BYTES = 1024
_MAX_RECORD_BYTES = 4096
_PID_MAX = 4194304  # the kernel's PID_MAX_LIMIT: no host's pid_max goes above it
_MAX_STRING = 255


class DirectoryInUse(Exception):
    """Another live job holds the directory; the message names it."""


def _me() -> dict:
    # The start time, not a marker in the environment: a variable set after exec never shows in
    # /proc/<pid>/environ, and the launcher's environment is not ours to set.
    return {"host": socket.gethostname(), "pid": os.getpid(), "boot_id": _boot_id(),
            "start_ticks": _start_ticks(os.getpid()), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "renewed": time.time()}


def describe(holder: dict) -> str:
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {holder.get('started')}"


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot; None if no such process lives (a zombie has
    closed its files, its flock with them)."""
    found = rank_process.proc_stat(pid)
    return None if found is None or found.state == "Z" else found.start_ticks


class DirectoryLock:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self.fd: int | None = None
        self._holder: dict = {}
        self._renewer: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Take the lock; returns why a previous holder's lock was taken over (None if there was none
        or it was ours). Raises DirectoryInUse naming a live holder, OSError if the directory is not
        usable."""
        if self.fd is not None:
            return None  # held already (an in-process restart)
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            previous, malformed = _read(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                if previous:
                    who = describe(previous)
                else:
                    who = f"its lock record is malformed: {malformed}" if malformed else "not named yet"
                raise self._refusal(f"another job ({who})", "wait for it to end") from None
            previous, malformed = _read(fd)  # as the last holder left it
            self._holder = _me()
            if malformed:
                takeover = f"taken over from a job that left a malformed lock record ({malformed})"
            else:
                takeover = self._judge(previous) if previous else None
            try:
                self._write(fd, self._holder)
            except OSError as err:  # a full disk: the flock holds all the same; only the name is missing
                if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._renewer = threading.Thread(target=self._renew, name="dir-lock-lease", daemon=True)
        self._renewer.start()
        atexit.register(self.release)
        return takeover

    def release(self) -> None:
        """At a normal exit: the lock file says it was released, so the next job needs no takeover (a
        crashed holder leaves its name, and the next job logs why it took over). The file stays:
        unlinking it could let two jobs lock two different files of one name."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            self._write(fd, {"released": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        except OSError:
            pass
        os.close(fd)

    def _judge(self, previous: dict) -> str | None:
        """We hold the flock: is the last holder (a well-formed record) gone? Raises DirectoryInUse if
        it may not be."""
        me = self._holder
        if all(previous.get(key) == me[key] for key in ("host", "pid", "boot_id", "start_ticks")):
            return None
        same_job = (me["slurm_job_id"] and previous.get("slurm_job_id") == me["slurm_job_id"]) or \
            (me["run_id"] and previous.get("run_id") == me["run_id"])
        if same_job:
            return f"taken back from an earlier attempt of this job ({describe(previous)})"
        if previous["host"] == me["host"]:
            return f"taken over from a job that is gone ({describe(previous)}: {self._gone_here(previous)})"
        age = max(0.0, time.time() - previous["renewed"])  # a clock a little ahead of ours: just renewed
        if age < LEASE_SECS:
            raise self._refusal(f"a job on another host ({describe(previous)}, lease renewed {age:.0f} s "
                                f"ago)", f"wait for it to end (a lease left by a dead job expires after "
                                f"{LEASE_SECS:.0f} s)")
        expired = age - LEASE_SECS
        return f"taken over from a job whose lease expired {expired:.0f} s ago ({describe(previous)})"

    def _gone_here(self, previous: dict) -> str:
        """Why a holder on this host whose flock is free is gone; raises DirectoryInUse if the very
        process the record names is alive all the same (its lock file replaced under it, say)."""
        pid = previous["pid"]
        ticks = _start_ticks(pid)
        if previous.get("start_ticks") is None or previous.get("boot_id") is None:
            # Written by an earlier version, without the start time to tell that process by: the free
            # flock is the evidence.
            return "no such process" if ticks is None else \
                f"pid {pid} is alive but holds no lock, and the record gives no start time to tell it by"
        if previous["boot_id"] != self._holder["boot_id"]:
            return "written before this host last booted"
        if ticks is None:
            return "no such process"
        if ticks != previous["start_ticks"]:
            return f"pid {pid} is now another process"
        raise self._refusal(f"another job ({describe(previous)}), alive though it holds no flock on "
                            f"{LOCK_NAME}", "stop it")

    def _refusal(self, holder: str, advice: str) -> DirectoryInUse:
        return DirectoryInUse(f"{self.directory} is in use by {holder}; {advice} or give this job its own "
                              f"directory; if that job is gone, remove {self.path}")

    @staticmethod
    def _write(fd: int, holder: dict) -> None:
        """In place, padded to a fixed size: once the file has its block, rewriting it needs no free
        space (a full disk must not stop the next job from taking the lock)."""
        data = json.dumps(holder, sort_keys=True).encode().ljust(_RECORD_BYTES - 1) + b"\n"
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        os.fsync(fd)

    def _renew(self) -> None:
        while self.fd is not None:
            time.sleep(LEASE_SECS / 4)
            try:
                self._holder["renewed"] = time.time()
                if self.fd is not None:
                    self._write(self.fd, self._holder)
            except OSError:
                pass  # a full disk: the flock still holds on this host


def _read(fd: int) -> tuple[dict | None, str | None]:
    """The holder the lock file names (None: a new file, or released at a normal exit), or what makes
    its content no lock record: anyone who may write the directory may have written it."""
    try:
        raw = os.pread(fd, _MAX_RECORD_BYTES + 1, 0)
    except OSError as err:
        return None, f"unreadable: {err.strerror or err}"
    if len(raw) > _MAX_RECORD_BYTES:
        return None, f"over {_MAX_RECORD_BYTES} bytes"
    if not raw.strip():
        return None, None
    try:
        record = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, "not JSON"
    if isinstance(record, dict) and "pid" not in record and isinstance(record.get("released"), str):
        return None, None
    malformed = _malformed(record)
    return (None, malformed) if malformed else (record, None)


def _malformed(record) -> str | None:
    """What makes a decoded record no holder's record, or None."""
    if not isinstance(record, dict):
        return f"{_show(record)} is not a JSON object"
    pid = record.get("pid")
    if type(pid) is not int or not 1 <= pid <= _PID_MAX:
        return f"pid {_show(pid)} is not a process id"
    renewed = record.get("renewed")
    if type(renewed) not in (int, float) or not math.isfinite(renewed):
        return f"renewed {_show(renewed)} is not a time"
    ahead = renewed - time.time()
    if ahead > CLOCK_SKEW_SECS:
        return f"its lease was renewed {ahead:.0f} s in the future"
    for key in ("host", "started", "slurm_job_id", "run_id", "boot_id"):
        value = record.get(key)
        if value is None and key not in ("host", "started"):
            continue
        if not (isinstance(value, str) and len(value) <= _MAX_STRING and value.isprintable()):
            return f"{key} {_show(value)} is not a short printable string"
    ticks = record.get("start_ticks")
    if ticks is not None and (type(ticks) is not int or ticks < 0):
        return f"start_ticks {_show(ticks)} is not a clock tick count"
    return None


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_held: list[DirectoryLock] = []


def lock_run_directories(args) -> None:
    """Collective, at start-up before anything is written (the event log included): global rank 0 locks
    --save and the global non-persistent directory, each node's local rank 0 its local directory. Every
    takeover is logged; if any directory is held by another job, every rank exits 2 after one line that
    names the holder, and nothing is written into that job's directory, its event log included."""
    from megatron_resil import events, exit_codes, parallel

    directories = []
    if parallel.is_rank0():
        directories += [args.save] if args.save else []
        if args.non_persistent_ckpt_type == "global" and args.non_persistent_global_ckpt_dir:
            directories.append(args.non_persistent_global_ckpt_dir)
    if args.non_persistent_ckpt_type == "local" and args.non_persistent_local_ckpt_dir and \
            int(os.environ.get("LOCAL_RANK", "0")) == 0:
        directories.append(args.non_persistent_local_ckpt_dir)
    refused, takeovers = None, []
    held = {os.path.realpath(lock.directory) for lock in _held if lock.fd is not None}
    for directory in directories:
        if os.path.realpath(directory) in held:
            continue  # an in-process restart: this process holds it already
        lock = DirectoryLock(directory)
        try:
            reason = lock.acquire()
        except DirectoryInUse as err:
            refused = str(err)
            break
        except OSError as err:
            refused = f"{directory}: cannot take its lock {LOCK_NAME} ({err.strerror or err})"
            break
        _held.append(lock)
        if reason:
            takeovers.append(f"{directory}: {reason}")
    outcomes = parallel.all_gather_object((refused, takeovers))
    for _, taken in outcomes:
        for line in taken:
            events.print_rank_0(f"[resil] lock: {line}")  # recorded in the event log once it opens
            _pending_records.append(line)
    refusals = [r for r, _ in outcomes if r is not None]
    if refusals:
        events.print_rank_0(f"[resil] exit: {refusals[0]}; exiting with code {exit_codes.BAD_ARGUMENTS}")
        raise SystemExit(exit_codes.BAD_ARGUMENTS)


_pending_records: list[str] = []


def record_takeovers() -> None:
    """Once the event log is open (after the lock): the takeovers, as records."""
    from megatron_resil import events

    for line in _pending_records:
        events.record("lock", message=line)
    _pending_records.clear()
