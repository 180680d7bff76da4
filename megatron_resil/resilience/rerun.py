"""Result validation through megatron-core's rerun state machine, wired as Megatron-LM wires it: each
microbatch loss is checked for NaN and Inf (and for a spike, with --check-for-spiky-loss) as its loss_func
does, and this rank's grad norm for NaN and Inf before the data-parallel reduction, as its DDP does. A
step runs under the machine's rerun loop (`StepValidation`); its verdict may end the job (`RerunStop`):
exit 16, resume from the checkpoint elsewhere to disambiguate, or 17, failed validation.

Replaying a step needs no data-iterator wrapper: a batch is a pure function of the consumed-sample count
(data.get_microbatch), which advances only once a step is taken, so a rerun in place and a job resumed from
the machine's checkpoint read the same batches. The machine gets no iterator (None) and saves and restores
the RNG states around a rerun itself. Without a rejected result nothing is redrawn or reordered.
"""

from __future__ import annotations

import argparse
import math
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core import tensor_parallel
from megatron.core.rerun_state_machine import (
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    QuickStats,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    destroy_rerun_state_machine,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
)

from megatron_resil import events, parallel
from megatron_resil.progress import TrainProgress

SPIKY_LOSS_FACTOR = 10  # Megatron-LM's: a loss 10x the largest of the first 100 seen is a spike


@dataclass(frozen=True)
class RerunConfig:
    mode: str = "validate_results"
    error_injection_rate: int = 0
    error_injection_type: str = "transient_error"
    check_nan: bool = True  # --no-check-for-nan-in-loss-and-grad turns it off
    check_spiky: bool = False
    stats_interval: int = 100  # report_determinism_stats: report every this many iterations (--log-interval)
    save: str | None = None
    seed: int = 1234

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RerunConfig:
        return cls(mode=args.rerun_mode, error_injection_rate=args.error_injection_rate,
                   error_injection_type=args.error_injection_type,
                   check_nan=args.check_for_nan_in_loss_and_grad, check_spiky=args.check_for_spiky_loss,
                   stats_interval=args.log_interval, save=args.save, seed=args.seed)


# The machine is megatron-core's process-wide singleton; its configuration lives beside it. A train_step
# called without `initialize` (the benchmarks) gets megatron-core's implicit machine (disabled: a rejected
# result raises) and Megatron's default checks.
_config = RerunConfig()


@dataclass(frozen=True)
class RerunStop:
    """The machine ends the job after a step that is not taken (same fields as stop_conditions.Stop).
    Announced by the training loop's escape hatch (rerun_escape.py), which may overrule it."""

    reason: str
    exit_code: int
    requeue: bool
    checkpoint: bool  # save the iteration before the step, the machine's state in it
    # transient, reproduced, same-device or failed-elsewhere (StepValidation._outcome); unrecoverable
    verdict: str
    iteration: int = 0  # the step not taken
    findings: tuple[str, ...] = ()

    def action(self) -> str:
        previous = self.iteration - 1
        if not self.checkpoint:
            if self.exit_code != EXIT_CODE_RESUME_TO_DISAMBIGUATE:
                return f"exiting with code {self.exit_code}"
            return f"exiting with code {self.exit_code} (the checkpoint of iteration {previous} is the one " \
                   "to resume)"
        if _config.save is None:
            return f"exiting with code {self.exit_code}; no --save to hold the checkpoint of iteration " \
                   f"{previous}"
        return f"saving the checkpoint of iteration {previous} (the step is not taken) and exiting with " \
               f"code {self.exit_code}"

    def announce(self, note: str = "") -> None:
        """The one log line and event-log records of this stop; `note`: what the escape hatch adds."""
        events.decision("rerun", f"{self.reason}{note}; {self.action()}", iteration=self.iteration,
                        exit_code=self.exit_code, verdict=self.verdict, findings=list(self.findings))
        events.record("exit", message=self.reason, iteration=self.iteration - 1, exit_code=self.exit_code,
                      requeue=self.requeue)


def initialize(config: RerunConfig) -> None:
    """(Re)create the machine for this run, before a checkpoint is loaded: one may hold its state. Called
    again by an in-process restart."""
    global _config
    destroy_rerun_state_machine()
    initialize_rerun_state_machine(
        state_save_func=_save_rng_tracker, state_restore_func=_restore_rng_tracker,
        mode=RerunMode(config.mode),
        error_injector=_ErrorInjector(config.error_injection_rate,
                                     RerunDiagnostic(config.error_injection_type), config.seed))
    _config = config


def reset() -> None:
    """A fresh machine with this run's configuration: after the escape hatch loaded an older checkpoint,
    nothing of the abandoned rerun may carry over."""
    initialize(_config)


# The step being validated: the machine's validate_result calls (ours in the loss function, DDP's on each
# gradient bucket) are reported to it, so its log line can say what was rejected on which rank.
_active_step: StepValidation | None = None


