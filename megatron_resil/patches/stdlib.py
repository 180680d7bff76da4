"""The interpreter's process-wide hooks: forks die with the process that forked them.

Whatever ends a rank (or its async writer), the processes it forks die with it: megatron-core's own
checkpoint writer forks helpers for each save (ours writes in the process that saves, but a fork can come
from any library), and one orphaned mid-save waits forever on a lock its dead parent held. Each fork gets
the kernel's parent-death signal (the forking thread is the rank's main thread, which lives as long as the
rank does).
"""

from __future__ import annotations

import ctypes
import os
import signal

from megatron_resil.patches.registry import STAND_DOWN, Has, Patch

_PR_SET_PDEATHSIG = 1
_forking_pid: int | None = None
_installed_in: int | None = None  # the rank (or writer) that installed the hook


def _forks_die_with_this_process() -> None:
    global _installed_in
    _installed_in = os.getpid()
    os.register_at_fork(before=_note_forking_pid, after_in_child=_die_with_parent)
    _note_forking_pid()


def _note_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _die_with_parent() -> None:
    # Only the installing process's own forks: a fork of a fork is a daemon being made (NVRx's in-process
    # monitor double-forks so that it outlives its short-lived middle process), and armed against that
    # middle process it would die the moment it was born.
    if _forking_pid != _installed_in:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != _forking_pid:  # the parent died before the signal was armed
        os._exit(1)


PATCHES = (
    Patch(
        name="forks die with their parent",
        package="python",
        written_for=">=3.10",
        target="os:register_at_fork",
        why="a helper forked by a library (megatron-core's checkpoint writer forks per save) outlives a "
            "killed rank and waits forever on a lock its parent held; each fork gets PR_SET_PDEATHSIG",
        checks=(Has("os:register_at_fork"),),
        apply=_forks_die_with_this_process,
        on_mismatch=STAND_DOWN,
        without="a killed rank's forked helpers may outlive it",
        per_process=True,  # armed for its installer's forks only: a standby's workers install their own
    ),
)
