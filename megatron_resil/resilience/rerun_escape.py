"""The escape hatch from the rerun state machine's restart loop (Megatron-LM #5281).

megatron-core's one remedy for a fault that reproduces on the same device is to save a diagnostic checkpoint
and exit 16, to be resumed on another device. Resumed on the same node and device it exits 16 again, saving
nothing, and under ft_launcher's in-job restarts (same nodes, same devices) that repeats until someone
cancels the job: 44 restarts in #5281.

Here those same-device retries are bounded (--rerun-max-same-device-retries) and counted in a ledger kept
atomically beside the checkpoints (<save>/rerun_escape.json), so the count survives restarts and requeues.
When they are used up the job falls back, in the same process, to the newest verified persistent checkpoint
older than the diagnostic one (non-persistent tiers are skipped: a bad state may have been written there) and
trains on. If the fault reproduces from there too, before it passes the iteration where it first struck, it
follows neither the device nor the checkpoint: the job stops with exit 8 (UNRECOVERABLE, do not requeue) and
says what to look at. Completing that iteration closes the incident.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field

from megatron_resil import events, exit_codes, parallel
from megatron_resil.checkpointing.atomic import atomic_write_text
from megatron_resil.progress import TrainProgress
from megatron_resil.resilience import rerun
from megatron_resil.resilience.rerun import RerunStop

LEDGER_NAME = "rerun_escape.json"


@dataclass
class Incident:
    """One fault that the rerun state machine reproduced in place, from its first exit 16 on."""

    fault_iteration: int  # the step that failed validation (never taken)
    diagnostic_iteration: int  # the checkpoint saved for exit 16: the one that reproduces the fault
    same_device_retries: int = 0  # resumes of it on the same node and device that failed again
    fallback_iteration: int | None = None  # the older persistent checkpoint fallen back to
    status: str = "open"  # open, resolved, unrecoverable
    history: list[str] = field(default_factory=list)


class RerunEscape:
    """Consulted by the training loop when the rerun state machine would end the job (`judge`), and after
    each step taken (`step_taken`). Every rank holds the same ledger and decides the same; rank 0 writes
    it."""

    def __init__(self, max_retries: int, save_dir: str | None) -> None:
        self.max_retries = max_retries
        self.path = os.path.join(save_dir, LEDGER_NAME) if save_dir else None
        self.incident: Incident | None = parallel.broadcast_object(
            self._read() if parallel.is_rank0() else None)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RerunEscape:
        return cls(args.rerun_max_same_device_retries, args.save)

    # ---- the ledger ------------------------------------------------------------------------------
    def _read(self) -> Incident | None:
        if self.path is None or not os.path.exists(self.path):
            return None
        try:
            with open(self.path) as f:
                return Incident(**json.load(f))
        except (OSError, ValueError, TypeError) as err:  # written atomically: only a hand edit gets here
            events.warn(f"{self.path} is unreadable ({type(err).__name__}: {err}); counting same-device "
                        "retries afresh")
            return None

    def _write(self, note: str) -> None:
        self.incident.history.append(note)
        if self.path is not None and parallel.is_rank0():
            atomic_write_text(self.path, json.dumps(asdict(self.incident), indent=1) + "\n")

    # ---- the decisions ---------------------------------------------------------------------------
    def judge(self, stop: RerunStop, progress: TrainProgress, checkpoints) -> tuple[TrainProgress,
                                                                                    RerunStop | None]:
        """(progress, the stop to end the job with), or (the fallback's progress, None) to train on.

        A retry is any resumed job in which the incident's fault struck again: megatron-core's own
        same-device verdict (it resumed the diagnostic checkpoint), or a fault reproduced in place from
        another checkpoint of the same iteration (a node-local one is preferred at equal iterations and
        holds no rerun state)."""
        if stop.verdict not in ("reproduced", "same-device"):
            stop.announce()
            return progress, stop
        incident = self.incident
        recurring = incident is not None and incident.status == "open" and \
            incident.fault_iteration == stop.iteration
        if incident is not None and incident.status == "open" and incident.fallback_iteration is not None \
                and stop.iteration <= incident.fault_iteration:
            return progress, self._unrecoverable(
                stop, f"it reproduced again after the fallback from the checkpoint of iteration "
                      f"{incident.diagnostic_iteration} to the persistent one of iteration "
                      f"{incident.fallback_iteration}: it follows neither the device nor the checkpoint")
        if not recurring:
            self.incident = Incident(stop.iteration, stop.iteration - 1)
            if stop.verdict == "reproduced":  # the first time: megatron-core's exit 16, as in Megatron
                self._write(f"iteration {stop.iteration}: reproduced in place; diagnostic checkpoint of "
                            f"iteration {stop.iteration - 1}; exit {stop.exit_code}")
                stop.announce(f"; retries of it are bounded by --rerun-max-same-device-retries "
                              f"{self.max_retries} (counted in {self.path or 'memory only: no --save'})")
                return progress, stop
        self.incident.same_device_retries += 1
        retries = self.incident.same_device_retries
        if retries <= self.max_retries:
            self._write(f"iteration {stop.iteration}: {stop.verdict}; same-device retry {retries} of "
                        f"{self.max_retries}")
            stop.announce(f"; same-device retry {retries} of {self.max_retries} "
                          "(--rerun-max-same-device-retries)")
            return progress, stop
        return self._fall_back(stop, progress, checkpoints)

    def _fall_back(self, stop: RerunStop, progress: TrainProgress, checkpoints) -> tuple[TrainProgress,
                                                                                          RerunStop | None]:
        incident = self.incident
        diagnostic = stop.iteration - 1
        events.decision("rerun", f"{stop.reason}; the {self.max_retries} same-device retries "
                        "(--rerun-max-same-device-retries) are used up: instead of exiting 16 again, "
                        "falling back to the newest verified persistent checkpoint older than iteration "
                        f"{diagnostic} (the diagnostic checkpoint; non-persistent tiers skipped)",
                        iteration=stop.iteration, verdict="fallback", findings=list(stop.findings))
        rerun.reset()  # first: nothing of the abandoned rerun may be asked of the older checkpoint
        loaded = checkpoints.fall_back(older_than=diagnostic)
        if loaded is None:
            return progress, self._unrecoverable(
                stop, f"there is no verified persistent checkpoint older than iteration {diagnostic} to fall "
                      "back to")
        incident.fallback_iteration = loaded.iteration
        self._write(f"iteration {stop.iteration}: same-device retries used up; fell back to persistent "
                    f"iteration {loaded.iteration}")
        events.decision("rerun", f"fell back to persistent iteration {loaded.iteration}: training on; "
                        f"if the fault reproduces before iteration {stop.iteration} is passed, the job stops "
                        f"with exit code {exit_codes.UNRECOVERABLE}", iteration=loaded.iteration,
                        verdict="fell-back")
        return loaded, None

    def _unrecoverable(self, stop: RerunStop, why: str) -> RerunStop:
        self.incident.status = "unrecoverable"
        self._write(f"iteration {stop.iteration}: unrecoverable: {why}")
        reason = (f"{stop.reason}; {why}. Another restart would fail the same way. Look at the data of "
                  f"iteration {stop.iteration}, the loss and learning rate before it, and the diagnostic "
                  f"checkpoint of iteration {self.incident.diagnostic_iteration}; the incident is recorded "
                  f"in {self.path or 'no file (no --save)'} (delete it to allow the retries again)")
        final = RerunStop(reason, exit_codes.UNRECOVERABLE, requeue=False, checkpoint=False,
                          verdict="unrecoverable", iteration=stop.iteration, findings=stop.findings)
        final.announce(" (do not requeue)")
        return final

    def step_taken(self, iteration: int) -> None:
        """After a step: passing the iteration where the open incident's fault struck closes it."""
        if self.incident is not None and self.incident.status == "open" and \
                iteration >= self.incident.fault_iteration:
            self.incident.status = "resolved"
            self._write(f"iteration {iteration}: passed")
            how = f"after the fallback to iteration {self.incident.fallback_iteration}" \
                if self.incident.fallback_iteration is not None else "on this node and device"
            events.decision("rerun", f"iteration {iteration} completed {how}: the fault of iteration "
                            f"{self.incident.fault_iteration} is behind us (recorded in {self.path})",
                            iteration=iteration, verdict="resolved")
