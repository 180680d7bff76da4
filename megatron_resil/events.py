"""Resiliency decisions (fallback, quarantine, cleanup, retention, saves, exits), each reported once
with its reason: one `[resil] <event>: <message>` line printed by rank 0, so operators can grep a
run's decisions, and, when the run saves checkpoints, one JSON line appended to `<save>/events.jsonl`
that outlives the job's console log across restarts and requeues.

A message may quote what a checkpoint holds (a file name, a manifest key): every line is printed through
`say`, which escapes what is unprintable and never fails on the stream's encoding, so a name no encoder
can write never turns a decision into a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
from collections.abc import Iterator

from megatron_resil import rank_process

EVENT_LOG_NAME = "events.jsonl"
_event_log_path: str | None = None


RESERVE_NAME = ".events.reserve"
_RESERVE_BYTES = 65536


def configure(save_dir: str | None) -> None:
    """Where the JSON event log goes: beside the checkpoints, or nowhere without --save. Rank 0 also
    keeps a small reserve file there: on a full disk it is given up so the records that say what
    happened (the exit record above all) can still be written."""
    global _event_log_path
    _event_log_path = os.path.join(save_dir, EVENT_LOG_NAME) if save_dir else None
    if _event_log_path is not None and _is_rank0():
        _keep_reserve()


def log_path() -> str | None:
    """The JSON event log of this run (None without --save)."""
    return _event_log_path


def _reserve_path() -> str:
    return os.path.join(os.path.dirname(_event_log_path), RESERVE_NAME)


def _keep_reserve() -> None:
    try:
        os.makedirs(os.path.dirname(_event_log_path), exist_ok=True)
        fd = os.open(_reserve_path(), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            if os.fstat(fd).st_size < _RESERVE_BYTES:
                os.write(fd, b"\0" * _RESERVE_BYTES)  # written, not sparse: the blocks are really held
        finally:
            os.close(fd)
    except OSError:
        pass  # no room for it: the run goes on without the reserve


_speaks_for_every_rank = False


@contextlib.contextmanager
def speaking_for_every_rank() -> Iterator[None]:
    """Inside it this process prints and records what rank 0 would: the process chosen to speak where rank
    0's may be lost (in-process restart's last word, after a reserve took a lost rank's place)."""
    global _speaks_for_every_rank
    _speaks_for_every_rank = True
    try:
        yield
    finally:
        _speaks_for_every_rank = False


def _is_rank0() -> bool:
    return _speaks_for_every_rank or rank_process.is_rank0()


def escape_untrusted(text) -> str:
    """`text` (a name or string a checkpoint chose) with every character a terminal or log would not show
    as itself written as an escape: control characters (a newline would forge a line), lone surrogates
    (JSON can hold them, no encoder writes them), format and unassigned characters; a byte of a file name
    that is not UTF-8 (Python's surrogateescape) as `\\xNN`. Printable text is left alone, so escaping
    twice changes nothing."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escaped(char) for char in text)


def _escaped(char: str) -> str:
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # os.listdir's stand-in for an undecodable byte of a name
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def say(line: str, stream=None) -> None:
    """Print one line (to stdout by default), its unprintable characters escaped (escape_untrusted) and
    what the stream's encoding lacks (an ASCII stdout, `PYTHONIOENCODING=ascii:strict`) as backslash
    escapes: it cannot raise an encoding error."""
    stream = stream if stream is not None else sys.stdout
    line = escape_untrusted(line)
    try:
        print(line, file=stream, flush=True)
    except UnicodeEncodeError:  # raised before anything is written: the line is encoded whole first
        encoding = getattr(stream, "encoding", None) or "ascii"
        print(line.encode(encoding, "backslashreplace").decode(encoding), file=stream, flush=True)


def print_rank_0(message: str) -> None:
    if _is_rank0():
        say(message)


def decision(event: str, message: str, **fields) -> None:
    """One resiliency decision, one line: `[resil] <event>: <message>`, and one event-log record."""
    print_rank_0(f"[resil] {event}: {message}")
    record(event, message=message, **fields)


def record(event: str, **fields) -> None:
    """Append one event to the JSON event log (rank 0; a no-op without --save)."""
    if _event_log_path is None or not _is_rank0():
        return
    fields = {name: escape_untrusted(value) if isinstance(value, str) else value
              for name, value in fields.items()}
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "unix": round(time.time(), 3),
             "event": event, "host": socket.gethostname(), "pid": os.getpid(), **fields}
    line = (json.dumps(entry, sort_keys=True) + "\n").encode()
    try:
        try:
            _append(line)
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            os.unlink(_reserve_path())  # the disk is full: spend the reserve on the record
            _append(line)
    except OSError as err:  # the event log must never be the reason a run fails
        warn(f"could not append to {_event_log_path}: {err}")


def _append(line: bytes) -> None:
    """One write of one whole line in append mode: writers never interleave within a line, and a line a
    full disk cut short is taken back."""
    os.makedirs(os.path.dirname(_event_log_path), exist_ok=True)
    fd = os.open(_event_log_path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # a line torn by an older writer: end it,
            line = b"\n" + line                           # or it would swallow this record
        try:
            if os.write(fd, line) != len(line):
                raise OSError(errno.ENOSPC, "short write")
        except OSError:
            os.ftruncate(fd, size)  # a full disk took part of the line: take it back, whole or none
            raise
    finally:
        os.close(fd)


def last_exit_of_run(run_id: str) -> dict | None:
    """The last `exit` record of the attempts whose `start` record names this torchrun run id (None if
    there is none, or the log is unreadable). Read by rank 0 at start."""
    if _event_log_path is None:
        return None
    current, last = None, None
    try:
        with open(_event_log_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(record, dict):
                    continue
                if record.get("event") == "start":
                    current = record.get("run_id")
                elif record.get("event") == "exit" and current == run_id:
                    last = record
                elif record.get("event") == "finished" and current == run_id:
                    last = None
    except OSError:
        return None
    return last


def warn(message: str) -> None:
    if _is_rank0():
        say(f"WARNING: {message}", sys.stderr)
