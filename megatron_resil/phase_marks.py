"""The moments a restart's phases are measured between: each part of a rank's way to its first iteration
marks the wall-clock time it reached its boundary (`mark("loaded")`), and resilience/restart_phases.py
turns the marks into the attempt's `restart_phases` record. Marking is a dict write, safe to call from any
layer, and this module imports nothing: pretrain.py marks before anything is imported.
"""

from __future__ import annotations

import time

_process_marks: dict[str, float] = {}  # once per process: when the interpreter reached our code
_marks: dict[str, float] = {}  # this attempt's boundaries


def mark(name: str) -> None:
    """This attempt reached boundary `name` now (every rank)."""
    _marks[name] = time.time()


def attempt_marks() -> dict[str, float]:
    return dict(_marks)


def new_attempt() -> None:
    """An attempt begins: the previous one's marks are dropped."""
    _marks.clear()


def interpreter_started() -> None:
    """The interpreter reached our code (pretrain.py's first lines): a detail of the imports phase."""
    _process_marks.setdefault("interpreter", time.time())


def process_marks() -> dict[str, float]:
    return dict(_process_marks)


def adopt_process_marks(marks: dict[str, float]) -> None:
    """A standby worker: its client's marks (its interpreter is the one the launcher started)."""
    _process_marks.update(marks)
