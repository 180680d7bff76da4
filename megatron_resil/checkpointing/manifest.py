"""A checkpoint's own account of what it contains, written last into the staging directory.

Verification compares the directory with it: missing or truncated files, the wrong iteration, a
missing or unparsable manifest. A checkpoint without one (saved by Megatron-LM, or before this
existed) is checked for DCP's `.metadata` only, and the loader warns.
"""

from __future__ import annotations

import json
import os

from megatron_resil.checkpointing.atomic import fsync_file

MANIFEST_NAME = "resil_manifest.json"
MANIFEST_VERSION = 1


def write_manifest(directory: str, iteration: int, fmt: str) -> None:
    files = {}
    for dirpath, _dirs, names in os.walk(directory):
        for name in names:
            full = os.path.join(dirpath, name)
            files[os.path.relpath(full, directory)] = os.path.getsize(full)
    path = os.path.join(directory, MANIFEST_NAME)
    with open(path, "w") as f:
        json.dump({"version": MANIFEST_VERSION, "format": fmt, "iteration": iteration,
                   "files": files}, f, indent=1, sort_keys=True)
    fsync_file(path)


def has_manifest(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, MANIFEST_NAME))


def verify_manifest(directory: str, iteration: int | None) -> str | None:
    """None if the directory matches its manifest, else the first reason it does not.

    `iteration` None skips the iteration check (a `release` checkpoint has no number in its name).
    """
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        recorded_iteration = manifest["iteration"]
    except FileNotFoundError:
        return "manifest missing"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"manifest unparsable ({type(err).__name__})"
    if iteration is not None and recorded_iteration != iteration:
        return f"manifest is for iteration {recorded_iteration}, not {iteration}"
    for rel, size in sorted(files.items()):
        full = os.path.join(directory, rel)
        if not os.path.isfile(full):
            return f"file {rel} missing"
        actual = os.path.getsize(full)
        if actual != size:
            return f"file {rel} has {actual} bytes, manifest says {size}"
    return None
