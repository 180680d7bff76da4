"""torch.save's zip archive, checked before torch.load sees one: a file's size bounds what reading it takes.

torch's reader allocates each entry at the size the archive's central directory declares and inflates a
compressed entry into it, before anything looks at the contents: a 0.5 MB `common.pt` whose pickle is
deflated took 1 GiB to read, and a stored entry that declares more than it holds is allocated in full
first. torch.save writes every entry stored (uncompressed), each once. So an archive is read only if
every entry is stored, declares the size it occupies, and all of them together fit in the file; then
what torch.load allocates for the records is at most the file's size, which the caller bounded. Only the
end record and the central directory are read here, never an entry. The same holds for each tensor item
of a torch_dist shard, which DCP reads with torch.load (safe_load checks them at verification).
"""

from __future__ import annotations

import io
import struct

from megatron_resil.checkpointing.tier import CheckpointDataError
from megatron_resil.events import escape_untrusted

_LOCAL = b"PK\x03\x04"
_END = struct.Struct("<4s4H2LH")
_END_SIGNATURE = b"PK\x05\x06"
_END64_LOCATOR = struct.Struct("<4sLQL")
_END64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_CENTRAL_SIGNATURE = b"PK\x01\x02"
_ZIP64_EXTRA = 0x0001
_STORED = 0
_MAX_COMMENT = 0xFFFF
# torch.save writes a few entries per tensor storage (one, plus fixed ones); a directory of 256 MiB is
# millions of them, beyond any checkpoint file.
MAX_CENTRAL_DIRECTORY_BYTES = 256 << 20


class CompressedArchiveError(CheckpointDataError):
    """A torch archive holds what torch.save never writes: a compressed entry, or sizes it does not have;
    refused before torch.load would allocate or inflate any of it."""


def check(file, name: str) -> None:
    """Raise CompressedArchiveError unless the zip archive from `file`'s position to its end (torch.load
    reads it from there) holds only stored entries whose declared sizes add up to no more than its length;
    nothing if it is no zip archive (torch.load reads it in its legacy format, whose storages lie in the
    file). `file` is left where it was."""
    start = file.tell()
    try:
        check_item(file, start, file.seek(0, io.SEEK_END) - start, name)
    finally:
        file.seek(start)


def check_item(file, start: int, length: int, name: str) -> None:
    """`check` of what lies at bytes `start`..`start + length` of `file` (a DCP item)."""
    file.seek(start)
    if file.read(len(_LOCAL)) != _LOCAL:  # torch.load's own test (torch.serialization._is_zipfile)
        return
    try:
        _check_directory(_Window(file, start, length), escape_untrusted(name))
    except struct.error:
        raise CompressedArchiveError(f"{escape_untrusted(name)}: a zip archive whose directory is cut short; "
                                     "torch.save writes none such") from None


class _Window:
    """Reads of one archive inside a file, by offset within the archive; the archive's end is read once and
    kept, since torch.save's end record and directory almost always lie in its last few KiB."""

    _TAIL = 4096

    def __init__(self, file, start: int, length: int) -> None:
        self.file, self.start, self.length = file, start, length
        self.tail_start = max(0, length - self._TAIL)
        self.tail = self._read(self.tail_start, length - self.tail_start)

    def _read(self, offset: int, size: int) -> bytes:
        self.file.seek(self.start + offset)
        data = self.file.read(size)
        if len(data) != size:
            raise struct.error("short read")
        return data

    def read(self, offset: int, size: int) -> bytes:
        if offset < 0 or offset + size > self.length:
            raise struct.error("outside the archive")
        if offset >= self.tail_start:
            return self.tail[offset - self.tail_start:offset - self.tail_start + size]
        return self._read(offset, size)


