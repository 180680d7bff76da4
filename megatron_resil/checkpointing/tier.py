"""The interface every checkpoint tier implements, and the candidate it offers the loader.

The loader sees only this: a tier lists candidates newest first, verifies one (returning the reason
it is unusable, or None), loads one into a sharded template, and saves. It never sees a format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class TierCandidate:
    tier: str  # e.g. "persistent"
    iteration: int
    path: str
    note: str = ""  # why it is ordered where it is (e.g. "named by tracker")


class CheckpointTier(ABC):
    name: str

    @abstractmethod
    def candidates(self) -> list[TierCandidate]:
        """What this tier could load, in the order it should be tried. Runs on every rank."""

    @abstractmethod
    def verify(self, candidate: TierCandidate) -> str | None:
        """This rank's check of its part: None if usable, else a one-line reason."""

    @abstractmethod
    def load(self, candidate: TierCandidate, sharded_template: dict) -> dict:
        """Collective: fill the template from the candidate and return the loaded state."""

    def saved_args(self, candidate: TierCandidate) -> dict:
        """The command line the candidate was saved with (after verify accepted it)."""
        return {}

    @abstractmethod
    def save(self, sharded_state: dict, iteration: int) -> str:
        """Collective: write and publish atomically; returns the published path."""

    def quarantine(self, candidate: TierCandidate, reason: str) -> None:  # noqa: B027 - optional
        """Collective: set aside a candidate that failed verification so it is never tried again."""

    def startup_cleanup(self) -> None:  # noqa: B027 - optional hook, most tiers have nothing to clean
        """Collective: recognise and remove leftovers of interrupted saves (default: none)."""
