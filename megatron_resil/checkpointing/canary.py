"""The post-load canary: checksums prove a checkpoint is what was written, not that what was written
was good. In Megatron-LM #5281 (and NVRx #349) replica shards were written with NaN weights: they
load "successfully" and training turns NaN a few iterations later, every time.

So after a resume from a non-persistent checkpoint the first K iterations are watched. A NaN or Inf
loss or grad norm on any rank condemns that checkpoint: the manager quarantines it and reloads the
newest verified persistent one. Persistent checkpoints are the trust anchor and are not watched, so
this happens at most once per checkpoint and can never loop.
"""

from __future__ import annotations

import math

from megatron_resil import parallel
from megatron_resil.checkpointing.tier import CheckpointTier, TierCandidate


class LoadCanary:
    def __init__(self, iterations: int) -> None:
        self.iterations = iterations
        self._watching: tuple[CheckpointTier, TierCandidate, int] | None = None

    @property
    def watching(self) -> bool:
        return self._watching is not None

    def arm(self, tier: CheckpointTier, candidate: TierCandidate, loaded_iteration: int) -> None:
        if self.iterations > 0:
            self._watching = (tier, candidate, loaded_iteration)

    def check(self, iteration: int, loss: float, grad_norm: float):
        """(tier, candidate, why) if the watched checkpoint just failed, else None. Collective while
        armed (one small all-reduce per watched iteration), so every rank decides the same."""
        if self._watching is None:
            return None
        tier, candidate, loaded = self._watching
        bad = [name for name, value in (("loss", loss), ("grad norm", grad_norm))
               if not math.isfinite(value)]
        if not parallel.any_rank(bool(bad)):
            if iteration - loaded >= self.iterations:
                self._watching = None  # survived its watch
            return None
        self._watching = None
        what = " and ".join(bad) or "loss or grad norm on another rank"
        return tier, candidate, (f"non-finite {what} at iteration {iteration}, "
                                 f"{iteration - loaded} iteration(s) after loading it")
