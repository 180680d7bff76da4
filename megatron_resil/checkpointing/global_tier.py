"""A global checkpoint tier (a directory on shared storage) through megatron-core's dist_checkpointing,
in torch_dist format or, with --ckpt-format zarr, in zarr v3 through our tensorstore strategy; with
--ckpt-format torch, Megatron-LM's legacy per-rank torch.save files (torch_format).

Save: write into a staging directory, fsync everything, add the manifest (and, with --verify-integrity,
Megatron-LM's integrity.json before it), rename into place, then replace the tracker. Load order: the
checkpoint the tracker names, then every other published one, newest first. Leftovers of interrupted
saves are cleaned at start-up.
"""

from __future__ import annotations

import inspect
import json
import os
import queue
import shutil
import time
from collections.abc import Callable

import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)
from torch.distributed.checkpoint.api import CheckpointException

from megatron_resil import events, parallel
from megatron_resil.checkpointing import (
    dcp_writer,
    layout,
    megatron_integrity,
    safe_load,
    shard_writer,
    torch_format,
    untrusted,
    zarr_strategy,
)
from megatron_resil.checkpointing.atomic import (
    fsync_dir,
    fsync_tree,
    publish_directory,
    replace_file_text,
)
from megatron_resil.checkpointing.manifest import (
    check_manifest,
    checksum_files,
    has_manifest,
    read_manifest,
    write_manifest,
)
from megatron_resil.checkpointing.staging import HostStaging
from megatron_resil.checkpointing.staging import structure_of as staging_structure
from megatron_resil.checkpointing.tier import (
    AsyncSaveJob,
    CheckpointSaveError,
    CheckpointTier,
    NotForThisRun,
    PublishWithheld,
    TierCandidate,
)
from megatron_resil.checkpointing.tracker import read_tracker, write_tracker

FORMATS = ("torch_dist", "zarr", torch_format.FORMAT)
# megatron-core 0.16's load() takes the common.pt reader (ours reads weights-only); 0.19's has no such
# argument and reads the common state itself (its legacy common.pt reader is ours: patches/megatron_core.py).
_LOAD_TAKES_COMMON_STRATEGY = "common_strategy" in inspect.signature(dist_checkpointing.load).parameters
# megatron-core 0.19's save() hands an async save to NVRx's writer unless told "mcore"; our worker, queue
# and checksumming writer are built on megatron-core's own (the only one 0.16 has).
_MCORE_ASYNC = {"async_strategy": "mcore"} if "async_strategy" in \
    inspect.signature(dist_checkpointing.save).parameters else {}
# megatron-core picks the strategy that reads a checkpoint from its metadata.json: zarr needs ours.
zarr_strategy.register()


def _make_staging(root: str, iteration: int) -> str:
    os.makedirs(root, exist_ok=True)
    staging = layout.new_staging_dir(root, iteration)
    os.makedirs(staging)
    return staging


# The checkpoints this process has warned about lacking a manifest: once each.
_SAID_NO_MANIFEST: set[str] = set()


