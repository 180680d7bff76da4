"""The training loop: one screen. Setup builds the parts; `train` steps, logs, evaluates, saves,
and asks each stop condition after every iteration (the hook point for per-iteration checks)."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_resil import cpu_compat, events, exit_codes, parallel, rerun
from megatron_resil.checkpointing.global_tier import CheckpointSaveError
from megatron_resil.checkpointing.manager import CheckpointConfig, CheckpointManager
from megatron_resil.data import build_datasets, get_microbatch
from megatron_resil.fault_injection import FaultInjector
from megatron_resil.fault_tolerance import FaultTolerance, report_restart
from megatron_resil.model import build_model
from megatron_resil.optimizer import Optimizer, build_scheduler
from megatron_resil.progress import TrainProgress
from megatron_resil.rerun_escape import RerunEscape
from megatron_resil.stop_conditions import StopConditions
from megatron_resil.straggler import StragglerDetection
from megatron_resil.tokenizer import build_tokenizer
from megatron_resil.train_log import TrainLogger


def pretrain(args: argparse.Namespace) -> int:
    ft = FaultTolerance.from_args(args)  # first: a hang anywhere in set-up is caught from here on
    try:
        code = _pretrain(args, ft)
    except SystemExit as stop:  # decided in set-up: nothing loadable under --load (exit 3)
        ft.job_ending(stop.code if isinstance(stop.code, int) else 1)
        raise
    ft.job_ending(code)  # under ft_launcher, a code that must not be retried ends the in-job restarts too
    return code


def _pretrain(args: argparse.Namespace, ft: FaultTolerance) -> int:
    cpu_compat.apply_if_needed()
    parallel.initialize(args)
    events.configure(args.save)
    events.record("start", world_size=args.world_size, train_iters=args.train_iters, load=args.load)
    report_restart()
    ft.log_setup()
    tokenizer = build_tokenizer(args)
    model = build_model(args, tokenizer.vocab_size)
    optimizer = Optimizer(model, args)
    scheduler = build_scheduler(optimizer, args)
    faults = FaultInjector(args)
    rerun.initialize(rerun.RerunConfig.from_args(args))  # before the load: a checkpoint may hold its state
    checkpoints = CheckpointManager(CheckpointConfig.from_args(args), model, optimizer, scheduler, args,
                                    on_staged=faults.on_staged)
    progress = checkpoints.load()
    train_ds, valid_ds = build_datasets(args, tokenizer)
    ft.setup_done(resumed=progress.iteration > 0)
    try:
        code = train(args, model, optimizer, scheduler, checkpoints, progress, train_ds, valid_ds, faults, ft)
    except CheckpointSaveError as err:
        events.decision("exit", f"{err}; the previous checkpoint and tracker are intact; "
                        f"exiting with code {exit_codes.SAVE_FAILED}", exit_code=exit_codes.SAVE_FAILED)
        code = exit_codes.SAVE_FAILED
    parallel.shutdown()
    return code


def train(args, model, optimizer, scheduler, checkpoints, progress: TrainProgress,
          train_ds, valid_ds, faults: FaultInjector, ft: FaultTolerance) -> int:
    logger, stops, stop = TrainLogger(args), StopConditions(args), None
    escape = RerunEscape.from_args(args)  # bounds the rerun state machine's same-device retries
    stragglers = StragglerDetection.from_args(args, optimizer)  # times each rank up to optimizer.step()
    events.print_rank_0(f"training from iteration {progress.iteration} to {args.train_iters}")
    while progress.iteration < args.train_iters:
        with ft.step():  # an injected hang or slowness counts as part of the iteration
            stragglers.iteration_started()  # this rank's own work starts here, injected slowness included
            faults.before_iteration(progress.iteration + 1)
            loss, grad_norm, stop = train_step(args, model, optimizer, scheduler, train_ds, progress, faults,
                                               nan_checks=not checkpoints.canary_watching)
        if stop is not None:  # the rerun state machine would end the job; this step was not taken
            progress, stop = escape.judge(stop, progress, checkpoints)  # or fall back to an older checkpoint
            if stop is not None:
                break
            continue
        progress.iteration += 1
        progress.consumed_train_samples += args.global_batch_size
        logger.training_step(progress.iteration, progress.consumed_train_samples,
                             optimizer.param_groups[0]["lr"], loss, grad_norm)
        if (reloaded := checkpoints.check_canary(progress, loss, grad_norm)) is not None:
            progress = reloaded  # the non-persistent checkpoint was bad: back to a persistent one
            continue
        escape.step_taken(progress.iteration)  # after the canary: a step it rejects passed nothing
        if valid_ds is not None and args.eval_iters and progress.iteration % args.eval_interval == 0:
            logger.validation(progress.iteration, evaluate(args, model, valid_ds, progress))
            logger.restart_interval()
        if ft.checkpointing(checkpoints.maybe_save, progress):
            logger.restart_interval()
        stop = stragglers.report(progress.iteration) or stops.check(progress.iteration)
        if stop is not None:
            events.decision("exit", f"{stop.reason}; saving and exiting with code {stop.exit_code}",
                            iteration=progress.iteration, exit_code=stop.exit_code, requeue=stop.requeue)
            break
    ft.checkpointing(rerun.final_save(checkpoints, stop), progress, final=True)
    stragglers.close()
    ft.close()
    logger.close()
    if stop is None:
        events.record("finished", iteration=progress.iteration, exit_code=exit_codes.FINISHED)
        return exit_codes.FINISHED
    return stop.exit_code


def _batch_loss(args, model, dataset, consumed: int, microbatch: int) -> torch.Tensor:
    batch = get_microbatch(dataset, consumed, microbatch, args.micro_batch_size,
                           parallel_state.get_data_parallel_rank(),
                           parallel_state.get_data_parallel_world_size())
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device) for k, v in batch.items()}
    token_losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].float()
    return (token_losses.float() * mask).sum() / mask.sum().clamp(min=1.0)


def _mean_over_data_parallel(value: torch.Tensor) -> float:
    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
        value = value / dist.get_world_size(group)
    return float(value)


def train_step(args, model, optimizer, scheduler, dataset, progress: TrainProgress,
               faults: FaultInjector | None = None,
               nan_checks: bool = True) -> tuple[float, float, rerun.RerunStop | None]:
    """(loss, grad norm, None), or (nan, nan, stop) when the rerun state machine ends the job before the
    optimizer step."""
    model.train()
    step = rerun.StepValidation(progress.iteration + 1, nan_checks=nan_checks)
    while step.runs():  # a second pass replays the step: same batches (consumed samples), same RNG
        optimizer.zero_grad()
        total = torch.zeros((), dtype=torch.float32)
        for microbatch in range(args.num_microbatches):
            loss = _batch_loss(args, model, dataset, progress.consumed_train_samples, microbatch)
            if faults is not None:
                loss = faults.poison_loss(loss, progress.iteration + 1)
            step.check_loss(loss)
            (loss / args.num_microbatches).backward()
            total += loss.detach().cpu()
        step.check_grads(optimizer.model_params)
        optimizer.own_work_done()  # before the rerun machine's agreement (the step's first collective)
    if (stop := step.verdict()) is not None:
        return float("nan"), float("nan"), stop
    grad_norm = optimizer.step()
    scheduler.step(increment=args.global_batch_size)
    return _mean_over_data_parallel(total / args.num_microbatches), grad_norm, None


@torch.no_grad()
def evaluate(args, model, dataset, progress: TrainProgress) -> float:
    model.eval()
    total = torch.zeros((), dtype=torch.float32)
    for _ in range(args.eval_iters):
        for microbatch in range(args.num_microbatches):
            total += _batch_loss(args, model, dataset, progress.consumed_valid_samples, microbatch).cpu()
        progress.consumed_valid_samples += args.global_batch_size
    model.train()
    return _mean_over_data_parallel(total / (args.eval_iters * args.num_microbatches))
