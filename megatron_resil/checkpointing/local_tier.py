"""The node-local tier: NVRx's LocalCheckpointManager and CliqueReplicationStrategy, made verifiable.

Layout (NVRx's, so losing a node means losing its ranks' directories):
`<root>/<rank>/iter_<7 digits>_<owner>_local.pt`, each beside its manifest `<file>.manifest.json`
{"iteration", "owner", "size", "crc32"} written by the owner's seal (see sealed_shard.py). With
--replication a rank's directory also holds its clique peers' shards. One iteration is kept.

What this adds to NVRx 0.4.1, each a trap seen there:
- every copy is verified against its owner's checksum before use; a bad own copy is swapped for a
  verified replica; a rank that cannot get a verified copy makes all ranks move on together;
- retrieval from replicas works on gloo (see replication.py);
- a stale `.dirty` file from a crashed save is replaced instead of failing that rank's next save
  while the others wait in a barrier; a write that fails on one rank fails the save on all ranks;
- a rejected iteration is moved to `<root>/<rank>/quarantined/`, never deleted and never tried again;
- with --async-save the trainer only stages the state: sealing, replicating and writing happen in the
  background worker (NVRx seals and replicates in the trainer).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import CheckpointingException
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
    LocalCheckpointManager,
)

from megatron_resil import events, parallel
from megatron_resil.checkpointing import untrusted
from megatron_resil.checkpointing.atomic import atomic_write_text, replace_file_text
from megatron_resil.checkpointing.dcp_writer import without_torch_record_crc
from megatron_resil.checkpointing.replication import (
    WorkerReplication,
    build_clique_strategy,
    clique_groups,
    comm_device,
    world_retrieval,
)
from megatron_resil.checkpointing.sealed_shard import SealedShard, crc32_of, read_payload, serialize
from megatron_resil.checkpointing.shard_writer import ChecksummingStream
from megatron_resil.checkpointing.staging import HostStaging, structure_of
from megatron_resil.checkpointing.tier import (
    AsyncSaveJob,
    CheckpointDataError,
    CheckpointSaveError,
    CheckpointTier,
    NotForThisRun,
    TierCandidate,
)

MANIFEST_SUFFIX = ".manifest.json"
QUARANTINE_DIR = "quarantined"
SESSION = ""  # Megatron-LM's default session id: <root>/<rank>/...


class _VerifiableLocalManager(LocalCheckpointManager):
    """LocalCheckpointManager writing sealed shards with their manifests. The NVRx methods it overrides and
    calls are private: checked at start-up against the installed NVRx (patches/nvrx.py)."""

    def __init__(self, root: str, repl_strategy=None) -> None:
        super().__init__(root, session_id=SESSION, repl_strategy=repl_strategy)
        self.on_written = None  # fault injection: called after the bytes are written, before the rename
        self.write_failure: str | None = None

    def _save(self, shard: SealedShard, ckpt_id) -> None:
        self._ensure_dir()
        write_copy(self._local_ckpt_path_from_id(ckpt_id), self._local_ckpt_path_from_id(ckpt_id, True),
                   shard.meta, shard.payload, on_written=self.on_written)

    def _save_fn(self, id_to_state_dict) -> None:
        # NVRx raises here on the failing rank only, leaving the others in the barrier that
        # follows: record it instead; the completeness check after the barrier fails everywhere.
        self.write_failure = None
        try:
            super()._save_fn(id_to_state_dict)
        except Exception as err:  # noqa: BLE001 - any write failure, reported collectively
            self.write_failure = f"{type(err).__name__}: {err}"

    def _my_ckpt_ids(self):
        # Presence of the shard and its manifest; contents are verified when a load considers them.
        return [ckpt_id for ckpt_id in super()._my_ckpt_ids()
                if Path(str(self._local_ckpt_path_from_id(ckpt_id)) + MANIFEST_SUFFIX).exists()]

    def _cleanup(self, iteration: int) -> None:
        # NVRx's own removes every iter_*_*_local.pt of an older iteration, and a file named otherwise
        # (iter_0000006_x_local.pt) raised ValueError there, failing the save on one rank: ours removes only
        # shards named as NVRx names them, with their manifests.
        for path, its_iteration, _ in _shard_files(self.local_ckpt_dir):
            if its_iteration < iteration:
                path.unlink(missing_ok=True)
        for path in self.local_ckpt_dir.glob("iter_*_local.pt" + MANIFEST_SUFFIX):
            match = _SHARD_NAME.fullmatch(path.name[:-len(MANIFEST_SUFFIX)])
            if match is not None and int(match.group(1)) < iteration:
                path.unlink(missing_ok=True)

    def _cleanup_failed_save(self, iteration: int) -> None:
        super()._cleanup_failed_save(iteration)
        for path in self.local_ckpt_dir.glob(f"iter_{iteration:07d}_*"):
            path.unlink(missing_ok=True)


def write_copy(final: Path, dirty: Path, meta: dict, payload: torch.Tensor, on_written=None) -> None:
    """One copy of a sealed shard under NVRx's names: written as `dirty`, renamed when complete."""
    dirty.unlink(missing_ok=True)  # left by a crashed save; NVRx would fail this save on it
    # The manifest goes first, so a shard under its final name always has one.
    atomic_write_text(str(final) + MANIFEST_SUFFIX, json.dumps({**meta, "format": "sealed-v1"}))
    with open(dirty, "wb") as f:
        f.write(memoryview(payload.numpy()))
    if on_written is not None:
        on_written(meta["iteration"])
    dirty.rename(final)