class GlobalTier(CheckpointTier):
    def __init__(self, root: str, name: str = "persistent", write_tracker: bool = True,
                 verify_checksums: bool = True, ckpt_format: str = "torch_dist",
                 assume_constant_structure: bool = False, verify_integrity: bool = False,
                 strictness: str = "assume_ok_unexpected") -> None:
        assert ckpt_format in FORMATS, ckpt_format
        assert not verify_integrity or ckpt_format == "torch_dist", "--verify-integrity is torch_dist only"
        self.root = root
        self.name = name
        self.ckpt_format = ckpt_format  # what saves write; loads read either, as recorded in each checkpoint
        self.supports_async_save = ckpt_format == "torch_dist"  # as in Megatron
        self.write_tracker = write_tracker
        self.verify_checksums = verify_checksums
        # Megatron-LM's --verify-integrity: saves add its SHA-256 manifest (integrity.json); loads require
        # one. Without it, a checkpoint that carries one is still checked against it.
        self.verify_integrity = verify_integrity
        self.strictness = strictness  # --dist-ckpt-strictness, megatron-core's StrictHandling, as Megatron-LM
        self.on_staged = None  # called with the iteration after the shards are written, before publish
        self.may_publish: Callable[[], bool] | None = None  # asked on rank 0 just before a publish
        self._common_of: tuple[str, dict] | None = None
        self._rank_files: torch_format.RankFiles | None = None  # a torch-format candidate's, read by verify
        # A --load that is not this run's --save is only read: a rejected checkpoint there stays put.
        self.read_only = False
        # --ckpt-assume-constant-structure: one torch_dist strategy for the job, so megatron-core
        # reuses its save plan and data-parallel spread, and sharding is validated on the first save only.
        self.assume_constant_structure = assume_constant_structure
        self._kept_strategy = None
        self._async_plan: tuple | None = None  # (the state's structure, the strategy that planned it)

    # ---- load side -------------------------------------------------------------------------
    def candidates(self) -> list[TierCandidate]:
        # Rank 0's view of the shared directory is the one every rank follows; before the process groups
        # (--use-checkpoint-args), each process has only its own.
        if not dist.is_initialized():
            return self._scan()
        return parallel.broadcast_object(self._scan() if parallel.is_rank0() else None)

    def _scan(self) -> list[TierCandidate]:
        published = layout.published_iterations(self.root)
        reading = read_tracker(self.root)
        ordered: list[TierCandidate] = []
        if reading.iteration == -1:
            ordered.append(TierCandidate(self.name, 0, os.path.join(self.root, layout.RELEASE_DIR),
                                         "named by tracker (release)"))
        elif reading.iteration is not None:
            ordered.append(TierCandidate(self.name, reading.iteration,
                                         layout.iteration_dir(self.root, reading.iteration),
                                         "named by tracker"))
        elif published:
            events.decision("tracker", f"{reading.problem}; trying the newest checkpoint instead")
        for iteration in published:
            if reading.iteration != iteration:
                ordered.append(TierCandidate(self.name, iteration,
                                             layout.iteration_dir(self.root, iteration), "newest first"))
        return ordered

    def verify(self, candidate: TierCandidate) -> str | None:
        path = candidate.path
        if os.path.islink(path):  # its files would be wherever the link points, outside this directory
            return f"is a symlink to {untrusted.escape_untrusted(os.readlink(path))}; a checkpoint is a " \
                "directory of its own"
        if not os.path.isdir(path):
            return "directory missing"
        # Sizes and checksums would be of a link's target; a FIFO would block the first read of it.
        if (irregular := untrusted.find_irregular(path)) is not None:
            return irregular
        # What marks a checkpoint complete when it has no manifest: DCP's .metadata, written last
        # (torch_dist), or megatron-core's metadata.json, written after the strategy returned (zarr); each
        # rank's own model_optim_rng.pt (torch), looked for after the manifest.
        backend = torch_format.FORMAT if torch_format.is_torch_checkpoint(path) else \
            _sharded_backend(path) or "torch_dist"
        marker = {"torch_dist": ".metadata", torch_format.FORMAT: torch_format.MODEL_FILE}.get(backend,
                                                                                          "metadata.json")
        if backend != torch_format.FORMAT and not os.path.isfile(os.path.join(path, marker)):
            return f"incomplete (no {marker})"
        integrity, reason = megatron_integrity.read_integrity_manifest(path)
        if reason is not None:
            return reason
        manifest = None
        if has_manifest(path):
            manifest, reason = read_manifest(path)
            if manifest is None:
                return reason
        # Unless our manifest says it had one: then it is missing, and check_manifest says so.
        if integrity is None and self.verify_integrity and \
                (manifest is None or megatron_integrity.INTEGRITY_NAME not in manifest["files"]):
            return NotForThisRun(f"saved without --verify-integrity: it has no {megatron_integrity.WHAT}; "
                                 "drop --verify-integrity to load it (its own manifest, if any, is still "
                                 "checked)")
        share = (parallel.rank(), dist.get_world_size() if dist.is_initialized() else 1)
        hashed: set[str] = set()  # the files our manifest's reading also checked against integrity.json
        if manifest is None:
            checked = f"only the presence of {marker} was checked" if backend != torch_format.FORMAT else \
                "its files are only read through the allow-list, with no checksums to compare"
            checked = checked if integrity is None else \
                f"its files are checked against {megatron_integrity.WHAT} instead"
            if path not in _SAID_NO_MANIFEST:  # --use-checkpoint-args verifies before the loader does
                _SAID_NO_MANIFEST.add(path)
                events.warn(f"{path} has no manifest: saved by Megatron-LM or an older megatron-resil; "
                            f"{checked}")
        else:
            is_release = os.path.basename(path) == layout.RELEASE_DIR
            # Every rank checks all sizes and the checksums of its share of the files.
            reason = check_manifest(path, manifest, None if is_release else candidate.iteration, share=share,
                                    checksums=self.verify_checksums, sha256=integrity)
            if reason is not None:
                return reason
            hashed = set(manifest["files"])
        if integrity is not None and (reason := megatron_integrity.verify_integrity_manifest(
                path, integrity, share=share, checksums=self.verify_checksums, hashed_elsewhere=hashed)):
            return reason
        # Checksums cannot vouch for what the bytes ask an unpickler to do, nor for the paths and shapes
        # they name: whoever wrote them could have written the manifest.
        if backend == "zarr" and (reason := zarr_strategy.check_metadata(path)) is not None:
            return reason
        if backend == torch_format.FORMAT:
            return self._verify_torch_format(path)
        return safe_load.check_checkpoint(path, backend, share)

    def _verify_torch_format(self, path: str) -> str | None:
        """Each rank reads its own files through the allow-list (and keeps them for the load). Without
        process groups: the checkpoint tool reads every file; --use-checkpoint-args (no checksums, every
        process reading for itself) the rank-0 file whose arguments it takes, as Megatron-LM does."""
        self._rank_files = None
        if not parallel_state.model_parallel_is_initialized():
            every_file = self.verify_checksums
            return torch_format.reason_of(lambda: torch_format.check_all(path, every_file=every_file))
        files = torch_format.RankFiles(path, self.max_rank_bytes)
        if not files.present():
            return NotForThisRun(f"it holds no {files.model_file} for this rank: saved under another "
                                 "parallel layout, and a --ckpt-format torch checkpoint loads only under the "
                                 "tensor-, pipeline- and expert-parallel sizes that saved it")
        if (larger := files.larger_than_this_model()) is not None:  # not quarantined: maybe a larger model's
            return NotForThisRun(larger)
        reason = torch_format.reason_of(files.read)
        if reason is None:
            self._rank_files = files
        return reason

    def _torch_files(self, candidate: TierCandidate) -> torch_format.RankFiles | None:
        """The candidate's files as this rank's verification read them, or None if it is no torch-format
        checkpoint."""
        if self._rank_files is not None and self._rank_files.path == candidate.path:
            return self._rank_files
        if not torch_format.is_torch_checkpoint(candidate.path):
            return None
        files = torch_format.RankFiles(candidate.path, self.max_rank_bytes)
        files.read()
        return files

    def quarantine(self, candidate: TierCandidate, reason: str) -> None:
        """Rank 0 moves a rejected checkpoint aside; an error there is logged, never raised, so every
        rank reaches the barrier and the loader moves on to the next candidate together."""
        if parallel.is_rank0() and os.path.lexists(candidate.path) and \
                os.path.basename(candidate.path) != layout.RELEASE_DIR:
            self._move_aside(candidate, reason)
        _barrier()

    def _move_aside(self, candidate: TierCandidate, reason: str) -> None:
        if self.read_only:
            events.decision("quarantine", f"left {candidate.path} in place: {self.root} is only read by this "
                            "run (--load is not --save); skipped", path=candidate.path, moved=False)
            return
        try:
            target = layout.new_quarantine_dir(self.root, candidate.iteration, _slug(reason))
            is_link = os.path.islink(candidate.path)
            os.rename(candidate.path, target)  # a link is renamed itself; its target is left alone
            if not is_link:  # written into a link, the reason would land in the directory it points to
                replace_file_text(os.path.join(target, "QUARANTINE_REASON.txt"),
                                  untrusted.escape_untrusted(reason) + "\n")
            fsync_dir(self.root)
        except OSError as err:
            events.decision("quarantine", f"could not move {candidate.path} aside ({err.strerror or err}); "
                            "left in place and skipped", path=candidate.path, moved=False)
            return
        events.decision("quarantine", f"renamed {candidate.path} to {target}: {reason}; "
                        "kept for inspection, never loaded again", tier=self.name,
                        iteration=candidate.iteration, path=target, reason=reason)

    def saved_args(self, candidate: TierCandidate):
        if torch_format.is_torch_checkpoint(candidate.path):
            if not parallel_state.model_parallel_is_initialized():  # Megatron-LM reads rank 0's file then
                relative = torch_format.rank0_model_file(candidate.path)
                return torch_format.read_file(untrusted.inside(candidate.path, relative)).get("args", {})
            return self._torch_files(candidate).state.get("args", {})
        return self._common(candidate).get("args", {})

    def saved_metadata(self, candidate: TierCandidate) -> dict | None:
        if torch_format.is_torch_checkpoint(candidate.path):
            return {"ckpt_format": torch_format.FORMAT}  # per-rank files of whole tensors: no sharding
        return dist_checkpointing.load_content_metadata(preloaded_state_dict=self._common(candidate))

    def _common(self, candidate: TierCandidate) -> dict:
        """The candidate's common state (common.pt, or in the shards with megatron-core 0.19), read once."""
        if self._common_of is None or self._common_of[0] != candidate.path:
            self._common_of = (candidate.path, safe_load.CommonLoadWeightsOnly().load_common(candidate.path))
        return self._common_of[1]

    def load(self, candidate: TierCandidate, sharded_template: dict) -> dict:
        if sharded_template.get("ckpt_format") == torch_format.FORMAT:
            files = self._torch_files(candidate)
            self._rank_files = None  # the state is the caller's now: not kept beside it
            return torch_format.loaded_state(files, sharded_template)
        kwargs = {"common_strategy": safe_load.CommonLoadWeightsOnly()} if _LOAD_TAKES_COMMON_STRATEGY else {}
        loaded = dist_checkpointing.load(sharded_template, candidate.path, strict=self.strictness, **kwargs)
        if isinstance(loaded, tuple):  # return_unexpected, return_all: Megatron-LM would choke on these
            loaded, missing, _unexpected = loaded  # the model keys it lacks: said by state.restore
            _say_mismatch(self.strictness, candidate.path, missing)
        return loaded

    # ---- save side -------------------------------------------------------------------------
    def save(self, sharded_state: dict, iteration: int) -> str:
        """Collective. Any failure on any rank (a full disk, an I/O error, DCP's CheckpointException)
        is agreed on in one collective after megatron-core's own, so every rank raises
        CheckpointSaveError together, the staging directory removed and the previous checkpoint intact."""
        staging = self._begin(iteration)
        own, failure = {}, None
        try:
            if self.ckpt_format == torch_format.FORMAT:
                own = torch_format.save_rank_files(staging, sharded_state)
            elif self.ckpt_format == "zarr":
                writer = zarr_strategy.ZarrSaveShardedStrategy()
                dist_checkpointing.save(sharded_state, staging, sharded_strategy=self._parallel(writer),
                                        content_metadata=self.content_metadata)
                own = checksum_files(staging, writer.files_written_by_me())
            else:
                with dcp_writer.without_torch_record_crc(), dcp_writer.results_in_this_process(), \
                        dcp_writer.rank0_writes_fail_late():
                    strategy, validate = self._torch_dist_strategy()
                    dist_checkpointing.save(sharded_state, staging, sharded_strategy=strategy,
                                            validate_access_integrity=validate,
                                            content_metadata=self.content_metadata)
                own = shard_writer.own_shard_checksums(staging, parallel.rank())
                if self.verify_integrity:  # each rank hashes what it wrote; rank 0 the rest, at publish
                    megatron_integrity.add_sha256(staging, own)
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException
            failure = said_if_full(_one_line(err), self.root)
        outcomes = parallel.all_gather_object((own, failure))  # also: every rank's shards are written
        failed = [(rank, why) for rank, (_, why) in enumerate(outcomes) if why is not None]
        if failed:
            self.abandon(staging)
            rank, why = failed[0]
            more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
            raise CheckpointSaveError(f"could not write iteration {iteration} to {self.root}: rank {rank}: "
                                      f"{why}{more}")
        return self.finish(staging, iteration, _merged([checksums for checksums, _ in outcomes]))

    def save_async(self, sharded_state: dict, iteration: int, host: HostStaging,
                   workers: str = "") -> AsyncSaveJob:
        """Plan collectively and stage this rank's share (the main replicas it writes) in `host`; the worker
        writes and checksums this rank's shards; megatron-core's finalize steps (global .metadata) and our
        publish follow on every rank."""
        staging = self._begin(iteration)
        request, failure, strategy = None, None, None
        try:  # planning and staging are collective; rank 0 also writes common.pt here
            with dcp_writer.rank0_writes_fail_late(), dcp_writer.results_in_this_process():
                strategy, validate = self._async_strategy(sharded_state)
                with shard_writer.staged_in(strategy, host):
                    request = dist_checkpointing.save(
                        sharded_state, staging, sharded_strategy=strategy, async_sharded_save=True,
                        validate_access_integrity=validate, content_metadata=self.content_metadata,
                        **_MCORE_ASYNC)
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException
            failure = said_if_full(_one_line(err), self.root)
        failed = [(rank, why) for rank, why in enumerate(parallel.all_gather_object(failure)) if why]
        if failed:
            self.abandon(staging)
            raise CheckpointSaveError(f"could not stage iteration {iteration} in {self.root}: rank "
                                      f"{failed[0][0]}: {failed[0][1]}")
        # Where megatron-core's finalisation reads this rank's write results: the worker sends them back.
        results = shard_writer.results_queue_of(strategy)

        def publish(per_rank: list) -> str:
            own_results, checksums = per_rank[parallel.rank()][0], [c for _, c in per_rank]
            if results is not None and own_results is not None:
                results.put(own_results)
            failure = None
            try:  # megatron-core's finalisation: the global .metadata, metadata.json (rank 0), barriers
                with dcp_writer.rank0_writes_fail_late():
                    for finalize in request.finalize_fns:
                        finalize()
            except (Exception, CheckpointException) as err:  # DCP's is a BaseException
                failure = _one_line(err)
            failed = [(rank, why) for rank, why in enumerate(parallel.all_gather_object(failure)) if why]
            if failed:
                self.abandon(staging)
                raise CheckpointSaveError(f"could not finish iteration {iteration} in {self.root}: rank "
                                          f"{failed[0][0]}: {failed[0][1]}")
            return self.finish(staging, iteration, _merged(checksums))

        return AsyncSaveJob(iteration, write_own_shards,
                            (parallel.rank(), staging, request.async_fn, request.preload_fn,
                             request.async_fn_args, self.verify_integrity),
                            publish, lambda: self.abandon(staging))

    def finish(self, staging: str, iteration: int, checksums: dict) -> str:
        """Collective: publish a staged checkpoint whose shards every rank has written."""
        final = layout.iteration_dir(self.root, iteration)
        if self.on_staged is not None:
            self.on_staged(iteration)
        self._on_rank0(lambda: self._publish(staging, final, iteration, checksums), f"publish {final}")
        return final

    def abandon(self, staging: str) -> None:
        """Collective: drop a staged save that will never be published."""
        if parallel.is_rank0():
            shutil.rmtree(staging, ignore_errors=True)
        _barrier()

    def _begin(self, iteration: int) -> str:
        return self._on_rank0(lambda: _make_staging(self.root, iteration),
                              f"create a staging directory in {self.root}")

    def _torch_dist_strategy(self):
        """(strategy, validate sharding?) for this torch_dist save."""
        if not self.assume_constant_structure:
            return self._strategy(), True
        if self._kept_strategy is None:
            self._kept_strategy = self._strategy(cache_structure=True)
            return self._kept_strategy, True
        return self._kept_strategy, False

    def _async_strategy(self, sharded_state: dict):
        """(strategy, validate sharding?) for an async save: megatron-core's plan and spread over
        data-parallel ranks of the previous async save are kept while the state's structure is the same on
        every rank (one small all-reduce says so), as --ckpt-assume-constant-structure keeps them for every
        save; a new structure is planned and validated afresh. Collective."""
        structure = staging_structure(sharded_state)
        if parallel.all_ranks_agree(self._async_plan is not None and self._async_plan[0] == structure):
            return self._async_plan[1], False
        self._async_plan = (structure, self._strategy(cache_structure=True))
        return self._async_plan[1], True

    @classmethod
    def _strategy(cls, cache_structure: bool = False):
        return cls._parallel(shard_writer.ChecksummedTorchDistSaveStrategy(
            "torch_dist", 1, cached_metadata=cache_structure), cache_structure)

    @staticmethod
    def _parallel(strategy, cache_distribution: bool = False):
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Spread replicated tensors over data-parallel ranks, as Megatron does by default.
            strategy = FullyParallelSaveStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True),
                do_cache_distribution=cache_distribution)
        return strategy

    def _publish(self, staging: str, final: str, iteration: int, checksums: dict) -> None:
        fsync_tree(staging)  # common.pt and metadata.json are written without fsync
        # Megatron-LM writes it after metadata.json; before ours, so that ours covers it too.
        if self.verify_integrity:
            megatron_integrity.write_integrity_manifest(
                staging, {rel: entry.pop("sha256") for rel, entry in checksums.items() if "sha256" in entry})
        write_manifest(staging, iteration, self.ckpt_format, checksums)
        fsync_dir(staging)
        # A rank whose launcher died stops without publishing (launcher_watch): its watch thread may
        # not have noticed yet, but a save that finished meanwhile must not be published past the
        # exit record. The trainer says whether it still may; if not, the decision is the trainer's.
        if self.may_publish is not None and not self.may_publish():
            raise PublishWithheld(f"iteration {iteration} was written to {staging} but not published")
        publish_directory(staging, final, layout.new_displaced_dir(self.root, iteration))
        if self.write_tracker:
            write_tracker(self.root, iteration)

    @staticmethod
    def _on_rank0(step, what: str):
        """Run a file-system step on rank 0 and share its result, or its failure, with every rank,
        so an I/O error there (disk full, permissions) ends the save everywhere instead of a hang."""
        result, failure = None, None
        if parallel.is_rank0():
            try:
                result = step()
            except OSError as err:
                failure = f"could not {what}: {err}"
        result, failure = parallel.broadcast_object((result, failure))
        if failure is not None:
            raise CheckpointSaveError(failure)
        return result

    def startup_cleanup(self) -> None:
        """Rank 0 clears the debris of interrupted saves and deletions. A step that fails (an I/O error,
        a leftover that is a mount point or of the wrong type) is logged and left in place, never
        raised: every rank reaches the barrier, and no leftover is ever loaded."""
        if parallel.is_rank0():
            found = layout.leftovers(self.root)
            for path in found["displaced"]:
                final = layout.iteration_dir(self.root, layout.displaced_iteration(path))
                if not os.path.exists(final):
                    # Died between the two renames of a non-atomic replace: put the old one back.
                    _cleanup_step(f"restored {final} from interrupted replace {path}",
                                  f"restore {final} from interrupted replace {path}",
                                  lambda path=path, final=final: (os.rename(path, final),
                                                                  fsync_dir(self.root)))
                else:
                    _cleanup_step(f"removed {path}: leftover of a completed replace",
                                  f"remove {path} (leftover of a completed replace)",
                                  lambda path=path: _rmtree(path))
            for path in found["deleting"]:
                _cleanup_step(f"removed {path}: interrupted retention deletion",
                              f"remove {path} (interrupted retention deletion)",
                              lambda path=path: _rmtree(path))
            for path in found["staging"]:
                _cleanup_step(f"removed {path}: leftover of a save interrupted before it was published; "
                              "never loaded", f"remove {path} (leftover of an interrupted save)",
                              lambda path=path: _rmtree(path))
            for path in found["tracker_tmp"]:
                _cleanup_step(f"removed {path}: interrupted tracker update",
                              f"remove {path} (interrupted tracker update)",
                              lambda path=path: os.remove(path))
        _barrier()


