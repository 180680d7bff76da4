"""One job per checkpoint directory.

Two jobs started on one `--save` overwrite each other's checkpoints while both print "successfully
saved", and a job starting while another saves removes the other's live staging directory as
"leftovers". So each checkpoint directory a run writes (`--save`, the non-persistent directory, this
node's local directory) is locked at start, before any clean-up, and held for the job's life:

- `<dir>/.resil.lock` holds the holder (host, pid, Slurm job id, torchrun run id, start time, lease
  renewal time) and is `flock`ed by the holder's process, so a holder that dies (even by SIGKILL) frees
  it on this host at once;
- the holder renews its lease every LEASE_SECS / 4; a lock written on another host whose lease is older
  than LEASE_SECS is stale (that host or job is gone: a shared file system's flock cannot be trusted);
- a requeued or restarted attempt of the same job (the same Slurm job id, or the same torchrun run id
  for an in-job restart) takes the lock back without a fight.

A second job gets one line naming the holder and exits 2 (the same command would fail the same way).
Every takeover is logged with its reason.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import threading
import time

LOCK_NAME = ".resil.lock"
LEASE_SECS = 300.0
_RECORD_BYTES = 1024


class DirectoryInUse(Exception):
    """Another live job holds the directory; the message names it."""


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "renewed": time.time()}


def describe(holder: dict) -> str:
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {holder.get('started')}"


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


class DirectoryLock:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self.fd: int | None = None
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
            previous = _read(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                raise DirectoryInUse(f"{self.directory} is in use by another job ({describe(previous)}); "
                                     "wait for it to end or give this job its own directory") from None
            previous = _read(fd)  # as the last holder left it
            takeover = self._judge(previous)
            try:
                self._write(fd, _me())
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

    def _judge(self, previous: dict | None) -> str | None:
        """We hold the flock: is the last holder gone? Raises DirectoryInUse if it may not be."""
        if not previous or previous.get("pid") is None:  # new, or released at a normal exit
            return None
        me = _me()
        if previous.get("host") == me["host"] and previous.get("pid") == me["pid"]:
            return None
        same_job = (me["slurm_job_id"] and previous.get("slurm_job_id") == me["slurm_job_id"]) or \
            (me["run_id"] and previous.get("run_id") == me["run_id"])
        if same_job:
            return f"taken back from an earlier attempt of this job ({describe(previous)})"
        if previous.get("host") == me["host"]:
            if _pid_alive(previous["pid"]) and _cmdline_mentions(previous["pid"], self.directory):
                raise DirectoryInUse(f"{self.directory} is in use by another job ({describe(previous)}), "
                                     "which holds no lock but is alive; stop it or give this job its own "
                                     "directory")
            return f"taken over from a job that is gone ({describe(previous)}: no such process)"
        age = time.time() - float(previous.get("renewed") or 0)
        if age < LEASE_SECS:
            raise DirectoryInUse(f"{self.directory} is in use by a job on another host "
                                 f"({describe(previous)}, lease renewed {age:.0f} s ago); wait for it "
                                 f"to end (a lease left by a dead job expires after {LEASE_SECS:.0f} s) "
                                 "or give this job its own directory")
        expired = age - LEASE_SECS
        return f"taken over from a job whose lease expired {expired:.0f} s ago ({describe(previous)})"

    @staticmethod
    def _write(fd: int, holder: dict) -> None:
        """In place, padded to a fixed size: once the file has its block, rewriting it needs no free
        space (a full disk must not stop the next job from taking the lock)."""
        data = json.dumps(holder, sort_keys=True).encode().ljust(_RECORD_BYTES - 1) + b"\n"
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        os.fsync(fd)

    def _renew(self) -> None:
        holder = _me()
        while self.fd is not None:
            time.sleep(LEASE_SECS / 4)
            try:
                holder["renewed"] = time.time()
                if self.fd is not None:
                    self._write(self.fd, holder)
            except OSError:
                pass  # a full disk: the flock still holds on this host


def _read(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw.decode()) if raw.strip() else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


def _cmdline_mentions(pid, directory: str) -> bool:
    """A live pid on this host is a holder only if it is a run on this directory (pids are reused)."""
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            command = f.read()
    except (OSError, ValueError):
        return True  # cannot tell: assume it is
    return os.path.basename(os.path.abspath(directory)).encode() in command


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