def _directory(archive: _Window, name: str) -> tuple[int, int]:
    """(offset, size) of the central directory, from the end record (its zip64 form where present, as
    torch's reader takes it)."""
    length = archive.length
    tail, tail_start = archive.tail, archive.tail_start
    if tail.rfind(_END_SIGNATURE) < 0:  # torch.save writes no comment; a zip comment can push it back
        tail_start = max(0, length - _END.size - _MAX_COMMENT)
        tail = archive.read(tail_start, length - tail_start)
    at = tail.rfind(_END_SIGNATURE)
    if at < 0:
        raise CompressedArchiveError(f"{name}: no zip end record; not an archive torch.save wrote")
    end_offset = tail_start + at
    _, _, _, _, _, size, offset, _ = _END.unpack_from(tail, at)
    if end_offset >= _END64_LOCATOR.size:
        signature, _, end64_offset, _ = _END64_LOCATOR.unpack(
            archive.read(end_offset - _END64_LOCATOR.size, _END64_LOCATOR.size))
        if signature == b"PK\x06\x07":
            fields = _END64.unpack(archive.read(end64_offset, _END64.size))
            if fields[0] == b"PK\x06\x06":
                size, offset = fields[8], fields[9]
    if offset + size > length:
        raise CompressedArchiveError(f"{name}: its zip directory lies past its end")
    if size > MAX_CENTRAL_DIRECTORY_BYTES:
        raise CompressedArchiveError(f"{name}: a zip directory of {size} bytes, more than any torch.save "
                                     f"writes ({MAX_CENTRAL_DIRECTORY_BYTES})")
    return offset, size


def _zip64_sizes(extra: bytes, compressed: int, uncompressed: int) -> tuple[int, int]:
    """The sizes a zip64 extra field gives in place of the 32-bit fields that say 0xFFFFFFFF."""
    position = 0
    while position + 4 <= len(extra):
        kind, size = struct.unpack_from("<2H", extra, position)
        if kind == _ZIP64_EXTRA:
            values = list(struct.unpack_from(f"<{size // 8}Q", extra, position + 4))
            wanted = (uncompressed == 0xFFFFFFFF) + (compressed == 0xFFFFFFFF)
            if len(values) < wanted:
                raise struct.error("zip64 extra field too short")
            if uncompressed == 0xFFFFFFFF:
                uncompressed = values.pop(0)
            if compressed == 0xFFFFFFFF:
                compressed = values.pop(0)
            return compressed, uncompressed
        position += 4 + size
    return compressed, uncompressed


def _check_directory(archive: _Window, name: str) -> None:
    offset, size = _directory(archive, name)
    directory = archive.read(offset, size)
    position, declared = 0, 0
    while position < len(directory):
        fields = _CENTRAL.unpack_from(directory, position)
        if fields[0] != _CENTRAL_SIGNATURE:
            raise CompressedArchiveError(f"{name}: a zip directory entry without its signature")
        method, compressed, uncompressed = fields[4], fields[8], fields[9]
        name_size, extra_size, comment_size = fields[10], fields[11], fields[12]
        header_end = position + _CENTRAL.size
        entry = escape_untrusted(directory[header_end:header_end + name_size].decode("utf-8", "replace"))
        extra = directory[header_end + name_size:header_end + name_size + extra_size]
        compressed, uncompressed = _zip64_sizes(extra, compressed, uncompressed)
        if method != _STORED:
            raise CompressedArchiveError(f"{name}: entry {entry} is compressed (zip method {method}), which "
                                         "torch.save never writes; refused before torch.load inflates it")
        if compressed != uncompressed:
            raise CompressedArchiveError(f"{name}: entry {entry} is stored in {compressed} bytes but "
                                         f"declares {uncompressed}; refused before torch.load allocates them")
        declared += uncompressed
        if declared > archive.length:
            raise CompressedArchiveError(f"{name}: its entries declare more bytes than its {archive.length} "
                                         "(a zip whose entries overlap); refused before torch.load allocates "
                                         "them")
        position = header_end + name_size + extra_size + comment_size
