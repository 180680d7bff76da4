"""The training loop: one screen. Setup builds the parts; `train` steps, logs, evaluates and saves as
Megatron-LM's train() does, and `_Stops` decides every reason to stop (the hook point for per-iteration
checks).
A step is megatron-core's: its pipeline schedule runs forward and backward over the microbatches,
its DDP reduces the gradients, its optimizer updates."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import logging
import os
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_batch_on_this_cp_rank, get_model_config

from megatron_resil import (
    batch_schedule,
    checkpointing,
    events,
    exit_codes,
    gpu_features,
    moe_metrics,
    parallel,
    patches,
    phase_marks,
)
from megatron_resil.checkpointing import CheckpointConfig, CheckpointManager, CheckpointSaveError
from megatron_resil.data import datasets_for_attempt, get_microbatch
from megatron_resil.model import build_model_chunks, padded_vocab_size
from megatron_resil.optimizer import (
    build_optimizer,
    build_scheduler,
    learning_rate,
    params_in_sync,
    wrap_in_ddp,
)
from megatron_resil.progress import TrainProgress
from megatron_resil.resilience import (
    launcher_watch,
    replica_recovery,
    rerun,
    restart_phases,
    signal_handler,
    weight_hashes,
)
from megatron_resil.resilience.fault_injection import FaultInjector
from megatron_resil.resilience.fault_tolerance import FaultTolerance, report_restart
from megatron_resil.resilience.rerun_escape import RerunEscape
from megatron_resil.resilience.stop_conditions import Stop, StopConditions
from megatron_resil.resilience.straggler import StragglerDetection
from megatron_resil.tokenizer import build_tokenizer
from megatron_resil.train_log import (
    TrainLogger,
    floating_point_operations,
    params_l2_norm,
    timers_for,
)

# megatron-core 0.19 asks whether context parallelism is "hybrid" (we run the plain kind); 0.16 does not.
_CP_ARGS = ({"is_hybrid_cp": False}
            if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters else {})


def pretrain(args: argparse.Namespace) -> int:
    restart_phases.attempt_started()  # the imports are done: each step to the first iteration is timed
    launcher_watch.watch()  # an orphaned rank must not train on next to the restarted job
    signal_handler.install_from_args(args)  # first: a preemption during set-up or the load counts too
    ft = FaultTolerance.from_args(args)  # first: a hang anywhere in set-up is caught from here on
    try:
        code = _pretrain(args, ft)
    except SystemExit as stop:  # decided in set-up: nothing loadable under --load (exit 3)
        ft.job_ending(stop.code if isinstance(stop.code, int) else 1)
        raise
    except BaseException:
        # a peer that saw the launcher die first broke a collective, or a finished save was withheld
        launcher_watch.stop_if_orphaned()
        raise
    launcher_watch.stop_if_orphaned()  # whatever ended the run, an orphan says why and exits 9
    ft.job_ending(code)  # under ft_launcher, a code that must not be retried ends the in-job restarts too
    return code


def _process_settings(args: argparse.Namespace) -> None:
    """What Megatron-LM's flags set for the whole process, before any kernel runs."""
    if args.logging_level is not None:
        logging.getLogger().setLevel(args.logging_level)
    if args.deterministic_mode:
        # Megatron-LM's determinism.apply_determinism_env (a value the user set wins), then torch's switch.
        for name, value in (("NCCL_ALGO", "Ring"), ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0"),
                            ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")):
            os.environ.setdefault(name, value)
        torch.use_deterministic_algorithms(True)


def _pretrain(args: argparse.Namespace, ft: FaultTolerance) -> int:
    _process_settings(args)
    parallel.initialize(args)
    if args.use_checkpoint_args:  # each rank read the checkpoint's arguments itself, before this
        checkpointing.check_ranks_agree(args)
    phase_marks.mark("process_groups")
    checkpointing.lock_run_directories(args)  # before anything is written: another job may own the directory
    events.configure(args.save)
    events.record("start", world_size=args.world_size, train_iters=args.train_iters, load=args.load,
                  run_id=os.environ.get("TORCHELASTIC_RUN_ID"))
    for decision in patches.decisions():  # said at start-up, before the event log had a place
        events.record("patch", **decision)
    checkpointing.record_takeovers()
    if (code := _earlier_attempt_said_stop(args)) is not None:
        return code
    report_restart()
    ft.log_setup()
    tokenizer = build_tokenizer(args)
    model, optimizer, scheduler = build_engine(args, tokenizer.vocab_size)
    phase_marks.mark("engine")
    faults = FaultInjector(args, model)
    keeper = replica_recovery.Keeper(args, model, optimizer, scheduler)  # the state a replica can give
    rerun.initialize(rerun.RerunConfig.from_args(args))  # before the load: a checkpoint may hold its state
    checkpoints = CheckpointManager(CheckpointConfig.from_args(args), model, optimizer, scheduler, args,
                                    on_staged=faults.on_staged,
                                    params_in_sync=partial(params_in_sync, model, args),
                                    may_publish=launcher_watch.launcher_alive,  # an orphan publishes nothing
                                    on_loaded=keeper.committed)
    faults.before_writing_state = checkpoints.before_state_changes
    with signal_handler.loading():  # a signal now ends the process: a load can block past any grace
        progress = _recovered_or_loaded(args, (model, optimizer, scheduler), checkpoints, keeper)
    phase_marks.mark("loaded")
    (train_ds, valid_ds), kept = datasets_for_attempt(args, tokenizer)
    restart_phases.attempt_detail("datasets_kept", kept)
    phase_marks.mark("data")
    ft.setup_done(resumed=progress.iteration > 0)
    try:
        code = train(args, model, optimizer, scheduler, checkpoints, progress, train_ds, valid_ds, faults, ft,
                     keeper)
    except CheckpointSaveError as err:
        events.decision("exit", f"{err}; the previous checkpoint and tracker are intact; "
                        f"exiting with code {exit_codes.SAVE_FAILED}", exit_code=exit_codes.SAVE_FAILED)
        code = exit_codes.SAVE_FAILED
    parallel.shutdown()
    return code


def _recovered_or_loaded(args, engine: tuple, checkpoints: CheckpointManager,
                         keeper: replica_recovery.Keeper) -> TrainProgress:
    """After an in-process restart with --recover-from-replicas, the state the ranks kept (or received from
    a replica); otherwise, or where no replica holds it, the newest checkpoint."""
    progress = replica_recovery.recover(args, *engine)
    if progress is None:
        return checkpoints.load()
    keeper.committed(progress)
    return progress


def _earlier_attempt_said_stop(args: argparse.Namespace) -> int | None:
    """Under ft_launcher, ranks that exit with a do-not-retry code (8, 3, 17) ask it to close the
    rendezvous, but NVRx 0.4.1 sometimes joins the next round anyway. An attempt of the same launcher run
    (same torchrun run id) whose predecessor ended that way stops at once with the same code."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    found = None
    if run_id and parallel.is_rank0():
        found = events.last_exit_of_run(run_id)
    found = parallel.broadcast_object(found)
    if found is None or found.get("exit_code") not in exit_codes.DO_NOT_RETRY:
        return None
    code = found["exit_code"]
    # The first attempt's reason, not the line of the attempt before (which names it in turn): one
    # attempt after another would nest them.
    cause = found.get("cause") or found.get("message", "no message")
    events.decision("exit", f"an earlier attempt of this launcher run ended with exit code {code} "
                    f"({cause}); a restart cannot change that, so this one stops before training; exiting "
                    f"with code {code}", exit_code=code, cause=cause)
    return code


def build_engine(args: argparse.Namespace, vocab_size: int):
    """megatron-core's engine for this rank: (model chunks in DDP, optimizer, LR scheduler), timed by
    megatron-core's timers at --timing-log-level 1 and 2."""
    args.padded_vocab_size = padded_vocab_size(vocab_size, args)  # Megatron-LM's attribute (FLOPs, logs)
    model = wrap_in_ddp(build_model_chunks(args, vocab_size), args)
    timers = timers_for(args)
    get_model_config(model[0]).timers = timers
    optimizer = build_optimizer(model, args, timers)
    parallel.track_for_release(model)  # a failed attempt's engine is let go between attempts
    return model, optimizer, build_scheduler(optimizer, args)


def train(args, model, optimizer, scheduler, checkpoints, progress: TrainProgress,
          train_ds, valid_ds, faults: FaultInjector, ft: FaultTolerance,
          keeper: replica_recovery.Keeper) -> int:
    """Megatron-LM's train(): a step, its log line, then evaluation and a save at their intervals, until
    --train-iters or a stop (every reason to stop is decided in `_Stops`); the final save; the exit code."""
    logger, stops = TrainLogger(args, get_model_config(model[0]).timers), _Stops(args, model, keeper)
    events.print_rank_0(f"training from iteration {progress.iteration} to {args.train_iters}")
    if (stop := stops.signalled_before_training(progress.iteration)) is not None:
        ft.close()
        logger.close()
        return stop.exit_code
    if args.manual_gc:  # Megatron-LM: no automatic collections; collect at known points instead
        gc.disable()
        gc.collect()
    stop = stops.replicas_differ(progress.iteration, before_training=True)
    graphs, first_iteration = gpu_features.GraphCapture(args, model, optimizer), progress.iteration
    batch_size = batch_schedule.global_batch_size(args, progress.consumed_train_samples)
    while stop is None and progress.iteration < args.train_iters:
        batch_size = _batch_size_change(args, batch_size, progress, checkpoints, ft)
        graphs.before_iteration(progress.iteration - first_iteration)
        with ft.step(), signal_handler.stepping():  # an injected hang or slowness counts as the iteration's
            stops.iteration_started()
            faults.before_iteration(progress.iteration + 1)
            report, stop = train_step(args, model, optimizer, scheduler, train_ds, progress, faults,
                                      nan_checks=not checkpoints.canary_watching,
                                      before_optimizer_step=checkpoints.before_state_changes,
                                      after_optimizer_step=keeper.step_hook, on_raised=keeper.suspect)
        if stop is not None:  # the rerun state machine would end the job; this step was not taken
            progress, stop = stops.rejected_step(stop, progress, checkpoints)
            continue
        _count_step(args, progress, report)
        logger.training_step(progress.iteration, progress.consumed_train_samples, learning_rate(optimizer),
                             report)
        if (reloaded := checkpoints.check_canary(progress, report.loss, report.grad_norm)) is not None:
            progress = reloaded  # the non-persistent checkpoint was bad: back to a persistent one
            continue
        stops.step_taken(progress.iteration)  # after the canary: a step it rejects passed nothing
        if (stop := _housekeeping(args, stops, progress.iteration)) is not None:
            break  # the replicas' weights differ: the run ends before any save (weight_hashes.py)
        _evaluate_and_save(args, model, valid_ds, progress, checkpoints, logger, ft)
        stop = stops.after_save(progress.iteration)
    with signal_handler.waiting():
        ft.checkpointing(rerun.final_save(checkpoints, stop), progress, final=True)
    return _end_of_training(args, progress, stop, (graphs, stops, ft, logger))


class _Stops:
    """Every reason the loop stops, decided here and each said once: a signal before the first step,
    data-parallel replicas whose weights differ (before training and at their interval), the rerun state
    machine's verdict on a step (unless its escape hatch falls back to an older checkpoint), a straggler,
    and the stop conditions (a signal, --exit-interval, --exit-duration-in-mins, ...)."""

    def __init__(self, args: argparse.Namespace, model: list, keeper: replica_recovery.Keeper) -> None:
        self.args, self.model, self.keeper = args, model, keeper
        self.conditions = StopConditions(args)
        self.escape = RerunEscape.from_args(args)  # bounds the rerun state machine's same-device retries
        self.stragglers = StragglerDetection.from_args(args, model)  # times each rank's forward and backward

    def signalled_before_training(self, iteration: int) -> Stop | None:
        stop = self.conditions.signalled(iteration)
        if stop is not None:
            # Nothing was trained: the checkpoint just loaded (or none) stays the latest. A save here would
            # only write an untrained model whose optimizer has no state yet, which no later run can load.
            events.decision("exit", f"{stop.reason}; nothing trained since the load, so nothing to save; "
                            f"exiting with code {stop.exit_code}",
                            iteration=iteration, exit_code=stop.exit_code, requeue=stop.requeue)
        return stop

    def replicas_differ(self, iteration: int, before_training: bool = False) -> rerun.RerunStop | None:
        """At --check-weight-hash-across-dp-replicas-interval, and before training too as Megatron-LM:
        replicas apart are a stop, nothing saved (weight_hashes.py)."""
        interval = self.args.check_weight_hash_across_dp_replicas_interval
        if interval is None or not (before_training or iteration % interval == 0):
            return None
        with params_in_sync(self.model, self.args):
            stop = weight_hashes.check(self.model, iteration)
        if stop is not None:
            self.keeper.suspect(f"the replicas' weights differed at iteration {iteration}")
        return stop

    def iteration_started(self) -> None:
        self.stragglers.iteration_started()  # this rank's own work starts here, injected slowness included

    def rejected_step(self, stop: rerun.RerunStop, progress: TrainProgress,
                      checkpoints: CheckpointManager) -> tuple[TrainProgress, rerun.RerunStop | None]:
        """The rerun state machine would end the job: it does, or the escape hatch goes on from an older
        checkpoint (None, and the progress loaded)."""
        self.keeper.suspect(f"the rerun state machine rejected iteration {progress.iteration + 1}")
        return self.escape.judge(stop, progress, checkpoints)

    def step_taken(self, iteration: int) -> None:
        self.escape.step_taken(iteration)

    def after_save(self, iteration: int) -> Stop | None:
        stop = self.stragglers.report(iteration) or self.conditions.check(iteration)
        if stop is not None:
            events.decision("exit", f"{stop.reason}; saving and exiting with code {stop.exit_code}",
                            iteration=iteration, exit_code=stop.exit_code, requeue=stop.requeue)
        return stop

    def close(self) -> None:
        self.stragglers.close()


def _count_step(args: argparse.Namespace, progress: TrainProgress, report: StepReport) -> None:
    """A taken step: the iteration, the samples it consumed and its floating-point operations."""
    _advance(args, progress, report.global_batch_size)
    restart_phases.iteration_taken()


def _advance(args: argparse.Namespace, progress: TrainProgress, batch_size: int) -> None:
    progress.iteration += 1
    progress.consumed_train_samples += batch_size
    progress.floating_point_operations_so_far += floating_point_operations(args, batch_size)


def _evaluate_and_save(args, model, valid_ds, progress: TrainProgress, checkpoints: CheckpointManager,
                       logger: TrainLogger, ft: FaultTolerance) -> None:
    """At --eval-interval, Megatron-LM's evaluation; then the save, if one is due (maybe_save)."""
    if valid_ds is not None and args.eval_iters and progress.iteration % args.eval_interval == 0:
        with _collected_around(args.manual_gc and args.manual_gc_eval), signal_handler.waiting("evaluation"):
            logger.validation(progress.iteration, evaluate(args, model, valid_ds, progress),
                              progress.consumed_train_samples)
        logger.restart_interval()
    with signal_handler.waiting() as save:  # judged by the slowest save, not by the slowest step
        save.happened = ft.checkpointing(checkpoints.maybe_save, progress)
        if save.happened:
            logger.restart_interval()


def _end_of_training(args: argparse.Namespace, progress: TrainProgress, stop: Stop | rerun.RerunStop | None,
                     closing: tuple) -> int:
    """After the final save: the parts of the loop closed in order, and the exit code."""
    if args.manual_gc:
        gc.enable()  # an in-process restart runs the next attempt in this process
    for part in closing:  # CUDA graphs, straggler detection, FT sections, the log
        part.close()
    if stop is None:
        events.record("finished", iteration=progress.iteration, exit_code=exit_codes.FINISHED)
        return exit_codes.FINISHED
    return stop.exit_code


def _batch_size_change(args, before: int, progress: TrainProgress, checkpoints: CheckpointManager,
                       ft: FaultTolerance) -> int:
    """The global batch size of the next step (--step-batch-size-schedule). Where it changes, Megatron-LM
    saves a checkpoint first (with --save): the last one with the old number of microbatches."""
    batch_size = batch_schedule.global_batch_size(args, progress.consumed_train_samples)
    if batch_size != before:
        events.print_rank_0(f"global batch size {before} -> {batch_size} at {progress.consumed_train_samples}"
                            " consumed samples (--step-batch-size-schedule): "
                            f"{batch_schedule.num_microbatches(args, batch_size)} microbatches per step")
    if batch_size > before:  # not after a fall back to an earlier, smaller step of the schedule
        with signal_handler.waiting():
            ft.checkpointing(partial(checkpoints.save, final=False), progress, final=True)
    return batch_size


def _housekeeping(args, stops: _Stops, iteration: int) -> rerun.RerunStop | None:
    """After a taken step: Megatron-LM's periodic garbage collection, weight-hash comparison of the
    data-parallel replicas, CUDA cache release and profiler window. A stop when the replicas differ."""
    if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
        gc.collect()
    stop = stops.replicas_differ(iteration)
    if args.empty_unused_memory_level >= 1:
        torch.cuda.empty_cache()
    if args.profile and (not args.profile_ranks or torch.distributed.get_rank() in args.profile_ranks):
        if iteration == args.profile_step_start:
            torch.cuda.cudart().cudaProfilerStart()
        elif iteration == args.profile_step_end:
            torch.cuda.cudart().cudaProfilerStop()
    return stop


class _collected_around:
    """Collect garbage before and after the block (--manual-gc around evaluation)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self) -> None:
        if self.enabled:
            gc.collect()

    def __exit__(self, *exc) -> None:
        if self.enabled:
            gc.collect()


class StepReport:
    """What a taken step reports, the same on every rank: the loss (summed over the global batch's tokens,
    divided by their number, as Megatron-LM reports it), the grad norm, the MoE and multi-token prediction
    auxiliary losses, whether the optimizer updated (fp16 loss scaling skips a step whose gradients
    overflowed), and with Megatron-LM's logging flags the zeros in the gradients and the weights' norm."""

    def __init__(self, loss: float, grad_norm: float, updated: bool = True, loss_scale: float = 1.0,
                 moe_losses: dict[str, float] | None = None, num_zeros: float | None = None,
                 params_norm: float | None = None, global_batch_size: int = 0) -> None:
        self.loss, self.grad_norm, self.updated, self.loss_scale = loss, grad_norm, updated, loss_scale
        self.global_batch_size = global_batch_size  # the samples the step consumed
        self.moe_losses = moe_losses or {}
        self.num_zeros, self.params_norm = num_zeros, params_norm


def _microbatches(args, count: int) -> list:
    """One iterator of microbatch numbers per model chunk: a batch is fetched by number (a pure function
    of consumed samples), so a replayed step or a resumed job reads the same data."""
    return [iter(range(count)) for _ in range(args.virtual_pipeline_model_parallel_size or 1)]


def _forward_step(args, dataset, consumed: int, on_loss, microbatches, chunk):
    """megatron-core's forward_step_func: run one microbatch through `chunk`; on the last pipeline stage
    also return the loss function the schedule applies to its output."""
    batch = get_microbatch(dataset, consumed, next(microbatches), args.micro_batch_size,
                           parallel_state.get_data_parallel_rank(),
                           parallel_state.get_data_parallel_world_size())
    # The context-parallel ranks of a data-parallel rank read the same microbatch; each keeps its part of
    # the sequence (megatron-core's load-balanced chunks). The loss needs nothing more, as in Megatron-LM:
    # each rank's sum is divided by its own token count, DDP averages the gradients over data x context
    # parallel ranks, and the reported loss sums losses and tokens over that same group.
    if args.context_parallel_size > 1:
        batch = get_batch_on_this_cp_rank(batch, **_CP_ARGS)
    batch = {key: value.to(parallel.device()) for key, value in batch.items()}
    output = chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss, batch["loss_mask"], on_loss)


def _loss(loss_mask: torch.Tensor, on_loss, token_losses: torch.Tensor):
    """Megatron-LM's loss_func: the sum of the unmasked tokens' losses and their count; the schedule
    divides one by the other (and by the number of microbatches) for the gradient."""
    mask = loss_mask.view(-1).float()
    loss = torch.sum(token_losses.view(-1).float() * mask)
    loss = on_loss(loss)  # validation (rerun.py), and where a drill poisons it
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach().clone(), num_tokens.float()])}


def _reported_loss(reports: list[dict]) -> float:
    """Sum of losses over sum of tokens across microbatches and data-parallel ranks, computed on the last
    pipeline stage and sent to every rank (the log, the canary and the stop decisions need it everywhere)."""
    total = torch.zeros(2, dtype=torch.float32, device=parallel.device())
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for report in reports:
            total += report["lm loss"].float()
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(total, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return float(total[0] / total[1].clamp(min=1.0))


def _run_schedule(args, model, dataset, consumed: int, on_loss, forward_only: bool,
                  batch_size: int) -> list[dict]:
    """megatron-core's pipeline schedule over the global batch of `batch_size` samples at `consumed`."""
    count = batch_schedule.num_microbatches(args, batch_size)
    return get_forward_backward_func()(
        forward_step_func=partial(_forward_step, args, dataset, consumed, on_loss),
        data_iterator=_microbatches(args, count) if len(model) > 1 else _microbatches(args, count)[0],
        model=model, num_microbatches=count, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=forward_only)


def train_step(args, model, optimizer, scheduler, dataset, progress: TrainProgress,
               faults: FaultInjector | None = None, nan_checks: bool = True,
               before_optimizer_step=None,
               after_optimizer_step=None, on_raised=None) -> tuple[StepReport | None, rerun.RerunStop | None]:
    """(report, None), or (None, stop) when the rerun state machine ends the job before the optimizer step.
    `before_optimizer_step`: called just before the parameters change (a pending async save's copy of them
    is completed there, CheckpointManager.before_state_changes); `after_optimizer_step`: with the progress
    as it stands once this step counts, right after the update (replica_recovery's commit: any collective
    after it that fails finds the step taken); `on_raised`: told why when a check raises (--rerun-mode
    disabled), before the exception goes on (replica_recovery's `suspect`)."""
    iteration = progress.iteration + 1
    step = rerun.StepValidation(iteration, nan_checks=nan_checks, on_raised=on_raised)

    def on_loss(loss: torch.Tensor) -> torch.Tensor:
        if faults is not None:
            loss = faults.poison_loss(loss, iteration)
        step.check_loss(loss)
        return loss

    timers = get_model_config(model[0]).timers  # --timing-log-level 1 and 2 only
    batch_size = batch_schedule.global_batch_size(args, progress.consumed_train_samples)
    for chunk in model:
        chunk.train()
    while step.runs():  # a second pass replays the step: same batches (consumed samples), same RNG
        for chunk in model:
            chunk.zero_grad_buffer()
            chunk.ddp_config.check_for_nan_in_grad = step.grad_checks  # DDP's check before the reduction
        optimizer.zero_grad()
        reports = _run_schedule(args, model, dataset, progress.consumed_train_samples, on_loss,
                                forward_only=False, batch_size=batch_size)  # timed: "forward-backward"
    if (stop := step.verdict()) is not None:
        return None, stop
    if before_optimizer_step is not None:
        before_optimizer_step()
    if timers is not None:
        timers("optimizer", log_level=1).start()
    updated, grad_norm, num_zeros = optimizer.step()
    if timers is not None:
        timers("optimizer").stop()
    if updated:
        scheduler.step(increment=batch_size)
    if after_optimizer_step is not None:
        stepped = dataclasses.replace(progress)
        _advance(args, stepped, batch_size)
        after_optimizer_step(stepped)
    moe_losses = moe_metrics.reduce_aux_losses(args, batch_schedule.num_microbatches(args, batch_size))
    params_norm = params_l2_norm(model, args.bf16) if args.log_params_norm else None
    return StepReport(_reported_loss(reports), float("nan") if grad_norm is None else float(grad_norm),
                      updated, float(optimizer.get_loss_scale()), moe_losses,
                      num_zeros if args.log_num_zeros_in_grad else None, params_norm, batch_size), None


@torch.no_grad()
def evaluate(args, model, dataset, progress: TrainProgress) -> float:
    for chunk in model:
        chunk.eval()
    reports = []
    with params_in_sync(model, args):
        for _ in range(args.eval_iters):
            reports += _run_schedule(args, model, dataset, progress.consumed_valid_samples, lambda loss: loss,
                                     forward_only=True, batch_size=args.eval_global_batch_size)
            progress.consumed_valid_samples += args.eval_global_batch_size
    moe_metrics.clear()  # evaluation's router losses are not training's
    for chunk in model:
        chunk.train()
    return _reported_loss(reports)