def _rmtree(path: str) -> None:
    if os.path.islink(path):  # a leftover's name on a link: remove the link, never what it points to
        os.unlink(path)
    else:
        untrusted.remove_tree(path)
    if os.path.lexists(path):
        raise OSError(f"{path} is still there")


def _cleanup_step(done: str, failed: str, step) -> None:
    try:
        step()
    except OSError as err:
        events.decision("cleanup", f"could not {failed}: {err}; left in place (never loaded)")
        return
    events.decision("cleanup", done)


def write_own_shards(rank: int, staging: str, write_fn, preload_fn, write_args,
                     sha256: bool = False) -> tuple[tuple, dict]:
    """An async save's background work (in the worker process): write this rank's shards (the strategy's
    write function, shard_writer.write_buckets) and return ((its write results for megatron-core's
    finalisation, their checksums), the seconds of each phase). The checksums are computed by the writer
    of the data as it writes; with `sha256` (--verify-integrity) their SHA-256s too, read back here."""
    phases, outcome = {}, None
    began = time.monotonic()
    if write_fn is not None:  # None: this rank has nothing to write in this save
        write_args = list(write_args)
        # Staged tensors are host memory already; megatron-core's preload would only synchronize CUDA.
        if preload_fn is not None and not _all_on_host(write_args[1]):
            write_args[1] = preload_fn()
        results: queue.Queue = queue.Queue()  # megatron-core's writer reports here, in this process
        write_args[2] = results
        with dcp_writer.without_torch_record_crc():
            write_fn(*write_args)
        outcome = results.get_nowait()
        if isinstance(outcome, BaseException):
            raise outcome
    phases["write"] = time.monotonic() - began
    own = shard_writer.own_shard_checksums(staging, rank)
    if sha256:
        began = time.monotonic()
        megatron_integrity.add_sha256(staging, own)
        phases["sha256"] = time.monotonic() - began
    return (outcome, own), phases


