"""Picks what to resume from: the first candidate, across tiers in order, that every rank verifies.

Each rank verifies its part; one collective decides, so all ranks accept or all move on together
and a load never diverges. Rank 0 logs one line per candidate with the verdict and its reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.checkpoint.api import CheckpointException

from megatron_resil import events, parallel
from megatron_resil.checkpointing.tier import (
    CheckpointDataError,
    CheckpointFormatError,
    CheckpointTier,
    NotForThisRun,
    TierCandidate,
)


class CheckpointLoadError(RuntimeError):
    """A candidate passed verification but could not be loaded into this model: an incompatible
    configuration (model shape, parallel layout), not bad data, so falling back would be wrong."""


@dataclass
class LoadResult:
    candidate: TierCandidate
    state: dict


def _summarise(reasons: list[str | None]) -> str:
    bad = [(rank, r) for rank, r in enumerate(reasons) if r is not None]
    first_rank, first = bad[0]
    more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
    return f"rank {first_rank}: {first}{more}"


def _root_cause(err: BaseException) -> BaseException:
    """DCP wraps each rank's real error in a CheckpointException; the first one of them."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))
        if isinstance(err, tuple):  # (exception, traceback) in some torch versions
            err = err[0]
    return err


def _one_line(err: BaseException) -> str:
    err = _root_cause(err)
    first_line = (str(err).splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first_line}"


def newest_first(tiers: list[CheckpointTier], older_than: int | None = None):
    """Merge the tiers' lists by iteration, newest first, keeping each tier's own order (its tracker's
    pick first) and, at equal iterations, the order of `tiers` (most trusted first); `older_than`: only
    candidates of earlier iterations."""
    queues = [(tier, [c for c in tier.candidates() if older_than is None or c.iteration < older_than])
              for tier in tiers]
    while any(candidates for _, candidates in queues):
        tier, candidates = max((q for q in queues if q[1]), key=lambda q: q[1][0].iteration)
        yield tier, candidates.pop(0)


TemplateMaker = Callable[[TierCandidate, object, "dict | None"], dict]


def load_first_verified(tiers: list[CheckpointTier], make_template: TemplateMaker,
                        older_than: int | None = None) -> LoadResult | None:
    """`tiers` in order of trust; candidates are tried newest first across all of them (those of
    iterations before `older_than` only, if given). `make_template(candidate, saved args, saved sharding
    metadata)` builds what the candidate is loaded into."""
    for tier, candidate in newest_first(tiers, older_than):
        where = f"{candidate.tier} iteration {candidate.iteration} ({candidate.path})"
        try:  # an error on one rank must not leave the others waiting in the agreement below
            reason = tier.verify(candidate)
        except Exception as err:  # noqa: BLE001 - reported as this rank's finding
            reason = f"could not be verified ({_one_line(err)})"
        if not parallel.all_ranks_agree(reason is None):
            reasons = parallel.all_gather_object(reason)
            why = _summarise(reasons)
            if any(isinstance(r, NotForThisRun) for r in reasons):  # it explains the others' findings too
                events.decision("load", f"passed over {where}: {why}", verdict="skipped", tier=candidate.tier,
                                iteration=candidate.iteration, path=candidate.path, reason=why)
                continue
            events.decision("load", f"rejected {where}: {why}", verdict="rejected", tier=candidate.tier,
                            iteration=candidate.iteration, path=candidate.path, reason=why)
            tier.quarantine(candidate, why)
            continue
        try:
            template = make_template(candidate, tier.saved_args(candidate), tier.saved_metadata(candidate))
            state = tier.load(candidate, template)
            failure = None
        # Reported collectively below, so no rank is left waiting. torch's DCP raises
        # CheckpointException, a BaseException, around the error of each rank.
        except (Exception, CheckpointException) as err:
            cause = _root_cause(err)
            if isinstance(cause, CheckpointDataError):  # bad data found while reading: as verification
                state, failure = None, ("data", _one_line(cause))
            elif isinstance(cause, CheckpointFormatError):  # the same on every rank: common.pt is shared
                state, failure = None, ("format", str(cause))
            else:
                state, failure = None, ("model", _one_line(cause))
        if not parallel.all_ranks_agree(failure is None):
            failures = parallel.all_gather_object(failure)
            if any(f is not None and f[0] == "data" for f in failures):
                why = _summarise([f[1] if f is not None and f[0] == "data" else None for f in failures])
                events.decision("load", f"rejected {where} while loading it: {why}", verdict="rejected",
                                tier=candidate.tier, iteration=candidate.iteration, path=candidate.path,
                                reason=why)
                tier.quarantine(candidate, why)
                continue
            if any(f is not None and f[0] == "format" for f in failures):
                refused = next(f[1] for f in failures if f is not None and f[0] == "format")
                raise CheckpointLoadError(f"{where}: {refused}")
            raise CheckpointLoadError(f"{where} passed verification but does not load into this model "
                                      f"({_summarise([f and f[1] for f in failures])}); check that the "
                                      "model and parallel flags match the run that saved it")
        events.decision("load", f"accepted {where}: verified, {candidate.note}", verdict="accepted",
                        tier=candidate.tier, iteration=candidate.iteration, path=candidate.path)
        return LoadResult(candidate, state)
    return None
