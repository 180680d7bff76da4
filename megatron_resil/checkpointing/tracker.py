"""The tracker file Megatron users resume from, read defensively and replaced atomically.

Megatron overwrites it with a plain write and exits 0 on an unparsable one; here a bad tracker is
reported in one line and the loader falls back to the newest complete checkpoint.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

from megatron_resil.checkpointing.atomic import atomic_write_text
from megatron_resil.checkpointing.layout import TRACKER_NAME


@dataclass(frozen=True)
class TrackerReading:
    iteration: int | None  # None: nothing usable (see problem); -1 means 'release'
    problem: str | None = None


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER_NAME)


_MAX_BYTES = 64  # Megatron writes "<iteration>\n" or "release"
_ITERATION = re.compile(r"[0-9]{1,12}")


def read_tracker(root: str) -> TrackerReading:
    """Only a small regular file holding an integer or `release` names a checkpoint; anything else
    (a directory, a FIFO that would block the reader, a symlink, a device, binary bytes, a large file)
    is a problem the caller reports before it scans for checkpoints instead."""
    path = tracker_path(root)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return TrackerReading(None, f"tracker {path} is missing")
    except OSError as err:
        return TrackerReading(None, f"tracker {path} is unreadable ({err.strerror})")
    if not stat.S_ISREG(info.st_mode):
        return TrackerReading(None, f"tracker {path} is not a regular file ({_kind(info.st_mode)})")
    if info.st_size > _MAX_BYTES:
        return TrackerReading(None, f"tracker {path} is {info.st_size} bytes, not an iteration number")
    try:  # no blocking open, no symlink swapped in since the lstat
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return TrackerReading(None, f"tracker {path} is not a regular file")
            raw = os.read(fd, _MAX_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as err:
        return TrackerReading(None, f"tracker {path} is unreadable ({err.strerror})")
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return TrackerReading(None, f"tracker {path} holds bytes that are not text ({raw[:12]!r})")
    if text == "release":
        return TrackerReading(-1)
    if text.startswith("-") and _ITERATION.fullmatch(text[1:]):
        return TrackerReading(None, f"tracker {path} names a negative iteration {text}")
    if not _ITERATION.fullmatch(text):
        return TrackerReading(None, f"tracker {path} is unparsable ({text[:20]!r})")
    return TrackerReading(int(text))


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a file"


def write_tracker(root: str, iteration: int) -> None:
    atomic_write_text(tracker_path(root), f"{iteration}\n")
