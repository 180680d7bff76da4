"""A checkpoint's own account of what it contains: every file with its size and checksum, written
last into the staging directory.

Checksums are computed at save time by the rank that wrote each file (`checksum_files`), gathered,
and recorded by rank 0. Verification compares the directory with the manifest: a missing or
truncated file, flipped bits, the wrong iteration, a missing or unparsable manifest. A checkpoint
without one (saved by Megatron-LM, or before this existed) is checked for DCP's `.metadata` only,
and the loader warns. Megatron-LM's integrity manifest, where a checkpoint has one (megatron_integrity),
is checked too: its SHA-256s in the same read as our checksums. The checksum is CRC-32, zlib's
polynomial, computed by ISA-L (python-isal, about 13 GiB/s per core here, with the GIL released, so a
writer checksums as it writes); where isal is missing, zlib gives the same values at about 2 GiB/s.
Manifests before version 4 may hold CRC32C (google-crc32c); either is verified. Both catch corruption
at rest and in transfer; neither defends against tampering.
Verification reads whichever the manifest recorded.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Mapping

import google_crc32c  # verifies version 3 manifests (CRC32C)

from megatron_resil import events
from megatron_resil.checkpointing import megatron_integrity, untrusted
from megatron_resil.checkpointing.atomic import fsync_file

try:
    from isal import isal_zlib as _crc32
except ImportError:  # optional at run time: zlib computes the same CRC-32, four to six times slower
    _crc32 = zlib

MANIFEST_NAME = "resil_manifest.json"
CHECKSUM = "crc32"
# 4: {"size", "crc32"} per file, written by ISA-L or zlib (same values). 3: the same with "crc32c".
# 2: "crc32" by zlib. 1: sizes only. Entries name their algorithm, so every version verifies.
MANIFEST_VERSION = 4
_CHUNK = 8 << 20
_EXTEND = {"crc32": lambda crc, chunk: _crc32.crc32(chunk, crc),
           "crc32c": lambda crc, chunk: google_crc32c.extend(crc, chunk)}


def extend_checksum(crc: int, chunk, algorithm: str = CHECKSUM) -> int:
    """The checksum of the bytes so far (`crc`) extended over `chunk`: a writer checksums as it writes."""
    return _EXTEND[algorithm](crc, chunk)


def file_checksum(path: str, algorithm: str = CHECKSUM) -> int:
    return file_digests(path, algorithm)[0]


def file_digests(path: str, algorithm: str | None = CHECKSUM,
                 sha256: bool = False) -> tuple[int | None, str | None]:
    """(checksum by `algorithm`, SHA-256 hex digest) of the file, in one read; None for what is not asked."""
    extend = _EXTEND[algorithm] if algorithm is not None else None
    crc, digest = 0, hashlib.sha256() if sha256 else None
    with untrusted.open_regular(path) as f:
        while chunk := f.read(_CHUNK):
            if extend is not None:
                crc = extend(crc, chunk)
            if digest is not None:
                digest.update(chunk)
    return (crc if extend is not None else None), (digest.hexdigest() if digest is not None else None)


def checksum_files(directory: str, relpaths: list[str]) -> dict[str, dict]:
    """{relpath: {"size", CHECKSUM}} for the given files (a rank passes the files it wrote)."""
    out = {}
    for rel in relpaths:
        full = os.path.join(directory, rel)
        out[rel] = {"size": os.path.getsize(full), CHECKSUM: file_checksum(full)}
    return out


def all_files(directory: str) -> list[str]:
    found = []
    for dirpath, _dirs, names in os.walk(directory):
        found += [os.path.relpath(os.path.join(dirpath, name), directory) for name in names]
    return sorted(f for f in found if f != MANIFEST_NAME)


def write_manifest(directory: str, iteration: int, fmt: str,
                   files: dict[str, dict] | None = None) -> None:
    """Record `files` (as from checksum_files); None checksums every file here in this process.

    Any file present but not given is checksummed here too, so the manifest always covers the
    whole directory.
    """
    files = dict(files or {})
    missing = [rel for rel in all_files(directory) if rel not in files]
    files.update(checksum_files(directory, missing))
    path = os.path.join(directory, MANIFEST_NAME)
    with open(path, "w") as f:
        json.dump({"version": MANIFEST_VERSION, "format": fmt, "iteration": iteration,
                   "checksum": CHECKSUM, "files": files}, f, indent=1, sort_keys=True)
    fsync_file(path)


def has_manifest(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, MANIFEST_NAME))


def read_manifest(directory: str) -> tuple[dict | None, str | None]:
    """(manifest, None) or (None, reason)."""
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        manifest = json.loads(untrusted.read_text(path, what="manifest"))
        if not isinstance(manifest["files"], dict) or not isinstance(manifest["iteration"], int):
            raise TypeError("bad field types")
    except FileNotFoundError:
        return None, "manifest missing"
    except untrusted.CheckpointDataError as err:
        return None, str(err)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
        return None, f"manifest unparsable ({type(err).__name__})"
    return manifest, None


def _size_and_crc(entry) -> tuple[int, str | None, int | None]:
    if isinstance(entry, dict):  # versions 2-4: the key names the algorithm
        for algorithm in ("crc32c", "crc32"):
            if algorithm in entry:
                return int(entry["size"]), algorithm, int(entry[algorithm])
        return int(entry["size"]), None, None
    return int(entry), None, None  # version 1: size only


def verify_manifest(directory: str, iteration: int | None, *, share: tuple[int, int] = (0, 1),
                    checksums: bool = True) -> str | None:
    """None if the directory matches its manifest, else the first reason it does not (`check_manifest`)."""
    manifest, problem = read_manifest(directory)
    if manifest is None:
        return problem
    return check_manifest(directory, manifest, iteration, share=share, checksums=checksums)


def check_manifest(directory: str, manifest: dict, iteration: int | None, *, share: tuple[int, int] = (0, 1),
                   checksums: bool = True, sha256: Mapping[str, str] | None = None) -> str | None:
    """None if the directory matches `manifest` (as read_manifest returned it), else the first reason.

    Sizes of all files are checked; CRCs only of this caller's `share` = (index, count) of the
    files, so ranks split the reading. `iteration` None skips the iteration check (a `release`
    checkpoint has no number in its name). `sha256`: the digests Megatron-LM's integrity manifest
    gives; a file listed in both is hashed both ways in the same read.
    """
    if iteration is not None and manifest["iteration"] != iteration:
        return f"manifest is for iteration {manifest['iteration']}, not {iteration}"
    sha256 = sha256 or {}
    index, count = share
    for position, (rel, entry) in enumerate(sorted(manifest["files"].items())):
        shown = events.escape_untrusted(rel)  # a name the manifest chose
        try:
            size, algorithm, crc = _size_and_crc(entry)
        except (KeyError, TypeError, ValueError):
            return f"manifest entry for {shown} unparsable"
        if not os.path.lexists(os.path.join(directory, rel)) and untrusted.is_plain_relative(rel):
            return f"file {shown} missing"
        try:  # the manifest names the files: each must lie inside, reached through no link
            full = untrusted.inside(directory, rel)
        except untrusted.UntrustedPathError as err:
            return str(err)
        actual = os.path.getsize(full)
        if actual != size:
            return f"file {shown} has {actual} bytes, manifest says {size}"
        expected_sha = sha256.get(rel)
        if checksums and (crc is not None or expected_sha is not None) and position % count == index:
            actual_crc, actual_sha = file_digests(full, algorithm if crc is not None else None,
                                                  sha256=expected_sha is not None)
            if crc is not None and actual_crc != crc:
                return (f"file {shown} fails its checksum ({algorithm} {actual_crc:08x}, "
                        f"manifest says {crc:08x})")
            if expected_sha is not None and actual_sha != expected_sha:
                return megatron_integrity.mismatch(rel, actual_sha, expected_sha)
    return None