def seal_and_write(state: MCoreTensorAwareStateDict, iteration: int, owner: int, layout: str, directory: str,
                   paths: dict[int, tuple[str, str]],
                   replication: WorkerReplication | None) -> tuple[None, dict[str, float]]:
    """An async local save's background work, all of it in the worker process: serialise this rank's staged
    state, checksum the bytes (the seal), send them to the clique's other workers and receive theirs
    (--replication), and write every copy this rank holds under `paths` ({owner: (final, dirty)}).
    Returns the seconds of each phase."""
    os.makedirs(directory, exist_ok=True)
    if replication is None:
        began = time.monotonic()
        write_streamed(*map(Path, paths[owner]), state, {"iteration": iteration, "owner": owner,
                                                         "layout": layout})
        return None, {"write": time.monotonic() - began}
    phases, began = {}, time.monotonic()
    payload = serialize(state)
    phases["serialize"], began = time.monotonic() - began, time.monotonic()
    shard = SealedShard.of_bytes(payload, iteration=iteration, owner=owner)
    shard.meta["layout"] = layout
    phases["checksum"], began = time.monotonic() - began, time.monotonic()
    copies, _ = replication.strategy().replicate(shard, (iteration, owner, SESSION))
    phases["replicate"], began = time.monotonic() - began, time.monotonic()
    for copy in copies:
        final, dirty = paths[copy.meta["owner"]]
        write_copy(Path(final), Path(dirty), copy.meta, copy.payload)
    phases["write"] = time.monotonic() - began
    return None, phases


def write_streamed(final: Path, dirty: Path, state: MCoreTensorAwareStateDict, meta: dict) -> None:
    """The one copy of a shard nothing else needs in memory (no replica to send): serialised straight into
    its `dirty` file, its size and CRC32 (the seal) taken as the bytes go out, in one pass over the data;
    then its manifest and the rename, as write_copy does them."""
    dirty.unlink(missing_ok=True)
    with open(dirty, "wb") as f:
        stream = ChecksummingStream(f)
        with without_torch_record_crc():
            torch.save(state, stream)
        f.flush()
    sealed = {**meta, "size": stream.size, "crc32": stream.checksum, "format": "sealed-v1"}
    atomic_write_text(str(final) + MANIFEST_SUFFIX, json.dumps(sealed))
    dirty.rename(final)


_SHARD_NAME = re.compile(r"iter_(\d+)_(\d+)_local\.pt")  # NVRx's name: iteration, owner


def _iteration_of(name: str) -> int:
    return int(name.split("_")[1])


def _shard_files(directory: Path) -> list[tuple[Path, int, int]]:
    """(path, iteration, owner) of the shards under final names in `directory`; a file named otherwise
    (another tool's, a hand-made copy) is not ours to read and is passed over."""
    found = []
    for path in sorted(directory.glob("iter_*_*_local.pt")):
        if (match := _SHARD_NAME.fullmatch(path.name)) is not None:
            found.append((path, int(match.group(1)), int(match.group(2))))
    return found


