"""The handful of checkpoint calls the training loop makes: load at start, save when due.

Owns the checkpoint flags' meaning (intervals, what to save and load, retention) and delegates the
where and how to tiers and the choosing to the loader.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

from megatron.core import dist_checkpointing, parallel_state

from megatron_resil import events, exit_codes, parallel
from megatron_resil.checkpointing import layout, loader, state
from megatron_resil.checkpointing.dcp_writer import prepare_for_saving
from megatron_resil.checkpointing.retention import apply_retention
from megatron_resil.checkpointing.tier import TierCandidate
from megatron_resil.checkpointing.torch_dist_tier import TorchDistTier
from megatron_resil.checkpointing.tracker import tracker_path
from megatron_resil.progress import TrainProgress


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None
    load: str | None
    save_interval: int | None
    save_retain_interval: int | None
    keep_last: int | None
    save_optim: bool
    save_rng: bool
    load_optim: bool
    load_rng: bool
    finetune: bool
    exit_on_missing_checkpoint: bool
    verify_checksums: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CheckpointConfig:
        return cls(save=args.save, load=args.load, save_interval=args.save_interval,
                   save_retain_interval=args.save_retain_interval, keep_last=args.ckpt_keep_last,
                   save_optim=not args.no_save_optim, save_rng=not args.no_save_rng,
                   load_optim=not args.no_load_optim and not args.finetune,
                   load_rng=not args.no_load_rng and not args.finetune, finetune=args.finetune,
                   exit_on_missing_checkpoint=args.exit_on_missing_checkpoint,
                   verify_checksums=not args.ckpt_skip_checksums)


class CheckpointManager:
    def __init__(self, config: CheckpointConfig, model, optimizer, scheduler,
                 args: argparse.Namespace) -> None:
        self.config = config
        self.model, self.optimizer, self.scheduler, self.args = model, optimizer, scheduler, args
        self.save_tier = TorchDistTier(config.save) if config.save else None
        self.last_saved_iteration: int | None = None
        self._load_optim, self._load_rng = config.load_optim, config.load_rng
        if self.save_tier is not None:
            self.save_tier.startup_cleanup()

    # ---- load ----------------------------------------------------------------------------------
    def load(self) -> TrainProgress:
        progress = self._load()
        if self.save_tier is not None:
            prepare_for_saving()  # training will start: get the writer's helper process going now
        return progress

    def _load(self) -> TrainProgress:
        if self.config.load is None:
            return TrainProgress()
        tiers = [TorchDistTier(self.config.load, verify_checksums=self.config.verify_checksums)]
        try:
            result = loader.load_first_verified(tiers, self._template_for)
        except loader.CheckpointLoadError as err:
            self._exit_no_checkpoint(str(err))
        if result is None:
            if self.config.exit_on_missing_checkpoint:
                self._exit_no_checkpoint(f"no loadable checkpoint under --load {self.config.load} and "
                                         "--exit-on-missing-checkpoint is set")
            if _holds_checkpoints(self.config.load):
                # Starting from scratch here would later overwrite the tracker and iter_ names.
                self._exit_no_checkpoint(
                    f"--load {self.config.load} holds checkpoints (or quarantined ones) but none could be "
                    "loaded (reasons above); refusing to start from scratch over them: fix or move them, "
                    "or point --load at another directory")
            events.decision("load", f"no checkpoint under --load {self.config.load}; "
                            "starting from random initialisation at iteration 0")
            return TrainProgress()
        progress = state.restore(result.state, self.model, self.optimizer, self.scheduler,
                                 load_optimizer=self._load_optim, load_rng=self._load_rng,
                                 finetune=self.config.finetune)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        events.print_rank_0(
            f"  successfully loaded checkpoint from {self.config.load} [ t 1/{tp}, p 1/1 ] "
            f"at iteration {progress.iteration} ({result.candidate.tier} tier, {result.candidate.path})")
        if progress.iteration and _same_dir(self.config.load, self.config.save):
            self.last_saved_iteration = progress.iteration  # already on disk; don't re-save it
        return progress

    @staticmethod
    def _exit_no_checkpoint(reason: str) -> NoReturn:
        events.decision("exit", f"{reason}; exiting with code {exit_codes.NO_CHECKPOINT}")
        parallel.shutdown()
        sys.exit(exit_codes.NO_CHECKPOINT)

    def _template_for(self, candidate: TierCandidate) -> dict:
        saved_args = dist_checkpointing.load_common_state_dict(candidate.path).get("args", {})
        self._load_optim = self.config.load_optim and not saved_args.get("no_save_optim", False)
        self._load_rng = self.config.load_rng and not saved_args.get("no_save_rng", False)
        if self.config.load_optim and not self._load_optim:
            events.warn(f"{candidate.path} holds no optimizer state (--no-save-optim); starting it fresh")
        saved_world = saved_args.get("world_size")
        if self._load_rng and saved_world not in (None, self.args.world_size):
            events.warn(f"{candidate.path} was saved by {saved_world} ranks, this run has "
                        f"{self.args.world_size}: RNG states are not restored")
            self._load_rng = False
        return state.build_sharded_state(
            self.model, self.optimizer, self.scheduler, TrainProgress(), self.args,
            with_optimizer=self._load_optim, with_rng=self._load_rng)

    # ---- save ----------------------------------------------------------------------------------
    def save_due(self, iteration: int) -> bool:
        interval = self.config.save_interval
        return self.save_tier is not None and bool(interval) and iteration % interval == 0

    def save(self, progress: TrainProgress) -> None:
        if self.save_tier is None or self.last_saved_iteration == progress.iteration:
            return
        sharded = state.build_sharded_state(
            self.model, self.optimizer, self.scheduler, progress, self.args,
            with_optimizer=self.config.save_optim, with_rng=self.config.save_rng)
        path = self.save_tier.save(sharded, progress.iteration)
        self.last_saved_iteration = progress.iteration
        tp = parallel_state.get_tensor_model_parallel_world_size()
        events.print_rank_0(f"  successfully saved checkpoint from iteration {progress.iteration:7d} "
                            f"to {os.path.dirname(path)} [ t 1/{tp}, p 1/1 ]")
        if parallel.is_rank0():
            apply_retention(self.config.save, self.config.keep_last, self.config.save_retain_interval)


def _holds_checkpoints(root: str) -> bool:
    return bool(layout.published_iterations(root) or layout.quarantined(root)
                or os.path.exists(tracker_path(root)))


def _same_dir(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)