def report_validation(validate: Callable, result, rejection_func: Callable, message: str,
                      comparison_func: Callable | None, tolerance: float, fatal: bool) -> None:
    """One of the machine's validate_result calls, `validate` being megatron-core's (patches/megatron_core.py
    routes every call here): to the step being validated, which remembers it for its log line."""
    if _active_step is None:
        return validate(result, rejection_func, message, comparison_func=comparison_func, tolerance=tolerance,
                        fatal=fatal)
    return _active_step._validate(validate, result, rejection_func, message, comparison_func, tolerance,
                                  fatal)


class _ErrorInjector(RerunErrorInjector):
    """megatron-core's injector with a generator of its own. Its own draws from Python's global `random`,
    which the machine restores before a rerun: after an injected rejection that the run survives (a check
    that is not fatal), every later step drew the same number and was injected again."""

    def __init__(self, rate: int, kind: RerunDiagnostic, seed: int) -> None:
        super().__init__(rate, kind)
        self._random_state = random.Random(seed).getstate()

    def maybe_inject(self) -> bool:
        outer = random.getstate()
        random.setstate(self._random_state)
        try:
            return super().maybe_inject()
        finally:
            self._random_state = random.getstate()
            random.setstate(outer)


def _save_rng_tracker():
    # The machine itself saves the Python, NumPy, torch and CUDA generators; Megatron-LM adds the
    # tensor-parallel RNG tracker (dropout inside model-parallel regions).
    return {"rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _restore_rng_tracker(state: dict) -> None:
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


@dataclass
class _Finding:
    """What one rank rejected in this step, for the one log line."""

    message: str
    value: float
    injected: str | None = None
    rerun_value: float | None = None

    def __str__(self) -> str:
        injected = f", injected {self.injected}" if self.injected else ""
        rerun = "" if self.rerun_value is None else f"; rerun: {self.rerun_value:.6g}"
        return f"{self.message} ({self.value:.6g}{injected}{rerun})"


class StepValidation:
    """One training step under the machine's loop:

        step = StepValidation(iteration)
        while step.runs():         # once, twice on a rerun in place
            ... forward, step.check_loss(loss), backward (DDP checks the gradients) ...
        stop = step.verdict()      # None: take the step (optimizer); else do not, and end the job
    """

    def __init__(self, iteration: int, nan_checks: bool = True,
                 on_raised: Callable[[str], None] | None = None) -> None:
        self.iteration = iteration
        self.on_raised = on_raised  # told why, when a check raises (--rerun-mode disabled)
        # Off while the post-load canary watches a non-persistent checkpoint: a NaN there condemns the
        # checkpoint (see checkpointing/canary.py) instead of starting a rerun that would save it again.
        self.nan_checks = nan_checks and _config.check_nan
        self.machine = get_rerun_state_machine()
        global _active_step
        _active_step = self
        self.passes: list[RerunState] = []
        self._calls: dict[str, int] = defaultdict(int)
        self._rejected: tuple[str, int] | None = None
        self._finding: _Finding | None = None
        if self.machine.state == RerunState.NOT_RUNNING_YET:  # a fresh step, not one resumed for a rerun
            # Its logs then number steps as we do (Megatron-LM's train() sets it the same way, once). That
            # the machine forgets the rejected call of an earlier step is patches/megatron_core.py's.
            self.machine.current_iteration = iteration - 1

    def runs(self) -> bool:
        """Whether to (re)run forward and backward; zero the gradients before each pass."""
        if not self.machine.should_run_forward_backward(None):
            return False
        self._calls.clear()
        self.passes.append(self.machine.state)
        call = self.machine.failed_validation_call
        if self.machine.state == RerunState.RERUNNING_FROM_CHECKPOINT and call is not None:
            self._rejected = (call.caller.message, call.sequence)  # this rank's, from the checkpoint
            injected = self.machine.error_injector.injected_error_type
            self._finding = _Finding(call.caller.message, _as_float(self.machine.initial_result),
                                     injected.value if injected else None)
        return True

    def check_loss(self, loss: torch.Tensor) -> None:
        """Megatron-LM's loss_func checks, on one microbatch's loss."""
        # The machine keeps the result to compare a rerun's with: a copy, since the pipeline schedule
        # divides the returned loss in place (by its tokens and the microbatches) after this check.
        loss = loss.detach().clone()
        validate = self.machine.validate_result
        if self.nan_checks:
            validate(loss, torch.isnan, "found NaN in local forward loss calculation", fatal=True)
            validate(loss, torch.isinf, "found Inf in local forward loss calculation", fatal=True)
        if _config.check_spiky:
            spike = partial(self.machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss")
            validate(loss, spike, "Spiky loss", fatal=False)

    @property
    def grad_checks(self) -> bool:
        """Whether megatron-core's DDP validates this rank's gradient norm before the reduction, as
        Megatron-LM has it do (its findings reach this step through the machine, see `report_validation`)."""
        return self.nan_checks

    def _validate(self, validate: Callable, result: torch.Tensor, rejection_func: Callable, message: str,
                  comparison_func: Callable | None, tolerance: float, fatal: bool) -> None:
        """One of the machine's validate_result calls (ours or DDP's), remembered for the one log line."""
        machine = self.machine
        self._calls[message] += 1
        call = (message, self._calls[message])
        already_rejected = machine.rerun_requested
        try:
            validate(result, rejection_func, message, comparison_func=comparison_func, tolerance=tolerance,
                     fatal=fatal)
        except RuntimeError:
            # --rerun-mode disabled: megatron-core raises on a rejected result (a NaN, an Inf). The state
            # that produced it is suspect: same-step recovery must not hand it on (replica_recovery.py).
            if self.on_raised is not None and machine.mode == RerunMode.DISABLED:
                self.on_raised(f"iteration {self.iteration} raised on a rejected result ({message}, "
                               "--rerun-mode disabled)")
            raise
        if machine.mode != RerunMode.VALIDATE_RESULTS:
            return
        if machine.state == RerunState.INITIAL_RUN and machine.rerun_requested and not already_rejected:
            injected = machine.error_injector.injected_error_type
            self._rejected = call
            self._finding = _Finding(message, _as_float(result), injected.value if injected else None)
        elif call == self._rejected and self._finding is not None:
            self._finding.rerun_value = _as_float(result)

    def verdict(self) -> RerunStop | None:
        """The machine's decision after the loop: None to take the step, else a stop (announced by the
        training loop, see RerunStop.announce)."""
        machine = self.machine
        checkpoint, should_exit, code = machine.should_checkpoint_and_exit()
        if machine.mode == RerunMode.REPORT_DETERMINISM_STATS:
            self._report_stats()
            return None
        if self.passes == [RerunState.INITIAL_RUN]:
            return None  # nothing was rejected (every rank agrees: the machine reduced it)
        findings = [f"rank {rank}: {finding}"
                    for rank, finding in enumerate(parallel.all_gather_object(self._finding)) if finding]
        verdict, how = self._outcome(machine.state, should_exit, code)
        reason = f"iteration {self.iteration}: {'; '.join(findings) or 'a result was rejected'}; {how}"
        if not should_exit:
            events.decision("rerun", f"{reason}; continuing", iteration=self.iteration, verdict=verdict,
                            findings=findings)
            return None
        return RerunStop(reason, code, requeue=code == EXIT_CODE_RESUME_TO_DISAMBIGUATE,
                         checkpoint=checkpoint, verdict=verdict, iteration=self.iteration,
                         findings=tuple(findings))

    def _outcome(self, state: RerunState, should_exit: bool, code: int) -> tuple[str, str]:
        """(verdict, what it means) from the machine's state after the loop."""
        if not should_exit:
            where = "after resuming from the checkpoint" \
                if RerunState.RERUNNING_FROM_CHECKPOINT in self.passes else "in place"
            return "continued", f"rerun {where}: the check is not fatal"
        if state == RerunState.RERUNNING_IN_PLACE:
            return "transient", "not reproduced by a rerun in place on the same device (a transient " \
                                "fault) and the check is fatal"
        if state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            return "reproduced", "reproduced by a rerun in place on the same device; a rerun on another " \
                                 "node or device tells a faulty device from a correct result: resume from " \
                                 "the checkpoint there"
        if state == RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT:
            machine = self.machine
            suspects = parallel.all_gather_object((machine.suspicious_node, machine.suspicious_device))
            node, device = next((s for s in suspects if s[0] is not None), ("?", "?"))
            return "same-device", f"resumed on the node and device that produced it ({node}, device " \
                                  f"{device}): resume from the same checkpoint on another node or device"
        return "failed-elsewhere", "rerun after resuming from the checkpoint on another node or device: " \
                                   f"failed validation (exit code {code}; the rerun state machine's lines " \
                                   "above say which)"

    def _report_stats(self) -> None:
        """report_determinism_stats: how much each validated result varied between the two passes."""
        if self.iteration % _config.stats_interval:
            return
        gathered = parallel.all_gather_object(dict(self.machine.stats))
        for stats in self.machine.stats.values():
            stats.reset()
        by_message: dict[str, list[QuickStats]] = defaultdict(list)
        for rank_stats in gathered:
            for caller, stats in rank_stats.items():
                by_message[caller.message].append(stats)
        for message, parts in sorted(by_message.items()):
            total = QuickStats()
            total.combine(parts)
            events.print_rank_0(f" determinism to iteration {self.iteration}: '{message}': "
                                f"{total.print_stats()}")


def _as_float(value) -> float:
    if value is None:
        return math.nan
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def final_save(checkpoints, stop) -> Callable[[TrainProgress], bool]:
    """The end-of-run save: the usual one, unless the machine ended the run: then the checkpoint it asks
    for, rewritten if that iteration is on disk already (that copy lacks the machine's state), or none."""
    if not isinstance(stop, RerunStop):
        return checkpoints.save
    if not stop.checkpoint:
        return lambda progress: False

    def save(progress: TrainProgress) -> bool:
        checkpoints.last_saved_iteration = None
        return checkpoints.save(progress)

    return save