def _all_on_host(buckets: list) -> bool:
    return all(tensor.device.type == "cpu" for _, _, (_, tensor_data) in buckets for _, tensor in tensor_data)


# The --dist-ckpt-strictness modes that load around a model key the checkpoint lacks (megatron-core drops
# it from what is read; the parameter keeps its initial value). The others fail such a load.
PARTIAL_LOADS = frozenset({"log_unexpected", "log_all", "return_unexpected", "return_all", "ignore_all"})


def _say_mismatch(strictness: str, path: str, missing) -> None:
    """The checkpoint keys a return_* load reports this model does not ask for, in one line (megatron-core
    calls them `missing`). The model keys it lacks (`unexpected`) are said once, by state.restore, for
    every mode that loads around them."""
    names = sorted({str(getattr(k, "key", k)) for k in missing})
    if names:
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        events.print_rank_0(f"[resil] load: --dist-ckpt-strictness {strictness}: {path}: {len(names)} "
                            f"checkpoint key(s) this model does not ask for, not read: "
                            + ", ".join(names[:4]) + more)


_FULL_BELOW_BYTES = 1 << 20


def said_if_full(reason: str, directory: str) -> str:
    """`reason` a write failed for, with the file system's state where it is full. A full disk does not
    always say so: megatron-core 0.19 writes through torch's zip writer, which reports a short write as
    "unexpected pos 704 vs 598" and drops the ENOSPC behind it."""
    if "No space left on device" in reason or "Disk quota exceeded" in reason:
        return reason
    try:
        fs = os.statvfs(directory)
    except OSError:
        return reason
    free = fs.f_bavail * fs.f_frsize
    if free >= _FULL_BELOW_BYTES and not (fs.f_files and fs.f_favail == 0):
        return reason
    return (f"{reason} (No space left on device: the file system of {directory} has {free} bytes and "
            f"{fs.f_favail} inodes free)")