class LocalTier(CheckpointTier):
    supports_async_save = True
    def __init__(self, root: str, *, algo: str = "fully_parallel", replication: tuple[int, int] | None = None,
                 verify_checksums: bool = True, parallel_layout: str = "",
                 async_timeout_s: float = 600.0) -> None:
        self.root = root
        # Each shard is one rank's part under one parallel layout (recorded in its manifest): under
        # another (fewer nodes after a loss, more after a return) it belongs to no rank of this run.
        self.parallel_layout = parallel_layout
        self.name = "local"
        self.algo = algo
        self.verify_checksums = verify_checksums
        self.replication = replication
        self.async_timeout_s = async_timeout_s  # how long the workers wait for each other to replicate
        strategy = build_clique_strategy(*replication) if replication else None
        self.manager = _VerifiableLocalManager(root, strategy)
        self.on_staged = None
        self._fetched: tuple[int, MCoreTensorAwareStateDict] | None = None
        self._cleaner: threading.Thread | None = None  # removing an async save's older iteration
        self._async_spread: tuple | None = None  # (the state's structure, its data-parallel spread)
        self._left_behind: list[Path] = []  # other ranks' directories this rank reads (_find_left_behind)

    @property
    def my_dir(self) -> Path:
        return Path(self.manager.local_ckpt_dir)

    # ---- load side -------------------------------------------------------------------------
    def _my_files(self, iteration: int | None = None) -> dict[int, Path]:
        """{owner: path} of the shards under final names in this rank's directory, then in the directories
        this rank reads for ranks now on other nodes (_find_left_behind); its own directory's copy first."""
        found: dict[int, Path] = {}
        for directory in (self.my_dir, *self._left_behind):
            if not directory.is_dir():
                continue
            for path, its_iteration, owner in _shard_files(directory):
                if iteration is None or its_iteration == iteration:
                    found.setdefault(owner, path)
        return found

    def _find_left_behind(self) -> None:
        """Collective. After a node swap the rendezvous may place ranks on other nodes than the ones that
        hold their directories: `<root>/<r>/` then sits on a node where rank r no longer runs. The ranks
        that share this node's root read those directories too (each one by one of them, in turn), so
        the shards in them are offered like any replica and reach their owners over the new groups."""
        where = parallel.all_gather_object((socket.gethostname(), os.path.realpath(self.root)))
        me, world = parallel.rank() if len(where) > 1 else 0, len(where)
        sharers = [r for r in range(world) if where[r] == where[me]]
        root = Path(self.root)
        try:
            names = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and not p.is_symlink()
                           and p.is_dir()) if root.is_dir() else []
        except OSError:
            names = []
        orphans = [d for d in names if d < world and d not in sharers]
        self._left_behind = [root / str(d) for i, d in enumerate(orphans) if sharers[i % len(sharers)] == me]

    def candidates(self) -> list[TierCandidate]:
        self._cleaned()
        self._find_left_behind()
        mine = sorted({_iteration_of(p.name) for p in self._my_files().values()})
        everywhere = sorted({it for part in parallel.all_gather_object(mine) for it in part}, reverse=True)
        return [TierCandidate(self.name, it, self._describe(it), "node-local shards") for it in everywhere]

    def _describe(self, iteration: int) -> str:
        return describe(self.root, iteration)

    def _read_copy(self, path: Path, iteration: int, owner: int) -> tuple[SealedShard | None, str | None]:
        return read_copy(path, iteration, owner, checksums=self.verify_checksums,
                         max_bytes=self.max_rank_bytes)

    def verify(self, candidate: TierCandidate) -> str | None:
        """Collective (all ranks verify the same candidate in the same order). Each rank reads and
        checks its own copy; replicas get a manifest and size check, and are read and checksummed
        only for owners whose own copy failed. The ranks agree who can serve which shard, each
        fetches its shard (own copy or a verified replica) and checks it again on arrival."""
        iteration, me = candidate.iteration, parallel.rank()
        files = self._my_files(iteration)
        if (other := self._other_layout(files)) is not None:
            return NotForThisRun(f"saved under another parallel layout ({other}; this run: "
                                 f"{self.parallel_layout})")
        good: dict[int, SealedShard | None] = {}  # None: passed the cheap check, not read yet
        bad: dict[int, str] = {}
        for owner, path in sorted(files.items()):
            shard, why = (self._read_copy(path, iteration, owner) if owner == me
                          else (None, check_copy_cheaply(path, iteration, owner)))
            if why is None:
                good[owner] = shard
            else:
                bad[owner] = why
        reports = parallel.all_gather_object((sorted(good), bad))
        needed = {r for r in range(len(reports)) if r not in reports[r][0]}  # own copy failed
        for owner in sorted(needed & set(good)):
            shard, why = self._read_copy(files[owner], iteration, owner)
            if why is None:
                good[owner] = shard
            else:
                del good[owner]
                bad[owner] = why
        if needed:
            reports = parallel.all_gather_object((sorted(good), bad))
        for owner, why in bad.items():
            self._set_aside([files[owner]], f"copy of rank {owner}'s shard: {why}")
        self._log_bad_copies(iteration, reports)
        holders: dict[int, list[int]] = {}
        for rank, (owners, _) in enumerate(reports):
            for owner in owners:
                holders.setdefault(owner, []).append(rank)
        missing = [r for r in range(len(reports)) if r not in holders]
        if missing:  # the same on every rank: all gathered the same reports
            return None if me not in missing else self._no_copy_reason(me, reports)
        shard, sender = self._fetch(iteration, good, reports)
        why = shard.problem()
        if why is None:
            try:
                self._fetched = (iteration, shard.unseal())
            except CheckpointDataError as err:  # e.g. a crafted layer extra state: its own words
                why = str(err)
            except Exception as err:  # noqa: BLE001 - a verified copy that still does not unpickle
                why = f"unreadable after verification ({type(err).__name__}: {str(err)[:200]})"
        self._log_replica_use(iteration, sender)
        return None if why is None else f"copy of its shard received from rank {sender}: {why}"

    def _other_layout(self, files: dict[int, Path]) -> str | None:
        """Collective: the layout some rank's copies were saved under, if it is not this run's."""
        found = {saved_layout(path) for path in files.values()} - {None, self.parallel_layout}
        everywhere = sorted({layout for part in parallel.all_gather_object(sorted(found)) for layout in part})
        return everywhere[0] if everywhere else None

    def _no_copy_reason(self, me: int, reports) -> str:
        own = reports[me][1].get(me, "missing")
        others = [f"rank {r}: {bad[me]}" for r, (_, bad) in enumerate(reports) if me in bad and r != me]
        replicas = "; replicas: " + ", ".join(others) if others else (
            "; no replica" if self.manager.repl_strategy is None else "; no replica found")
        return f"no verified copy of its shard (own copy: {own}{replicas})"

    def _fetch(self, iteration: int, good: dict[int, SealedShard], reports) -> tuple[SealedShard, int]:
        """Collective: each rank gets its shard, its own copy or one from any rank that holds a verified
        copy (a clique replica, or its directory read on the node it was left on), over the world group."""
        me = parallel.rank()
        if all(rank in owners for rank, (owners, _) in enumerate(reports)):
            return good[me], me  # every rank holds its own: nothing moves
        ids = [[(iteration, owner, SESSION) for owner in owners] for owners, _ in reports]
        wanted = (iteration, me, SESSION)
        strategy = world_retrieval()
        plan = strategy.retrieve_plan(ids, [wanted])
        mine = {ckpt_id: good[ckpt_id[1]] for ckpt_id in plan.required_ids()}
        assert all(shard is not None for shard in mine.values()), "a sender's copy was not read"
        received = strategy.retrieve_execute(plan, mine)
        sender = next(e.sender for e in plan.entries if e.receiver == me)
        return received[wanted], sender

    def _log_bad_copies(self, iteration: int, reports) -> None:
        for rank, (_, bad) in enumerate(reports):
            for owner, why in bad.items():
                events.decision("quarantine", f"local iteration {iteration}: rank {rank}'s copy of rank "
                                f"{owner}'s shard rejected ({why}); moved to its {QUARANTINE_DIR}/ directory",
                                tier=self.name, iteration=iteration, rank=rank, owner=owner, reason=why)

    def _log_replica_use(self, iteration: int, sender: int) -> None:
        senders = parallel.all_gather_object(sender)
        moved = [f"rank {r} from rank {s}" for r, s in enumerate(senders) if s != r]
        if moved:
            events.decision("replica", f"local iteration {iteration}: shards fetched from replicas: "
                            + ", ".join(moved), tier=self.name, iteration=iteration)

    def saved_args(self, candidate: TierCandidate):
        assert self._fetched is not None and self._fetched[0] == candidate.iteration
        return self._fetched[1].common.get("args", {})

    def load(self, candidate: TierCandidate, sharded_template: dict) -> dict:
        iteration, state = self._fetched
        assert iteration == candidate.iteration
        self._fetched = None
        # megatron-core's broadcast exchange stages tensors on CUDA; its gather_object one does not.
        exchange = "broadcast" if torch.cuda.is_available() else "gather_object"
        return state.to_state_dict(sharded_template, algo=self.algo, exchange_algo=exchange,
                                   parallelization_group=_dp_group())

    def quarantine(self, candidate: TierCandidate, reason: str) -> None:
        self._fetched = None
        self._set_aside(list(self._my_files(candidate.iteration).values()), reason)
        self.manager.latest_iteration = -1
        events.decision("quarantine", f"local iteration {candidate.iteration}: every rank moved its "
                        f"files to <rank>/{QUARANTINE_DIR}/: {reason}; never loaded again",
                        tier=self.name, iteration=candidate.iteration, reason=reason)
        if dist.is_initialized():
            dist.barrier()

    def _set_aside(self, paths: list[Path], reason: str) -> None:
        """Move shards (with their manifests) out of NVRx's sight, keeping them for inspection."""
        if not paths:
            return
        target = self.my_dir / QUARANTINE_DIR
        target.mkdir(parents=True, exist_ok=True)  # this rank's directory may be on another node now
        for path in paths:
            for part in (path, Path(str(path) + MANIFEST_SUFFIX)):
                if part.exists():
                    os.replace(part, target / part.name)
            replace_file_text(str(target / (path.name + ".REASON.txt")),
                              untrusted.escape_untrusted(reason) + "\n")

    # ---- save side -------------------------------------------------------------------------
    def _seal(self, sharded_state: dict, iteration: int) -> SealedShard:
        state, _ = MCoreTensorAwareStateDict.from_state_dict(
            sharded_state, algo=self.algo, parallelization_group=_dp_group())
        state.copy_tensors_to_cpu(non_blocking=False)
        self.manager.latest_iteration = -1  # NVRx refuses iterations below its cache (after a rollback)
        shard = SealedShard.seal(state, iteration=iteration, owner=parallel.rank(), comm_device=comm_device())
        shard.meta["layout"] = self.parallel_layout
        return shard

    def save(self, sharded_state: dict, iteration: int) -> str:
        self._cleaned()
        shard = self._seal(sharded_state, iteration)
        self.manager.on_written = self.on_staged
        try:
            self.manager.save(shard, iteration)
            error = None
        except CheckpointingException as err:
            error = str(err)
        reported = parallel.all_gather_object(self.manager.write_failure)
        failures = [f"rank {r}: {f}" for r, f in enumerate(reported) if f]
        if error is not None:
            raise CheckpointSaveError(f"local checkpoint of iteration {iteration} is incomplete ("
                                      + ("; ".join(failures) or error) + ")")
        if failures:
            events.decision("save", f"local iteration {iteration} saved, but some copies failed: "
                            + "; ".join(failures), tier=self.name, iteration=iteration)
        return self._describe(iteration)

    def save_async(self, sharded_state: dict, iteration: int, host: HostStaging,
                   workers: str = "") -> AsyncSaveJob:
        """The trainer's part: the collective spread of the state over data-parallel ranks and the copy of
        this rank's share into `host`; nothing is serialised, checksummed, written or sent here. The worker
        seals, replicates and writes (seal_and_write); publishing checks every shard is on disk somewhere
        and only then lets NVRx drop the older iteration. `workers`: the workers' generation (AsyncSaves),
        the name of their replication group."""
        # The spread over data-parallel ranks of the last async save holds while the structure is the same
        # on every rank (one small all-reduce says so); megatron-core then skips its exchange and validation.
        structure = structure_of(sharded_state)
        kept = self._async_spread
        same = parallel.all_ranks_agree(kept is not None and kept[0] == structure)
        state, spread = MCoreTensorAwareStateDict.from_state_dict(
            sharded_state, algo=self.algo, parallelization_group=_dp_group(),
            cached_metadata=kept[1] if same else None)
        self._async_spread = (structure, spread)
        mine = [sh for sh in nested_values(state.sharded_state_dict)
                if isinstance(sh, ShardedTensor) and sh.data is not None]
        for sh, staged in zip(mine, host.stage([sh.data.detach() for sh in mine]), strict=True):
            if sh.data.device.type != "cpu":  # where the load puts it back (copy_tensors_to_cpu's record)
                sh.orig_device = sh.data.device.type
            sh.data = staged
        self.manager.latest_iteration = -1  # NVRx refuses iterations below its cache (after a rollback)
        me = parallel.rank()
        owners = [me]
        replication = None
        if self.replication is not None:
            owners = next(group for group in clique_groups(dist.get_world_size(), *self.replication)
                          if me in group)
            try:
                replication = WorkerReplication.for_this_job(workers, *self.replication,
                                                             timeout_s=self.async_timeout_s)
            except RuntimeError as err:  # the same store on every rank: every rank drops the save
                raise CheckpointSaveError(f"local iteration {iteration}: {err}") from None
        paths = {owner: (str(self.manager._local_ckpt_path_from_id((iteration, owner, SESSION))),
                         str(self.manager._local_ckpt_path_from_id((iteration, owner, SESSION), True)))
                 for owner in owners}
        work_args = (state, iteration, me, self.parallel_layout, str(self.my_dir), paths, replication)
        return AsyncSaveJob(iteration, seal_and_write, work_args, lambda _: self._publish_async(iteration),
                            lambda: self.manager._cleanup_failed_save(iteration))

    def _publish_async(self, iteration: int) -> str:
        self._cleaned()
        if self.on_staged is not None:
            self.on_staged(iteration)
        # NVRx's own completeness check (every rank's shard present), as its synchronous save does.
        self.manager.latest_iteration = -1
        complete = self.manager.find_latest()
        self.manager.latest_iteration = -1
        if complete < iteration:
            self.manager._cleanup_failed_save(iteration)
            raise CheckpointSaveError(f"local checkpoint of iteration {iteration} is incomplete "
                                      f"(newest complete iteration: {complete})")
        # Unlinking the older iteration's large files is left to a thread (as NVRx's async save does): the
        # trainer's share of a save stays its staging. Whatever lists this rank's files waits for it first.
        self._cleaner = threading.Thread(target=self.manager._cleanup, args=(iteration,),
                                         name="ckpt-local-cleanup", daemon=True)
        self._cleaner.start()
        return self._describe(iteration)

    def _cleaned(self) -> None:
        if self._cleaner is not None:
            self._cleaner.join()
            self._cleaner = None

    def startup_cleanup(self) -> None:
        removed, failures = 0, []
        try:
            names = {p.name for p in self.my_dir.iterdir() if p.is_file()} if self.my_dir.is_dir() else set()
        except OSError as err:
            names, failures = set(), [f"could not list {self.my_dir}: {err}"]
        for name in sorted(names):
            orphaned_manifest = name.endswith(MANIFEST_SUFFIX) and name[:-len(MANIFEST_SUFFIX)] not in names
            if ".dirty" in name or ".tmp." in name or orphaned_manifest:
                try:  # one rank's I/O error must not leave the others waiting in the gather below
                    (self.my_dir / name).unlink()
                    removed += 1
                except OSError as err:
                    failures.append(f"could not remove {self.my_dir / name}: {err}")
        outcomes = parallel.all_gather_object((removed, failures))
        counts = [count for count, _ in outcomes]
        if sum(counts):
            events.decision("cleanup", f"local tier: removed {sum(counts)} leftover(s) of interrupted "
                            "saves (.dirty shards, orphaned manifests); never loaded",
                            tier=self.name, per_rank=counts)
        failed = [f"rank {rank}: {why}" for rank, (_, whys) in enumerate(outcomes) for why in whys]
        if failed:
            events.decision("cleanup", f"local tier: left {len(failed)} leftover(s) in place (never loaded): "
                            + "; ".join(failed[:3]), tier=self.name)


