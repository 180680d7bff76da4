"""Which old checkpoints to delete: --ckpt-keep-last K and Megatron's --save-retain-interval.

Never the newest complete checkpoint, never the one the tracker names. A deletion first renames the
directory out of the `iter_*` namespace, so a crash mid-delete never leaves a partial `iter_` dir.
"""

from __future__ import annotations

import contextlib
import os

from megatron_resil import events
from megatron_resil.checkpointing import layout, untrusted
from megatron_resil.checkpointing.atomic import fsync_dir
from megatron_resil.checkpointing.tracker import read_tracker


def to_delete(iterations: list[int], keep_last: int | None, retain_interval: int | None,
              protected: set[int]) -> list[int]:
    """Pure policy. `iterations` newest first. Keeps everything unless a policy is set."""
    if keep_last is None and retain_interval is None:
        return []
    keep = set(protected) | set(iterations[:1])
    keep |= set(iterations[: keep_last or 1])
    if retain_interval is not None:
        keep |= {it for it in iterations if it % retain_interval == 0}
    return [it for it in iterations if it not in keep]


def apply_retention(root: str, keep_last: int | None, retain_interval: int | None) -> list[int]:
    """Rank 0 only. Returns the iterations deleted."""
    tracked = read_tracker(root).iteration
    protected = {tracked} if tracked is not None and tracked >= 0 else set()
    doomed = to_delete(layout.published_iterations(root), keep_last, retain_interval, protected)
    deleted = []
    for iteration in doomed:
        path = layout.iteration_dir(root, iteration)
        reasons = [f"older than the newest {keep_last}" if keep_last else "not the newest"]
        if retain_interval:
            reasons.append(f"not a multiple of --save-retain-interval {retain_interval}")
        try:
            doomed_path = layout.new_deleting_dir(root, iteration)
            os.rename(path, doomed_path)
            fsync_dir(root)
        except OSError as err:
            # Rank 0 alone runs this, between collectives: raising would leave the other ranks waiting.
            # A checkpoint kept too long costs space, never correctness; the next save tries again.
            events.decision("retention", f"could not delete {path} ({' and '.join(reasons)}): {err}; kept")
            continue
        with contextlib.suppress(OSError):  # out of the iter_ namespace: debris at worst
            untrusted.remove_tree(doomed_path)
        events.decision("retention", f"deleted {path}: {' and '.join(reasons)}")
        deleted.append(iteration)
    return deleted