def _one_line(err: BaseException) -> str:
    if isinstance(err, CheckpointException) and err.failures:  # DCP wraps each rank's real error
        err = next(iter(err.failures.values()))
        if isinstance(err, tuple):
            err = err[0]
    cause = err
    while cause.__cause__ is not None and not str(cause):
        cause = cause.__cause__
    first_line = (str(cause).splitlines() or [""])[0][:300]
    return f"{type(cause).__name__}: {first_line}"


def gather_checksums(local: dict) -> dict:
    """Union of every rank's checksums (collective; also the barrier that says every shard is
    written)."""
    return _merged(parallel.all_gather_object(local))


def _merged(per_rank: list[dict]) -> dict:
    merged: dict = {}
    for part in per_rank:
        merged.update(part)
    return merged


def _sharded_backend(path: str) -> str | None:
    """The format megatron-core recorded in a checkpoint's metadata.json (None if unreadable)."""
    try:
        return json.loads(untrusted.read_text(os.path.join(path, "metadata.json"))).get("sharded_backend")
    except (OSError, ValueError, AttributeError, RecursionError, untrusted.CheckpointDataError):
        return None


def _slug(reason: str) -> str:
    for word, slug in (("checksum", "checksum"), ("refused without reading", "oversized"),
                       ("before torch.load", "oversized"),
                       ("symlink", "link"), ("FIFO", "not-a-file"), ("device", "not-a-file"),
                       ("socket", "not-a-file"), ("inside it", "outside"),
                       ("deep", "too-deep"), ("entries", "too-many"), ("unpickle", "unsafe"),
                       ("extra state", "unsafe"), ("bytes", "truncated"), ("missing", "missing"),
                       ("manifest", "manifest"), ("metadata", "incomplete")):
        if word in reason:
            return slug
    return "rejected"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
