"""The handful of checkpoint calls the training loop makes: load at start, save when due.

Owns the checkpoint flags' meaning (intervals, what to save and load, retention) and delegates the
where and how to tiers and the choosing to the loader.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from megatron.core import parallel_state

from megatron_resil import events, exit_codes, parallel
from megatron_resil.checkpointing import layout, loader, state
from megatron_resil.checkpointing.async_save import AsyncSaves
from megatron_resil.checkpointing.canary import LoadCanary
from megatron_resil.checkpointing.global_tier import PARTIAL_LOADS, GlobalTier
from megatron_resil.checkpointing.local_tier import LocalTier
from megatron_resil.checkpointing.resumed_schedule import ScheduleMismatch
from megatron_resil.checkpointing.retention import apply_retention
from megatron_resil.checkpointing.tier import CheckpointSaveError, CheckpointTier, TierCandidate
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
    non_persistent_dir: str | None  # global non-persistent tier, only its newest checkpoint is kept
    non_persistent_interval: int | None
    local_dir: str | None  # node-local tier (NVRx), one iteration kept
    local_algo: str
    replication: tuple[int, int] | None  # (jump, factor)
    canary_iters: int
    async_save: bool
    async_timeout_secs: float
    async_max_failures: int
    async_when_busy: str  # an interval save due while the previous async one is being written: wait or skip
    ckpt_format: str
    assume_constant_structure: bool
    verify_integrity: bool  # Megatron-LM's SHA-256 manifest: written by saves, required by loads
    strictness: str = "assume_ok_unexpected"  # --dist-ckpt-strictness: keys checkpoint and model don't share

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CheckpointConfig:
        return cls(save=args.save, load=args.load, save_interval=args.save_interval,
                   save_retain_interval=args.save_retain_interval, keep_last=args.ckpt_keep_last,
                   save_optim=not args.no_save_optim, save_rng=not args.no_save_rng,
                   load_optim=not args.no_load_optim and not args.finetune,
                   load_rng=not args.no_load_rng and not args.finetune, finetune=args.finetune,
                   exit_on_missing_checkpoint=args.exit_on_missing_checkpoint,
                   verify_checksums=not args.ckpt_skip_checksums,
                   non_persistent_dir=args.non_persistent_global_ckpt_dir
                   if args.non_persistent_ckpt_type == "global" else None,
                   non_persistent_interval=args.non_persistent_save_interval,
                   local_dir=args.non_persistent_local_ckpt_dir
                   if args.non_persistent_ckpt_type == "local" else None,
                   local_algo=args.non_persistent_local_ckpt_algo,
                   replication=(args.replication_jump, args.replication_factor)
                   if args.replication else None,
                   canary_iters=args.non_persistent_canary_iters,
                   async_save=args.async_save, async_timeout_secs=args.async_save_timeout_secs,
                   async_max_failures=args.async_save_max_failures,
                   async_when_busy=args.async_save_when_busy,
                   ckpt_format=args.ckpt_format,
                   assume_constant_structure=args.ckpt_assume_constant_structure,
                   verify_integrity=args.verify_integrity, strictness=args.dist_ckpt_strictness)


class CheckpointManager:
    def __init__(self, config: CheckpointConfig, model: list, optimizer, scheduler,
                 args: argparse.Namespace, on_staged: Callable[[int], None] | None = None,
                 params_in_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 may_publish: Callable[[], bool] | None = None,
                 on_loaded: Callable[[TrainProgress], None] | None = None) -> None:
        """`model`: this rank's model chunks (megatron-core DDP modules). What the layers above hand in:
        `on_staged`, fault injection's hook point inside a save; `params_in_sync`, the optimizer's context
        in which the model holds the parameters the last step produced; `may_publish`, asked before a
        global tier publishes (False: the save is withheld, PublishWithheld, for the trainer to decide);
        `on_loaded`, told where the state stands after every load (replica recovery's commit)."""
        self.on_loaded = on_loaded
        self.config = config
        self.model, self.optimizer, self.scheduler, self.args = model, optimizer, scheduler, args
        self.params_in_sync = params_in_sync
        self.save_tier = GlobalTier(config.save, ckpt_format=config.ckpt_format,
                                    assume_constant_structure=config.assume_constant_structure,
                                    verify_integrity=config.verify_integrity) \
            if config.save else None
        self.non_persistent_tier = _non_persistent_tier(config, parallel_layout(args))
        for tier in (self.save_tier, self.non_persistent_tier):
            if tier is not None:
                tier.content_metadata = state.sharding_metadata(
                    args, for_local_tier=isinstance(tier, LocalTier),
                    ckpt_format=tier.ckpt_format if isinstance(tier, GlobalTier) else "torch_dist")
                tier.max_rank_bytes = state.max_rank_bytes(model)
        self.canary = LoadCanary(config.canary_iters)
        self.async_saves = None
        if config.async_save:
            self.async_saves = AsyncSaves(config.async_timeout_secs, config.async_max_failures,
                                          config.async_when_busy)
            self.async_saves.worker.start()  # its start-up (imports) overlaps the load and first iterations
        self.last_saved_iteration: int | None = None
        self.kept_diagnostic: int | None = None  # after a rerun fallback: never overwrite this iteration
        self._load_optim, self._load_rng = config.load_optim, config.load_rng
        self._rng_shape: tuple[int, ...] | None = None  # the RNG states' layout in the checkpoint loaded
        for tier in (self.save_tier, self.non_persistent_tier):
            if tier is not None:
                tier.on_staged = on_staged  # fault injection's hook point inside a save
                if isinstance(tier, GlobalTier):
                    tier.may_publish = may_publish
                tier.startup_cleanup()

    # ---- load ----------------------------------------------------------------------------------
    def load(self) -> TrainProgress:
        return self._load()

    def _load(self, persistent_only: bool = False) -> TrainProgress:
        self.before_state_changes()  # a load overwrites what a pending async save may still be copying
        if self.config.load is None:
            return TrainProgress()
        tiers: list[CheckpointTier] = [self._persistent_tier()]
        if self.non_persistent_tier is not None and not persistent_only:
            # The node-local tier is tried first at equal iterations (fastest, and the canary
            # watches it); a global non-persistent one only after the persistent one.
            local = isinstance(self.non_persistent_tier, LocalTier)
            tiers.insert(0 if local else 1, self.non_persistent_tier)
        result = self._first_verified(tiers)
        if result is None:
            if self.config.exit_on_missing_checkpoint:
                self._exit_no_checkpoint(f"no loadable checkpoint under --load {self.config.load} and "
                                         "--exit-on-missing-checkpoint is set")
            if any(_holds_checkpoints(tier.root) for tier in tiers):
                # Starting from scratch here would later overwrite the tracker and iter_ names.
                self._exit_no_checkpoint(
                    f"--load {self.config.load} holds checkpoints (or quarantined ones) but none could be "
                    "loaded (reasons above); refusing to start from scratch over them: fix or move them, "
                    "or point --load at another directory")
            events.decision("load", f"no checkpoint under --load {self.config.load}; "
                            "starting from random initialisation at iteration 0", verdict="none", iteration=0)
            return TrainProgress()
        progress = self._restore(result)
        if result.candidate.tier != "persistent" and not self.config.finetune:
            self.canary.arm(self._tier_named(result.candidate.tier, tiers), result.candidate,
                            progress.iteration)
        return progress

    def fall_back(self, older_than: int) -> TrainProgress | None:
        """The rerun escape hatch's load: the newest verified persistent checkpoint of an iteration before
        `older_than` (non-persistent tiers skipped), or None if there is none. Collective."""
        if self.async_saves is not None:
            self.async_saves.wait()  # a save still in flight would publish a newer iteration after it
        if self.config.load is None:
            return None
        # Training passes that iteration again: its save would replace the diagnostic checkpoint, which
        # holds the rerun state machine's findings, with an ordinary one.
        self.kept_diagnostic = older_than
        result = self._first_verified([self._persistent_tier()], older_than=older_than)
        return None if result is None else self._restore(result)

    def _persistent_tier(self) -> GlobalTier:
        tier = GlobalTier(self.config.load, verify_checksums=self.config.verify_checksums,
                          verify_integrity=self.config.verify_integrity, strictness=self.config.strictness)
        tier.content_metadata = state.sharding_metadata(self.args)
        tier.max_rank_bytes = state.max_rank_bytes(self.model)
        tier.read_only = not _same_dir(self.config.load, self.config.save)
        return tier

    def _first_verified(self, tiers: list[CheckpointTier],
                        older_than: int | None = None) -> loader.LoadResult | None:
        try:
            return loader.load_first_verified(tiers, self._template_for, older_than=older_than)
        except loader.CheckpointLoadError as err:
            self._exit_no_checkpoint(str(err))

    def _restore(self, result: loader.LoadResult) -> TrainProgress:
        try:  # every rank reads the same common state, so every rank decides the same, in no collective
            progress = state.restore(result.state, self.model, self.optimizer, self.scheduler,
                                     load_optimizer=self._load_optim, load_rng=self._load_rng,
                                     rng_shape=self._rng_shape,
                                     finetune=self.config.finetune, release=_is_release(result.candidate),
                                     half_precision=self.args.bf16 or self.args.fp16,
                                     partial_model=self.config.strictness in PARTIAL_LOADS)
        except ScheduleMismatch as err:
            self._exit(exit_codes.BAD_ARGUMENTS, f"{result.candidate.path}: {err}")
        events.record("loaded", tier=result.candidate.tier, iteration=progress.iteration,
                      path=result.candidate.path)
        events.print_rank_0(
            f"  successfully loaded checkpoint from {self.config.load} {_ranks_tag()} "
            f"at iteration {progress.iteration} ({result.candidate.tier} tier, {result.candidate.path})")
        if progress.iteration and result.candidate.tier == "persistent" and \
                _same_dir(self.config.load, self.config.save):
            self.last_saved_iteration = progress.iteration  # already on disk; don't re-save it
        if self.on_loaded is not None:
            self.on_loaded(progress)
        return progress

    @staticmethod
    def _tier_named(name: str, tiers: list[CheckpointTier]) -> CheckpointTier:
        return next(tier for tier in tiers if tier.name == name)

    @property
    def canary_watching(self) -> bool:
        """True in the first iterations after a non-persistent load: a NaN there is the canary's to judge
        (quarantine and reload a persistent checkpoint), not the rerun state machine's, which would save
        the bad state and exit 16 (the restart loop of Megatron-LM #5281)."""
        return self.canary.watching

    def check_canary(self, progress: TrainProgress, loss: float, grad_norm: float) -> TrainProgress | None:
        """After a resume from a non-persistent checkpoint: a NaN or Inf in its first iterations
        condemns it (its checksums can match data that was written bad). It is quarantined and
        the newest verified persistent checkpoint is loaded instead; returns the new progress."""
        tripped = self.canary.check(progress.iteration, loss, grad_norm)
        if tripped is None:
            return None
        tier, candidate, why = tripped
        events.decision("canary", f"{candidate.tier} iteration {candidate.iteration} is bad although it "
                        f"verified: {why}; quarantining it and reloading the newest verified persistent "
                        "checkpoint", tier=candidate.tier, iteration=candidate.iteration, reason=why)
        tier.quarantine(candidate, f"canary: {why}")
        if self.config.load is None or not layout.published_iterations(self.config.load):
            self._exit_no_checkpoint(f"no persistent checkpoint under --load {self.config.load} to fall "
                                     "back to after the canary rejected the non-persistent one")
        return self._load(persistent_only=True)

    @classmethod
    def _exit_no_checkpoint(cls, reason: str) -> NoReturn:
        cls._exit(exit_codes.NO_CHECKPOINT, reason)

    @staticmethod
    def _exit(code: int, reason: str) -> NoReturn:
        events.decision("exit", f"{reason}; exiting with code {code}", exit_code=code)
        parallel.shutdown()
        sys.exit(code)

    def _template_for(self, candidate: TierCandidate, saved_args, saved_metadata: dict | None) -> dict:
        """What `candidate` is loaded into: this run's model and optimizer, sharded as the checkpoint was
        (its metadata), with the optimizer and RNG states only where the checkpoint holds usable ones. A
        `release` checkpoint (Megatron-LM's tracker word) gives the weights only, as --finetune does."""
        if _is_release(candidate):
            self._load_optim = self._load_rng = False
            return state.build_sharded_state(
                self.model, self.optimizer, self.scheduler, TrainProgress(), self.args,
                with_optimizer=False, with_rng=False, metadata=saved_metadata, loading=True)
        if self.config.load_optim or self.config.load_rng:
            state.check_format(saved_args)
        saved = vars(saved_args) if isinstance(saved_args, argparse.Namespace) else dict(saved_args)
        self._load_optim = self.config.load_optim and not saved.get("no_save_optim", False)
        self._load_rng = self.config.load_rng and not saved.get("no_save_rng", False)
        if self.config.load_optim and not self._load_optim:
            events.warn(f"{candidate.path} holds no optimizer state (--no-save-optim); starting it fresh")
        self._rng_shape = state.saved_rng_shape(candidate.path) if self._load_rng else None
        if self._load_rng and (why := _rng_layout_change(saved, self.args, self._rng_shape)):
            events.warn(f"{candidate.path} was saved with {why}: RNG states are not restored")
            self._load_rng = False
        return state.build_sharded_state(
            self.model, self.optimizer, self.scheduler, TrainProgress(), self.args,
            with_optimizer=self._load_optim, with_rng=self._load_rng, metadata=saved_metadata, loading=True,
            rng_shape=self._rng_shape)

    # ---- save ----------------------------------------------------------------------------------
    def maybe_save(self, progress: TrainProgress) -> bool:
        """The interval saves: persistent when due, else non-persistent when due. True if it saved
        (or, with --async-save, published a save) this iteration."""
        iteration = progress.iteration
        published = self.async_saves.poll() if self.async_saves is not None else False
        if self.save_tier is not None and _due(iteration, self.config.save_interval):
            if self._skipped_while_busy(self.save_tier, iteration, self.config.save_interval):
                return published
            return self.save(progress, final=False) or published
        if self.non_persistent_tier is not None and _due(iteration, self.config.non_persistent_interval):
            interval = self.config.non_persistent_interval
            if self._skipped_while_busy(self.non_persistent_tier, iteration, interval):
                return published
            try:
                self._save_to(self.non_persistent_tier, progress, use_async=True)
            except CheckpointSaveError as err:
                # The persistent checkpoints still stand; losing one non-persistent save is
                # cheaper than losing the job.
                events.decision("save", f"{err}; the previous checkpoints are intact; training "
                                "continues", tier=self.non_persistent_tier.name, iteration=iteration)
                return published
            return True
        return published

    def before_state_changes(self) -> None:
        """Before the optimizer step (or anything else that writes the model's or the optimizer's state): a
        pending async save's copy of that state is completed first. The trainer's only wait for a save."""
        if self.async_saves is not None:
            self.async_saves.before_state_changes()

    def _skipped_while_busy(self, tier: CheckpointTier, iteration: int, interval: int) -> bool:
        """Collective. An async save of `tier` is due while the previous one is still being written: with
        --async-save-when-busy skip it is skipped (True), with wait the trainer waits for the previous one
        (False: then save). The first time is said in one line with the figures, every time in the event
        log."""
        saves = self.async_saves
        if saves is None or saves.pending is None or not tier.supports_async_save:
            return False  # poll() above agreed on every rank whether the previous save is through
        pending = saves.pending
        writing = max(parallel.all_gather_object(saves.writing_for()))
        began = time.monotonic() - pending.started
        skip = saves.when_busy == "skip"
        figures = {"tier": tier.name, "iteration": iteration, "busy_with": pending.tier.name,
                   "busy_iteration": pending.job.iteration, "writing_seconds": round(writing, 3),
                   "since_started_seconds": round(began, 3), "interval": interval,
                   "action": saves.when_busy}
        if not saves.said_busy:
            saves.said_busy = True
            then = (f"skipping this save (--async-save-when-busy skip); the next is due at iteration "
                    f"{iteration + interval}" if skip else
                    "waiting for it (--async-save-when-busy wait; skip would train on without this save)")
            events.decision(
                "save", f"the {tier.name} save of iteration {iteration} is due while the async save of "
                f"{pending.tier.name} iteration {pending.job.iteration} is still being written (in the "
                f"background for {writing:.1f} s; it began {began:.1f} s ago, and saves are due every "
                f"{interval} iterations): saves are asked for faster than they can be written; {then}. Said "
                "once; each time is in the event log (save_busy)", **figures)
        events.record("save_busy", **figures)
        if not skip:
            saves.wait()
        return skip

    def save(self, progress: TrainProgress, final: bool = True) -> bool:
        """A persistent save (interval, exit or end of training), unless this iteration is on disk.
        A final save waits for a pending async one and is itself synchronous."""
        if final and self.async_saves is not None:
            self.async_saves.close()
        if self.save_tier is None or self.last_saved_iteration == progress.iteration:
            return False
        if progress.iteration == self.kept_diagnostic and _same_dir(self.config.load, self.config.save):
            events.decision("save", f"not saving iteration {progress.iteration}: its diagnostic checkpoint "
                            "(saved for the rerun state machine before the fallback) is kept as it is",
                            tier=self.save_tier.name, iteration=progress.iteration)
            return False
        self._save_to(self.save_tier, progress, use_async=not final)
        return True

    def _save_to(self, tier: CheckpointTier, progress: TrainProgress, use_async: bool = False) -> None:
        started = time.monotonic()
        with self.params_in_sync():  # the parameters this step produced, gathered
            sharded = state.build_sharded_state(
                self.model, self.optimizer, self.scheduler, progress, self.args,
                with_optimizer=self.config.save_optim, with_rng=self.config.save_rng,
                metadata=tier.content_metadata)
        use_async = use_async and self.async_saves is not None and tier.supports_async_save
        events.record("save_started", tier=tier.name, iteration=progress.iteration, asynchronous=use_async)
        if use_async:
            self.async_saves.submit(tier, sharded, progress.iteration, self._published,
                                    prepared_s=time.monotonic() - started)
            return
        path = tier.save(sharded, progress.iteration)
        self._published(tier, progress.iteration, path, time.monotonic() - started)

    def _published(self, tier: CheckpointTier, iteration: int, path: str, seconds: float,
                   blocking: dict | None = None, worker: dict | None = None) -> None:
        """`seconds`: from the start of the save to its publication; `blocking`, for an async save, the
        parts of it the trainer spent on the save rather than training (a synchronous save: all), and
        `worker`, what its background write cost the busiest rank's worker (CPU and wall seconds)."""
        if tier is self.save_tier:
            self.last_saved_iteration = iteration
        timing: dict = {"seconds": round(seconds, 3)}
        if blocking is not None:
            timing.update(asynchronous=True, blocking_seconds=round(sum(blocking.values()), 3),
                          blocking_parts={part: round(s, 3) for part, s in blocking.items()},
                          **{f"worker_{k}": round(v, 3) for k, v in (worker or {}).items()})
        events.record("save_published", tier=tier.name, iteration=iteration, path=path, **timing)
        kind = "" if tier is self.save_tier else f"{tier.name} "
        events.print_rank_0(f"  successfully saved {kind}checkpoint from iteration {iteration:7d} "
                            f"to {tier.root} {_ranks_tag()}")
        if parallel.is_rank0() and isinstance(tier, GlobalTier):
            if tier is self.save_tier:
                apply_retention(self.config.save, self.config.keep_last, self.config.save_retain_interval)
            else:  # non-persistent: only the newest is kept, as in Megatron (NVRx does it for local)
                apply_retention(tier.root, keep_last=1, retain_interval=None)


def _non_persistent_tier(config: CheckpointConfig, layout_of_run: str) -> CheckpointTier | None:
    if config.local_dir is not None:
        return LocalTier(config.local_dir, algo=config.local_algo, replication=config.replication,
                         verify_checksums=config.verify_checksums, parallel_layout=layout_of_run,
                         async_timeout_s=config.async_timeout_secs)
    if config.non_persistent_dir is not None:
        # Megatron-LM's non-persistent global checkpoints are distributed ones (its legacy format has no
        # such path): with --ckpt-format torch they stay torch_dist.
        ckpt_format = "torch_dist" if config.ckpt_format == "torch" else config.ckpt_format
        return GlobalTier(config.non_persistent_dir, name="non-persistent",
                          verify_checksums=config.verify_checksums, ckpt_format=ckpt_format,
                          assume_constant_structure=config.assume_constant_structure,
                          verify_integrity=config.verify_integrity, strictness=config.strictness)
    return None


def parallel_layout(args: argparse.Namespace) -> str:
    """What a per-rank checkpoint depends on: the same layout, or its shards belong to other positions."""
    optimizer = "replicated"
    if args.use_distributed_optimizer:
        optimizer = "distributed"
    elif getattr(args, "use_layer_wise_distributed_optimizer", False):  # Muon's
        optimizer = "layer-wise distributed"
    return (f"world {args.world_size}, TP {args.tensor_model_parallel_size}, "
            f"PP {args.pipeline_model_parallel_size}, "
            f"VP {args.virtual_pipeline_model_parallel_size or 1}, CP {args.context_parallel_size}, "
            f"EP {args.expert_model_parallel_size}, {optimizer} optimizer")


def _rng_layout_change(saved: dict, args: argparse.Namespace,
                       rng_shape: tuple[int, ...] | None) -> str | None:
    """Why the checkpoint's RNG states do not fit this run, as Megatron-LM decides it: they are kept per
    tensor- and pipeline-parallel rank, and in the layout `rng_shape` (PP, TP, DP) of Megatron-LM core_v0.16
    under expert parallelism per data-parallel rank too."""
    for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if saved.get(flag, 1) != getattr(args, flag):
            return f"--{flag.replace('_', '-')} {saved.get(flag, 1)} (this run: {getattr(args, flag)})"
    data_parallel = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    if rng_shape is not None and len(rng_shape) == 3 and rng_shape[2] != data_parallel:
        return f"RNG states for {rng_shape[2]} data-parallel ranks (this run: {data_parallel})"
    return None


def _ranks_tag() -> str:
    """Megatron-LM's `[ t 1/TP, p 1/PP ]` of its checkpoint lines, as rank 0 prints them."""
    return (f"[ t 1/{parallel_state.get_tensor_model_parallel_world_size()}, "
            f"p 1/{parallel_state.get_pipeline_model_parallel_world_size()} ]")


def _is_release(candidate: TierCandidate) -> bool:
    return os.path.basename(candidate.path) == layout.RELEASE_DIR


def _due(iteration: int, interval: int | None) -> bool:
    return bool(interval) and iteration % interval == 0


def _holds_checkpoints(root: str) -> bool:
    return bool(layout.published_iterations(root) or layout.quarantined(root)
                or os.path.exists(tracker_path(root)))


def _same_dir(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)
