"""Picks what to resume from: the first candidate, across tiers in order, that every rank verifies.

Each rank verifies its part; one collective decides, so all ranks accept or all move on together
and a load never diverges. Rank 0 logs one line per candidate with the verdict and its reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from megatron_resil import events, parallel
from megatron_resil.checkpointing.tier import CheckpointTier, TierCandidate


@dataclass
class LoadResult:
    candidate: TierCandidate
    state: dict


def _gather_reasons(reason: str | None) -> list[str | None]:
    if not dist.is_initialized():
        return [reason]
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return reasons


def _summarise(reasons: list[str | None]) -> str:
    bad = [(rank, r) for rank, r in enumerate(reasons) if r is not None]
    first_rank, first = bad[0]
    more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
    return f"rank {first_rank}: {first}{more}"


def load_first_verified(tiers: list[CheckpointTier],
                        make_template: Callable[[TierCandidate], dict]) -> LoadResult | None:
    for tier in tiers:
        for candidate in tier.candidates():
            where = f"{candidate.tier} iteration {candidate.iteration} ({candidate.path})"
            reason = tier.verify(candidate)
            if not parallel.all_ranks_agree(reason is None):
                events.decision("load", f"rejected {where}: {_summarise(_gather_reasons(reason))}")
                continue
            try:
                state = tier.load(candidate, make_template(candidate))
                failure = None
            except Exception as err:  # a verified checkpoint that still fails to load is rejected too
                state, failure = None, f"load failed: {type(err).__name__}: {str(err)[:200]}"
            if not parallel.all_ranks_agree(failure is None):
                events.decision("load", f"rejected {where}: {_summarise(_gather_reasons(failure))}")
                continue
            events.decision("load", f"accepted {where}: verified, {candidate.note}")
            return LoadResult(candidate, state)
    return None
