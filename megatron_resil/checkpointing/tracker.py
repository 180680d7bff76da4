"""The tracker file Megatron users resume from, read defensively and replaced atomically.

Megatron overwrites it with a plain write and exits 0 on an unparsable one; here a bad tracker is
reported in one line and the loader falls back to the newest complete checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_resil.checkpointing.atomic import atomic_write_text
from megatron_resil.checkpointing.layout import TRACKER_NAME


@dataclass(frozen=True)
class TrackerReading:
    iteration: int | None  # None: nothing usable (see problem); -1 means 'release'
    problem: str | None = None


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER_NAME)


def read_tracker(root: str) -> TrackerReading:
    path = tracker_path(root)
    if not os.path.exists(path):
        return TrackerReading(None, f"tracker {path} is missing")
    try:
        with open(path) as f:
            text = f.read(64).strip()
    except OSError as err:
        return TrackerReading(None, f"tracker {path} is unreadable ({err.strerror})")
    if text == "release":
        return TrackerReading(-1)
    try:
        iteration = int(text)
    except ValueError:
        return TrackerReading(None, f"tracker {path} is unparsable ({text[:20]!r})")
    if iteration < 0:
        return TrackerReading(None, f"tracker {path} names a negative iteration {iteration}")
    return TrackerReading(iteration)


def write_tracker(root: str, iteration: int) -> None:
    atomic_write_text(tracker_path(root), f"{iteration}\n")
