"""A checkpoint directory is untrusted input: every path read from it stays inside it, only regular
files are opened, and every read is bounded.

Paths inside a checkpoint come from its own files (DCP's `.metadata` names the file of each item, the
manifest names files, zarr names arrays), so whoever wrote the checkpoint chooses them: `os.path.join`
with an absolute second part returns that part, and `..` climbs out. `inside()` is the one rule for all
of them: a relative path of plain names, resolved without following any link, ending at a regular file.
`open_regular()` never blocks on a FIFO or a device and refuses a file larger than its kind may be;
`find_irregular()`, `tree_size()` and `remove_tree()` walk a tree of any depth without recursion.
Names and strings a checkpoint chose are shown through `events.escape_untrusted()`, so no message that
quotes one can fail to print or span lines.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import uuid

from megatron_resil.checkpointing.tier import CheckpointDataError
from megatron_resil.events import escape_untrusted

# Upper bounds on what is read whole into memory, per rank, before any of it is checked. DCP's
# `.metadata` takes about 200 bytes per chunk it indexes: 1 GiB is five million chunks, beyond the
# largest runs we know of (16k ranks with a few hundred chunks each); megatron-core's `common.pt` holds
# the arguments and a few scalars (kilobytes); one byte item of a `.distcp` file holds a rank's RNG
# state, the optimizer's parameter groups or a layer's extra state (kilobytes to megabytes).
MAX_METADATA_BYTES = 1 << 30
MAX_COMMON_BYTES = 256 << 20
MAX_OBJECT_BYTES = 256 << 20
# A manifest takes about 60 bytes per file it lists; megatron-core's metadata.json and our notes are tiny.
MAX_SMALL_FILE_BYTES = 64 << 20
# A checkpoint is a flat torch_dist directory or a zarr tree a few levels deep, with one file per rank
# and thread (torch_dist) or per chunk (zarr): beyond these it is not a checkpoint of ours or Megatron-LM's.
MAX_DEPTH = 32
MAX_ENTRIES = 1_000_000


class UntrustedPathError(CheckpointDataError):
    """A path taken from a checkpoint leaves it, passes through a link, or is not a regular file."""


class OversizedFileError(CheckpointDataError):
    """A checkpoint file is larger than anything of its kind can be; refused before reading it."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def is_plain_relative(relative) -> bool:
    """A relative path of plain names: not absolute, no `..`, `.` or empty part, no NUL."""
    return isinstance(relative, str) and bool(relative) and "\0" not in relative and \
        not os.path.isabs(relative) and not any(part in ("", ".", "..") for part in relative.split("/"))


def inside(root: str, relative: str, shown_as: str | None = None) -> str:
    """`root`/`relative` if `relative` names a regular file inside `root` through real directories only;
    else UntrustedPathError naming it. Nothing is opened."""
    if not is_plain_relative(relative):
        named = escape_untrusted(shown_as or repr(relative))
        raise UntrustedPathError(f"{root}: the checkpoint names {named}, which is not a path inside it; a "
                                 "checkpoint only refers to its own files")
    parts = relative.split("/")
    path = root
    for position, part in enumerate(parts):
        path = os.path.join(path, part)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            raise UntrustedPathError(f"{escape_untrusted(path)} is missing (named by the checkpoint)") \
                from None
        last = position == len(parts) - 1
        if (last and not stat.S_ISREG(mode)) or (not last and not stat.S_ISDIR(mode)):
            raise UntrustedPathError(f"{escape_untrusted(path)} is {_kind(mode)}; a checkpoint is plain "
                                     "files and directories")
    return path


