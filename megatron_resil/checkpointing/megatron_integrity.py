"""Megatron-LM's checkpoint integrity manifest (`--verify-integrity`): written here so its loader accepts
our checkpoints, checked here when a checkpoint carries one, every name in it treated as untrusted.

What it is (megatron-core >= 0.18, `dist_checkpointing/validation.py`; read at Megatron-LM d98e8a6, the
same file as in megatron-core 0.19.2): `integrity.json` in the torch_dist directory, written by rank 0
after `metadata.json`, as `json.dump({"algorithm": "sha256", "files": {name: hex digest}}, indent=2)`,
one entry per top-level regular file then present except itself, sorted by name. Its loader, given
`--verify-integrity`, stops on a checkpoint without one, on any algorithm but sha256 (absent means
sha256), on a listed file missing or unreadable, and on a digest that differs from the lowercase hex
of the file's SHA-256; files it does not list are not checked. Rank 0 does all of it there; here the
ranks split the hashing. A name is quoted in a reason only escaped (a key of "\\ud800" is valid JSON that
no encoder can print).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Mapping

from megatron_resil import events
from megatron_resil.checkpointing import untrusted
from megatron_resil.checkpointing.atomic import fsync_file

INTEGRITY_NAME = "integrity.json"  # megatron-core's INTEGRITY_FNAME
ALGORITHM = "sha256"
WHAT = "Megatron-LM's integrity manifest (integrity.json)"
_CHUNK = 8 << 20


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with untrusted.open_regular(path) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)  # hashlib releases the GIL for large chunks
    return digest.hexdigest()


def add_sha256(directory: str, entries: dict[str, dict]) -> None:
    """Give each entry ({relpath: {"size", ...}}, as a rank's writer recorded its files) a "sha256",
    unless its writer already computed one; each rank hashes the files it wrote."""
    for rel, entry in entries.items():
        if "sha256" not in entry:
            entry["sha256"] = sha256_file(os.path.join(directory, rel))


def listed_files(directory: str) -> list[str]:
    """What megatron-core's `save_integrity_manifest` lists: every top-level regular file but the
    manifest itself, sorted (by full path there, the same order)."""
    with os.scandir(directory) as entries:
        return sorted(entry.name for entry in entries
                      if entry.is_file(follow_symlinks=False) and entry.name != INTEGRITY_NAME)


def render(digests: Mapping[str, str]) -> str:
    """The manifest's bytes exactly as megatron-core writes them for these digests."""
    return json.dumps({"algorithm": ALGORITHM, "files": {name: digests[name] for name in sorted(digests)}},
                      indent=2)


def write_integrity_manifest(directory: str, known: Mapping[str, str] | None = None) -> None:
    """Write `integrity.json` for the files now in `directory`, taking the digests in `known` (computed by
    the ranks that wrote those files) and hashing the rest here. The staging directory is published as a
    whole afterwards, so no temporary name is needed."""
    known = known or {}
    digests = {name: known[name] if name in known else sha256_file(os.path.join(directory, name))
               for name in listed_files(directory)}
    path = os.path.join(directory, INTEGRITY_NAME)
    with open(path, "w") as f:
        f.write(render(digests))
    fsync_file(path)


def has_integrity_manifest(directory: str) -> bool:
    return os.path.lexists(os.path.join(directory, INTEGRITY_NAME))


def read_integrity_manifest(directory: str) -> tuple[dict[str, str] | None, str | None]:
    """({name: digest}, None); (None, None) when there is none; (None, reason) when Megatron-LM's loader
    would refuse it before hashing anything (or it is not a small regular file). Names are checked later,
    by `verify_integrity_manifest`."""
    path = os.path.join(directory, INTEGRITY_NAME)
    if not os.path.lexists(path):
        return None, None
    try:
        data = json.loads(untrusted.read_text(path, what="integrity manifest"))
    except untrusted.CheckpointDataError as err:
        return None, f"{WHAT}: {err}"
    except (ValueError, RecursionError) as err:
        return None, f"{WHAT} is unparsable ({type(err).__name__})"
    if not isinstance(data, dict):
        return None, f"{WHAT} is not a JSON object"
    algorithm = data.get("algorithm", ALGORITHM)
    if algorithm != ALGORITHM:
        return None, f"{WHAT} names the hash algorithm {algorithm!r}; only {ALGORITHM!r} is accepted"
    files = data.get("files")
    if not isinstance(files, dict):
        return None, f"{WHAT} has no \"files\" object"
    for name, digest in files.items():
        if not isinstance(digest, str):  # never equal to a hex digest there: its loader fails the file
            return None, f"{WHAT}: the digest of {name!r} is not a string"
    return files, None


def mismatch(name: str, actual: str, expected: str) -> str:
    return (f"{WHAT}: {events.escape_untrusted(name)} fails its SHA-256 checksum (got {actual[:16]}..., "
            f"it says {expected[:16]}...)")


def verify_integrity_manifest(directory: str, files: Mapping[str, str], *, share: tuple[int, int] = (0, 1),
                              checksums: bool = True, hashed_elsewhere: Collection[str] = ()) -> str | None:
    """None if every listed file is a regular file inside `directory` and, for this caller's `share` =
    (index, count) of them, hashes to its digest; else the first reason. Names in `hashed_elsewhere` were
    hashed in the same read as our own manifest's checksum (`manifest.check_manifest`)."""
    index, count = share
    for position, (name, expected) in enumerate(sorted(files.items())):
        if untrusted.is_plain_relative(name) and not os.path.lexists(os.path.join(directory, name)):
            return f"{WHAT} lists {events.escape_untrusted(name)}, which is missing"
        try:  # a name from the checkpoint: inside it, through no link, a regular file
            full = untrusted.inside(directory, name)
        except untrusted.UntrustedPathError as err:
            return f"{WHAT}: {err}"
        if checksums and name not in hashed_elsewhere and position % count == index:
            actual = sha256_file(full)
            if actual != expected:
                return mismatch(name, actual, expected)
    return None
