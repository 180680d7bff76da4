"""Picks what to resume from: the first candidate, across tiers in order, that every rank verifies.

Each rank verifies its part; one collective decides, so all ranks accept or all move on together
and a load never diverges. Rank 0 logs one line per candidate with the verdict and its reason. A reason
may quote the checkpoint (a file name, a manifest key): it is escaped (events.escape_untrusted) before
it is logged or written beside a quarantined candidate, so no name can stop the fallback.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.checkpoint.api import CheckpointException

from megatron_resil import events, parallel, phase_marks
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
    return events.escape_untrusted(f"rank {first_rank}: {first}{more}")


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
    return events.escape_untrusted(f"{type(err).__name__}: {first_line}")


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

# An I/O error (EIO, ESTALE, a vanished file) while verifying or reading a candidate may be the storage's,
# not the checkpoint's: every rank tries again together, after 1 s and 3 s, before the candidate is
# skipped. It is never quarantined for that: an I/O error is no evidence that its bytes are bad.
IO_RETRY_DELAYS_SECS = (1.0, 3.0)


def _io_error(err: BaseException) -> str | None:
    """The one-line I/O error behind `err`, or None when it is something else (bad data, a bug)."""
    cause = _root_cause(err)
    if isinstance(cause, OSError) and not isinstance(cause, (CheckpointDataError, CheckpointFormatError)):
        return _one_line(cause)
    return None


def _retrying_io_errors(step: Callable[[], object], where: str, doing: str):
    """Run `step` on every rank; while any rank met an I/O error, all run it again after a delay.
    Returns (result of this rank's step, None) or (None, the I/O errors summarised) when retries ran out.
    One collective per attempt, so no rank waits for another."""
    for attempt, delay in enumerate((*IO_RETRY_DELAYS_SECS, None), start=1):
        try:
            result, io_error = step(), None
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - anything else goes back to the caller
            io_error = _io_error(err)
            if io_error is None:
                raise
            result = None
        errors = parallel.all_gather_object(io_error)
        if not any(errors):
            return result, None
        if delay is None:
            return None, _summarise(errors)
        events.decision("load", f"I/O error while {doing} {where} ({_summarise(errors)}); trying again in "
                        f"{delay:g} s (attempt {attempt + 1} of {len(IO_RETRY_DELAYS_SECS) + 1})",
                        verdict="retry", reason=_summarise(errors))
        time.sleep(delay)
    raise AssertionError("unreachable")


def _skip_after_io_errors(where: str, candidate: TierCandidate, why: str) -> None:
    events.decision("load", f"skipped {where}: I/O errors persisted through {len(IO_RETRY_DELAYS_SECS) + 1} "
                    f"attempts ({why}); not quarantined, an I/O error says nothing about its bytes",
                    verdict="skipped", tier=candidate.tier, iteration=candidate.iteration,
                    path=candidate.path, reason=why)


def load_first_verified(tiers: list[CheckpointTier], make_template: TemplateMaker,
                        older_than: int | None = None) -> LoadResult | None:
    """`tiers` in order of trust; candidates are tried newest first across all of them (those of
    iterations before `older_than` only, if given). `make_template(candidate, saved args, saved sharding
    metadata)` builds what the candidate is loaded into."""
    for tier, candidate in newest_first(tiers, older_than):
        where = f"{candidate.tier} iteration {candidate.iteration} ({candidate.path})"
        def verify(tier=tier, candidate=candidate) -> str | None:
            try:  # an error on one rank must not leave the others waiting in the agreement below
                return tier.verify(candidate)
            except Exception as err:  # noqa: BLE001 - reported as this rank's finding
                if _io_error(err) is not None:
                    raise
                return f"could not be verified ({_one_line(err)})"

        reason, io_failure = _retrying_io_errors(verify, where, "verifying")
        if io_failure is not None:
            _skip_after_io_errors(where, candidate, io_failure)
            continue
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
        def load(tier=tier, candidate=candidate):
            phase_marks.mark("chosen")  # verified: reading it begins
            try:
                template = make_template(candidate, tier.saved_args(candidate),
                                         tier.saved_metadata(candidate))
                return tier.load(candidate, template), None
            # Reported collectively below, so no rank is left waiting. torch's DCP raises
            # CheckpointException, a BaseException, around the error of each rank.
            except (Exception, CheckpointException) as err:
                if _io_error(err) is not None:
                    raise
                cause = _root_cause(err)
                if isinstance(cause, CheckpointDataError):  # bad data found while reading: as verification
                    return None, ("data", _one_line(cause))
                if isinstance(cause, CheckpointFormatError):  # the same on every rank: common.pt is shared
                    return None, ("format", str(cause))
                return None, ("model", _one_line(cause))

        loaded, io_failure = _retrying_io_errors(load, where, "reading")
        if io_failure is not None:
            _skip_after_io_errors(where, candidate, io_failure)
            continue
        state, failure = loaded
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