def open_regular(path: str, max_bytes: int | None = None, what: str = "file"):
    """Open a checkpoint file for reading: never through a final symlink, never blocking (a FIFO with no
    writer would block `open` forever), only a regular file, at most `max_bytes` long."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UntrustedPathError(f"{escape_untrusted(path)} is a symlink; a checkpoint is plain files") \
                from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedPathError(f"{escape_untrusted(path)} is {_kind(info.st_mode)}; a checkpoint is "
                                     "plain files")
        if max_bytes is not None and info.st_size > max_bytes:
            raise OversizedFileError(f"{escape_untrusted(path)} has {info.st_size} bytes, more than any "
                                     f"{what} can have ({max_bytes}); refused without reading it")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_text(path: str, max_bytes: int = MAX_SMALL_FILE_BYTES, what: str = "small file") -> str:
    """A small text file of a checkpoint (a manifest, metadata.json, a quarantine reason), through
    `open_regular`."""
    with open_regular(path, max_bytes, what) as f:
        return f.read().decode()


class _Beyond(UntrustedPathError):
    """A tree deeper, or with more entries, than any checkpoint."""


def _walk(directory: str):
    """(relative name, lstat result) of every entry under `directory`, without recursion and following no
    link; raises _Beyond past MAX_DEPTH or MAX_ENTRIES, OSError where a directory cannot be read."""
    pending = [("", 0)]
    seen = 0
    while pending:
        relative, depth = pending.pop()
        with os.scandir(os.path.join(directory, relative) if relative else directory) as entries:
            for entry in entries:
                seen += 1
                if seen > MAX_ENTRIES:
                    raise _Beyond(f"holds more than {MAX_ENTRIES} entries; no checkpoint has that many")
                name = f"{relative}/{entry.name}" if relative else entry.name
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode):
                    if depth + 1 >= MAX_DEPTH:
                        raise _Beyond(f"{escape_untrusted(name)} lies more than {MAX_DEPTH} directories "
                                      "deep; no checkpoint does")
                    pending.append((name, depth + 1))
                yield name, info


def find_irregular(directory: str) -> str | None:
    """Why `directory` is not a tree of plain files and directories (a symlink, a FIFO, a device or
    socket anywhere, or more depth or entries than a checkpoint has), or None. Follows no link."""
    try:
        for name, info in _walk(directory):
            if not stat.S_ISDIR(info.st_mode) and not stat.S_ISREG(info.st_mode):
                return f"holds {_kind(info.st_mode)}, {escape_untrusted(name)}; a checkpoint is plain files"
    except _Beyond as err:
        return str(err)
    return None


def tree_size(directory: str) -> tuple[int, str | None]:
    """(bytes in the regular files under `directory`, None), for a listing; where the count stopped short
    (a directory that cannot be read, more depth or entries than a checkpoint has), why, in place of None.
    A link (a dangling one too) is only a name here."""
    total = 0
    try:
        for _, info in _walk(directory):
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    except _Beyond as err:
        return total, f"{err}: not all counted"
    except OSError as err:
        return total, f"unreadable ({err.strerror}): not all counted"
    return total, None


def regular_files(directory: str) -> list[str]:
    """Every regular file under `directory` (relative names, sorted), after `find_irregular` found
    nothing else there."""
    return sorted(name for name, info in _walk(directory) if stat.S_ISREG(info.st_mode))


def remove_tree(path: str) -> None:
    """Delete `path` and everything under it, at any depth, following no link.

    shutil.rmtree recurses once per level (a leftover 1,500 directories deep ends it with RecursionError)
    and needs the whole path at once (PATH_MAX). Here each subdirectory met is first moved up to lie
    directly under `path`, so no path is ever longer than two names and no stack grows with depth.
    """
    root_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        prefix = f".resil-rm-{uuid.uuid4().hex[:8]}-"
        with os.scandir(root_fd) as entries:
            pending = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        hoisted = 0
        while pending:
            name = pending.pop()
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
            try:
                with os.scandir(fd) as entries:
                    children = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
                for child, is_dir in children:
                    if is_dir:
                        hoisted += 1
                        os.rename(child, f"{prefix}{hoisted}", src_dir_fd=fd, dst_dir_fd=root_fd)
                        pending.append(f"{prefix}{hoisted}")
                    else:
                        os.unlink(child, dir_fd=fd)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=root_fd)
        with os.scandir(root_fd) as entries:
            for entry in entries:
                os.unlink(entry.name, dir_fd=root_fd)
    finally:
        os.close(root_fd)
    os.rmdir(path)
