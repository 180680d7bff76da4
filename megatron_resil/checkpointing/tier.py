"""The interface every checkpoint tier implements, and the candidate it offers the loader.

The loader sees only this: a tier lists candidates newest first, verifies one (returning the reason
it is unusable, or None), loads one into a sharded template, and saves. It never sees a format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass


class CheckpointSaveError(RuntimeError):
    """A save that could not complete; the previous checkpoint and the tracker are untouched."""


class PublishWithheld(Exception):
    """A save written in full that this process may no longer publish: its tier's `may_publish` said no (the
    trainer's launcher is gone, resilience/launcher_watch.py). Not a failed save: raised to the trainer,
    which decides what follows; the staging directory is the next run's to remove."""


class CheckpointDataError(Exception):
    """Raised by a tier's load when the candidate's data proves bad while being read (a format's own
    check, e.g. zarr's per-chunk crc32c, after the manifest passed or was skipped): the loader
    rejects the candidate as if verification had failed, instead of treating it as a model mismatch."""


class CheckpointFormatError(Exception):
    """Raised while building a candidate's load template when its format is one this program no longer
    reads: the message says what to do; the loader stops there (an older candidate is no better)."""


class NotForThisRun(str):
    """A `verify` reason that passes over a candidate without quarantining it: nothing is wrong with it,
    but this run cannot use it (e.g. a node-local checkpoint saved under another parallel layout)."""


@dataclass(frozen=True)
class TierCandidate:
    tier: str  # e.g. "persistent"
    iteration: int
    path: str
    note: str = ""  # why it is ordered where it is (e.g. "named by tracker")


@dataclass
class AsyncSaveJob:
    """A save a tier has staged for --async-save. `work(*work_args)` runs in this rank's background
    worker (so both must pickle) and returns what `publish` needs from this rank. Once every rank's
    work succeeded, `publish` (collective) gets the results of all ranks, makes the checkpoint
    visible atomically and returns its path; if any rank's work failed, `abandon` (collective)
    drops what was staged. Either may raise CheckpointSaveError."""
    iteration: int
    work: Callable
    work_args: tuple
    publish: Callable[[list], str]
    abandon: Callable[[], None]


class CheckpointTier(ABC):
    name: str
    supports_async_save = False  # True where save_async is implemented
    # How the state this tier saves is sharded (state.sharding_metadata), set by the checkpoint manager.
    content_metadata: dict | None = None
    # The most bytes one rank's whole-state file of this run can hold (state.max_rank_bytes), set by the
    # checkpoint manager from the model; None where no model is known (the ckpt tool, --use-checkpoint-args).
    max_rank_bytes: int | None = None

    @abstractmethod
    def candidates(self) -> list[TierCandidate]:
        """What this tier could load, in the order it should be tried. Runs on every rank."""

    @abstractmethod
    def verify(self, candidate: TierCandidate) -> str | None:
        """This rank's check of its part: None if usable, else a one-line reason."""

    @abstractmethod
    def load(self, candidate: TierCandidate, sharded_template: dict) -> dict:
        """Collective: fill the template from the candidate and return the loaded state."""

    def saved_args(self, candidate: TierCandidate):
        """The command line the candidate was saved with (after verify accepted it): a Namespace, or a
        dict for checkpoints of megatron-resil before 0.2."""
        return {}

    def saved_metadata(self, candidate: TierCandidate) -> dict | None:
        """How the candidate's state is sharded (what `content_metadata` was when it was saved)."""
        return self.content_metadata

    @abstractmethod
    def save(self, sharded_state: dict, iteration: int) -> str:
        """Collective: write and publish atomically; returns the published path."""

    def save_async(self, sharded_state: dict, iteration: int) -> AsyncSaveJob:
        """Collective: stage a save whose writing a background worker does (--async-save)."""
        raise NotImplementedError(f"the {self.name} tier saves synchronously only")

    def quarantine(self, candidate: TierCandidate, reason: str) -> None:  # noqa: B027 - optional
        """Collective: set aside a candidate that failed verification so it is never tried again."""

    def startup_cleanup(self) -> None:  # noqa: B027 - optional hook, most tiers have nothing to clean
        """Collective: recognise and remove leftovers of interrupted saves (default: none)."""
