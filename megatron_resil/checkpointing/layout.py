"""Names on disk, Megatron's layout: `<root>/iter_0000100/`, `<root>/latest_checkpointed_iteration.txt`.

Work in progress never carries a final `iter_` name: staging directories are `.tmp_iter_<7 digits>_*`,
a replaced checkpoint briefly lives as `.displaced_iter_*`, one being deleted as `.deleting_iter_*`.
None of them matches `iter_*`. A checkpoint that failed verification is kept, renamed
`iter_<7 digits>.quarantined.<why>.<nonce>`, which the loader never considers again.
"""

from __future__ import annotations

import os
import re
import uuid

TRACKER_NAME = "latest_checkpointed_iteration.txt"
RELEASE_DIR = "release"
_FINAL = re.compile(r"^iter_(\d{7,})$")
_STAGING = re.compile(r"^\.tmp_iter_(\d{7,})_[0-9a-f]+$")
_DISPLACED = re.compile(r"^\.displaced_iter_(\d{7,})_[0-9a-f]+$")
_DELETING = re.compile(r"^\.deleting_iter_(\d{7,})_[0-9a-f]+$")
_QUARANTINED = re.compile(r"^iter_(\d{7,})\.quarantined\.[a-z-]+\.[0-9a-f]+$")
_TRACKER_TMP = re.compile(r"^\." + re.escape(TRACKER_NAME) + r"\.tmp\.[0-9a-f]+$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def new_staging_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f".tmp_iter_{iteration:07d}_{uuid.uuid4().hex[:12]}")


def new_displaced_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f".displaced_iter_{iteration:07d}_{uuid.uuid4().hex[:12]}")


def new_deleting_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f".deleting_iter_{iteration:07d}_{uuid.uuid4().hex[:12]}")


def new_quarantine_dir(root: str, iteration: int, slug: str) -> str:
    return os.path.join(root, f"iter_{iteration:07d}.quarantined.{slug}.{uuid.uuid4().hex[:8]}")


def quarantined(root: str) -> list[str]:
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, name) for name in os.listdir(root) if _QUARANTINED.match(name))


def published_iterations(root: str) -> list[int]:
    """Iterations that have a directory under their final name, newest first."""
    if not os.path.isdir(root):
        return []
    found = [int(m.group(1)) for name in os.listdir(root) if (m := _FINAL.match(name))
             and os.path.isdir(os.path.join(root, name))]
    return sorted(found, reverse=True)


def leftovers(root: str) -> dict[str, list[str]]:
    """Debris of interrupted saves and deletions, by kind."""
    out: dict[str, list[str]] = {"staging": [], "displaced": [], "deleting": [], "tracker_tmp": []}
    if not os.path.isdir(root):
        return out
    for name in sorted(os.listdir(root)):
        for kind, pattern in (("staging", _STAGING), ("displaced", _DISPLACED),
                              ("deleting", _DELETING), ("tracker_tmp", _TRACKER_TMP)):
            if pattern.match(name):
                out[kind].append(os.path.join(root, name))
    return out


def displaced_iteration(path: str) -> int:
    m = _DISPLACED.match(os.path.basename(path))
    assert m, path
    return int(m.group(1))
