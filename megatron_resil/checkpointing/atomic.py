"""Durable, atomic file-system steps: fsync a file, a directory or a tree; replace a small file;
publish a finished directory under its final name in one rename."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import uuid

from megatron_resil.checkpointing import untrusted

_RENAME_EXCHANGE = 2  # renameat2 flag: swap two paths atomically (Linux >= 3.15)
_AT_FDCWD = -100


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def open_new(path: str, mode: str = "w"):
    """Create `path` for writing, never through a symlink: O_EXCL fails on any existing name, a
    symlink planted there included, instead of writing wherever it points."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), mode)


def replace_file_text(path: str, text: str) -> None:
    """Write a small file afresh, in UTF-8 whatever the locale (a character it cannot encode, such as a
    lone surrogate from a checkpoint's JSON, as a backslash escape): whatever is at `path` (a symlink
    someone planted, say) is unlinked, never followed."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    with open_new(path, "wb") as f:
        f.write(text.encode("utf-8", "backslashreplace"))


def atomic_write_text(path: str, text: str) -> None:
    """Replace `path` so a reader sees the old content or the new, never a mix or an empty file."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{uuid.uuid4().hex[:8]}")
    with open_new(tmp) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # replaces a symlink at `path` itself, never its target
    fsync_dir(directory)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two existing paths; False where the kernel or libc cannot."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def publish_directory(staging: str, final: str, displaced: str) -> None:
    """Give a complete, fsynced `staging` directory the name `final` in one atomic step.

    If `final` already exists it is swapped out to `displaced` and then deleted, so at every instant
    `final` is either the old complete checkpoint or the new one. Where the kernel cannot swap, the
    old one is first renamed to `displaced` (a start-up scan restores it if we die in between).
    """
    parent = os.path.dirname(os.path.abspath(final))
    if not os.path.exists(final):
        os.rename(staging, final)
        fsync_dir(parent)
        return
    if _exchange(staging, final):
        os.rename(staging, displaced)  # `staging` now holds the old checkpoint
    else:
        os.rename(final, displaced)
        os.rename(staging, final)
    fsync_dir(parent)
    with contextlib.suppress(OSError):  # debris at worst: start-up cleanup removes it later
        untrusted.remove_tree(displaced)