def describe(root: str, iteration: int) -> str:
    """How a local iteration is named in logs: one file per rank directory."""
    return os.path.join(root, "<rank>", f"iter_{iteration:07d}_<rank>_local.pt")


def read_manifest(path: Path, iteration: int, owner: int) -> tuple[dict | None, str | None]:
    """The owner's account of a copy: (meta, None), (None, why), or (None, None) for a legacy
    shard without a manifest (saved by Megatron-LM)."""
    try:
        meta = json.loads(untrusted.read_text(str(path) + MANIFEST_SUFFIX, what="shard manifest"))
        meta = {k: int(meta[k]) for k in ("iteration", "owner", "size", "crc32")}
    except FileNotFoundError:
        return None, ("manifest missing" if _looks_like_ours(path) else None)
    except untrusted.CheckpointDataError as err:
        return None, str(err)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
        return None, f"manifest unparsable ({type(err).__name__})"
    if (meta["iteration"], meta["owner"]) != (iteration, owner):
        return None, (f"manifest is for rank {meta['owner']} iteration {meta['iteration']}, "
                      f"not rank {owner} iteration {iteration}")
    return meta, None


def saved_layout(path: Path) -> str | None:
    """The parallel layout a copy's owner recorded (None: unreadable, or saved before layouts were)."""
    try:
        manifest = untrusted.read_text(str(path) + MANIFEST_SUFFIX, what="shard manifest")
        layout = json.loads(manifest).get("layout")
    except (OSError, ValueError, AttributeError, RecursionError, untrusted.CheckpointDataError):
        return None
    return layout if isinstance(layout, str) else None


def check_copy_cheaply(path: Path, iteration: int, owner: int) -> str | None:
    """Manifest and size only, reading no data: for copies that may never be used."""
    meta, why = read_manifest(path, iteration, owner)
    if meta is None:
        return why
    try:
        size = path.stat().st_size
    except OSError as err:
        return f"unreadable ({err.strerror})"
    return None if size == meta["size"] else f"{size} bytes, its owner sealed {meta['size']}"


def read_copy(path: Path, iteration: int, owner: int, *, checksums: bool = True,
              max_bytes: int | None = None) -> tuple[SealedShard | None, str | None]:
    """A copy of `owner`'s shard as found on disk, checked against the owner's manifest: (shard, None) or
    (None, why). It is read whole into memory: `max_bytes` bounds it (what this run's state can take)."""
    meta, why = read_manifest(path, iteration, owner)
    if why is not None:
        return None, why
    try:
        payload = read_payload(path, max_bytes)
    except untrusted.CheckpointDataError as err:
        return None, str(err)
    except OSError as err:
        return None, f"unreadable ({err.strerror})"
    if meta is None:
        events.warn(f"{path} has no manifest (saved by Megatron-LM or an older megatron-resil); "
                    "it is loaded unverified")
        meta = {"iteration": iteration, "owner": owner, "size": payload.numel(),
                "crc32": crc32_of(payload.numpy())}
    shard = SealedShard(payload, meta, comm_device())
    if not checksums and payload.numel() == meta["size"]:
        return shard, None
    return (None, why) if (why := shard.problem()) else (shard, None)


def inspect_copies(root: str, checksums: bool = True) -> dict[int, dict[int, dict[int, str | None]]]:
    """Offline, for tools: {iteration: {owner: {holder rank: None or why}}} over every rank
    directory under `root` visible from this machine. Reads everything, changes nothing."""
    found: dict[int, dict[int, dict[int, str | None]]] = {}
    for rank_dir in sorted(Path(root).iterdir()) if Path(root).is_dir() else []:
        if not (rank_dir.is_dir() and rank_dir.name.isdigit()):
            continue
        for path, iteration, owner in _shard_files(rank_dir):
            _, why = read_copy(path, iteration, owner, checksums=checksums)
            found.setdefault(iteration, {}).setdefault(owner, {})[int(rank_dir.name)] = why
    return found


def _looks_like_ours(path: Path) -> bool:
    """A shard written by this tier always has a manifest: a sibling manifest means ours."""
    return any(p.name.endswith(MANIFEST_SUFFIX) for p in path.parent.iterdir())


def _dp_group():
    return parallel_state.get_data_parallel_group(with_context_parallel=True)
