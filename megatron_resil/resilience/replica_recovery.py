"""Same-step recovery (--recover-from-replicas): after an in-process restart, training goes on at the
iteration it was interrupted in, and reads no checkpoint.

Each process keeps its state at the last step it committed: the model's and optimizer's state dicts (their
tensors, not the objects, which hold the failed attempt's process groups), the scheduler, the RNG and the
progress. The commit is taken right after the optimizer step, so a failure in any collective after it (the
loss's reduction, a save) finds the committed state, and one before it (the gradients' reduction) finds the
previous one; nothing in between changes the parameters.

Under the distributed optimizer each rank holds only its shard of the optimizer's state (the fp32 main
parameters and Adam's moments); with --num-distributed-optimizer-instances 2 or more, the same shard sits on
the rank at the same place in every other instance, and that rank is its replica. The commit keeps the
shard's tensors too. The update of a shard is followed by a collective (the parameters' all-gather), so a
fault can find a rank between the two, its state neither the step before nor the step after: a hook on the
inner optimizer's step marks the rank as updating until its commit, and such a rank holds nothing (it
receives, like a reserve).

At the next attempt every rank has built a fresh engine. One collective gathers each rank's committed
iteration, its place in the model (pipeline, tensor and context parallel ranks, and its optimizer shard: the
replicas of one shard share it) and a digest of its model. The newest iteration is the target. A rank
behind it (a warm reserve that took a lost rank's place holds nothing; a rank that had not committed the
interrupted step is one behind) receives the whole state from the lowest rank of its replica set that
holds the target: a header (layout, dtypes, shapes and a SHA-256 per tensor, in JSON: nothing is
unpickled), then each tensor once.
Every tensor is checked before any rank applies anything; a problem anywhere and every rank falls back to
the newest checkpoint, with the reason in one line.

Fallback, decided alike on every rank from the gathered table (and said once, by rank 0):
- no rank holds a committed step (the failure came before the first);
- a replica set none of whose members holds the target (all replicas of a shard lost, or data-parallel
  size 1: nothing else holds a rank's state);
- replicas at the target whose models differ (the state is mixed);
- a rank whose state is suspect (a NaN or a weight-hash mismatch since its last load);
- a layout where a data-parallel peer is no replica (the distributed optimizer with one instance shards
  the optimizer's state, expert parallelism the experts): said at start-up (`arm`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import os
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_resil import events, parallel, phase_marks
from megatron_resil.progress import TrainProgress
from megatron_resil.resilience import restart_phases

# Test hooks. The sender of a transfer flips one byte of the first tensor it sends, after its checksum. A
# receiver kills its own process with SIGKILL once it has the header, if the file this names does not exist
# yet (it creates it first, so the fault strikes once in the job). "RANK:ITERATION:FILE": that rank kills
# its own process right after its optimizer has updated its state in that iteration, before the collective
# that follows (the distributed optimizer's all-gather), once in the job likewise. Hold, in the same form:
# that rank stops there instead, until the restart reaches it (a rank stalled inside its update).
CORRUPT_TRANSFER_ENV = "RESIL_TEST_CORRUPT_REPLICA_TRANSFER"
DIE_RECEIVING_ENV = "RESIL_TEST_DIE_RECEIVING_REPLICA_STATE"
DIE_AFTER_UPDATE_ENV = "RESIL_TEST_DIE_AFTER_UPDATE"
HOLD_AFTER_UPDATE_ENV = "RESIL_TEST_HOLD_AFTER_UPDATE"
_MAX_HEADER_BYTES = 64 << 20
_MAX_TENSORS = 1 << 20
_SLACK_BYTES = 64 << 20
# The state of a rank is at most this many times its model's bytes: fp32 main copies and Adam's two moments
# beside 16-bit weights are 7 times.
_STATE_PER_MODEL_BYTES = 8
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
_NUMPY_DTYPES = ("uint32", "int64", "float64")
_STATUS_FIELDS = 8  # iteration, suspect, updating, pipeline rank, tensor rank, context rank, optimizer shard,
# digest
_NONE = -1  # iteration of a rank that holds nothing (a reserve, or no step committed)
_REASON_BYTES = 400

generation = 0  # the in-process attempt this process is in (inprocess_restart sets it); 0: the first


@dataclasses.dataclass
class Kept:
    """A rank's state at a committed step: tensors and plain values, nothing that holds a process group."""
    iteration: int
    model: list  # each model chunk's state dict
    optimizer: object  # the optimizer's state dict
    scheduler: dict
    rng: dict
    progress: TrainProgress
    # per distributed optimizer, per parameter (in the optimizer's order): its shard's main parameter and
    # optimizer state ({"param": ..., "exp_avg": ..., ...}); empty without the distributed optimizer
    shards: list = dataclasses.field(default_factory=list)


class FallBack(Exception):
    """Same-step recovery cannot be done; the message says why."""


_kept: Kept | None = None
_suspect: str | None = None  # why this rank's kept state cannot be trusted, if it cannot
_updating = False  # the optimizer has begun an update this rank has not committed: its state is mixed


def arm(args: argparse.Namespace) -> str | None:
    """None if same-step recovery can work in this layout, else why not (the same on every rank)."""
    if args.data_parallel_size < 2:
        return ("data-parallel size 1: no other rank holds a copy of a rank's state (give more ranks than "
                "the model-parallel sizes use)")
    if args.use_distributed_optimizer and getattr(args, "num_distributed_optimizer_instances", 1) < 2:
        return ("the distributed optimizer with 1 instance shards the optimizer's state over the "
                "data-parallel ranks, so no other rank holds a rank's shard (give "
                "--num-distributed-optimizer-instances 2: each instance then holds a copy)")
    if args.expert_model_parallel_size > 1:
        return "expert parallelism: recovery of expert shards from their replicas is not built yet"
    return None


class Keeper:
    """The training loop's side: commits this rank's state after each step and each load."""

    def __init__(self, args: argparse.Namespace, model: list, optimizer, scheduler) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.why_not = _why_not(args, optimizer) if args.recover_from_replicas else "off"
        self.enabled = self.why_not is None
        if self.enabled:
            for leaf in _leaves(optimizer):
                leaf.optimizer.register_step_pre_hook(_begin_update)
                if os.environ.get(DIE_AFTER_UPDATE_ENV) or os.environ.get(HOLD_AFTER_UPDATE_ENV):
                    leaf.optimizer.register_step_post_hook(_fault_after_update_if_told)
        if args.recover_from_replicas and generation == 0:
            if self.enabled:
                events.decision("recovery", "same-step recovery on (--recover-from-replicas): after an "
                                "in-process restart the survivors keep their state and a rank that lost it "
                                "receives it from a data-parallel replica; training goes on at the "
                                "interrupted iteration, with no checkpoint read", armed=True)
            else:
                events.decision("recovery", f"same-step recovery off: {self.why_not}; a lost rank costs a "
                                "reload of the newest checkpoint, as without --recover-from-replicas",
                                armed=False, reason=self.why_not)

    @property
    def step_hook(self):
        """What train_step calls right after the optimizer step: None (nothing at all) when off."""
        return self.committed if self.enabled else None

    def committed(self, progress: TrainProgress) -> None:
        """`progress` is where this rank's state now stands (a step taken, or a checkpoint loaded)."""
        global _kept, _suspect, _updating
        if not self.enabled:
            return
        _suspect, _updating = None, False
        if any(_is_sharded(leaf) and not leaf.optimizer.state for leaf in _leaves(self.optimizer)):
            _kept = None  # a distributed optimizer before its first step has no state to give (nor to say)
            return
        rng = parallel.rng_state()
        rng["rng_tracker_states"] = {k: v.clone() for k, v in rng["rng_tracker_states"].items()}
        _kept = Kept(progress.iteration, [chunk.state_dict() for chunk in self.model],
                     self.optimizer.state_dict(), copy.deepcopy(self.scheduler.state_dict()), rng,
                     dataclasses.replace(progress), _shard_states(self.optimizer))

    def suspect(self, why: str) -> None:
        """This rank's state may be bad (a NaN, replicas that differ): no peer may receive it."""
        global _suspect
        if self.enabled:
            _suspect = why


def _why_not(args: argparse.Namespace, optimizer) -> str | None:
    """arm's answer, or what this optimizer lacks (the same on every rank)."""
    if (why := arm(args)) is not None:
        return why
    for leaf in _leaves(optimizer):
        if not hasattr(getattr(leaf, "optimizer", None), "register_step_pre_hook"):
            return f"the optimizer {type(leaf).__name__} has no torch optimizer inside to watch for updates"
        if _is_sharded(leaf) and not all(hasattr(leaf, name) for name in _SHARD_API):
            return (f"this megatron-core's {type(leaf).__name__} lacks {', '.join(_SHARD_API)}, through "
                    "which a rank's optimizer shard is kept and restored")
    return None


# The distributed optimizer's own accessors of one parameter's shard (main parameter and optimizer state),
# which its checkpoint loaders use too; checked for at start-up.
_SHARD_API = ("model_param_group_index_map", "_get_main_param_and_optimizer_states",
              "_set_main_param_and_optimizer_states")


def _leaves(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_sharded(leaf) -> bool:
    return type(leaf).__name__ == "DistributedOptimizer"


def _begin_update(*_) -> None:
    global _updating
    _updating = True


def _shard_states(optimizer) -> list:
    """References to each distributed optimizer's shard tensors, per parameter in its own order. Detached:
    a main parameter can be a view of the model's parameter, whose hooks hold the engine, and so its
    process groups, which must go with the failed attempt (on gloo, that is what releases a blocked peer)."""
    return [[{k: v.detach() for k, v in leaf._get_main_param_and_optimizer_states(p).items()}
             for p in leaf.model_param_group_index_map]
            for leaf in _leaves(optimizer) if _is_sharded(leaf)]


@torch.no_grad()  # a main parameter can be a view of a model parameter, which requires grad
def _apply_shards(optimizer, shards: list) -> None:
    for leaf, states in zip([x for x in _leaves(optimizer) if _is_sharded(x)], shards, strict=True):
        for param, tensors in zip(leaf.model_param_group_index_map, states, strict=True):
            leaf._set_main_param_and_optimizer_states(param, tensors)


def _shard_index(optimizer) -> int:
    """This rank's place in the group its distributed optimizer shards over (0 without one): the ranks of
    one place in every instance hold the same shard."""
    for leaf in _leaves(optimizer):
        if _is_sharded(leaf):
            return dist.get_rank(group=leaf.data_parallel_group)
    return 0


def recover(args: argparse.Namespace, model: list, optimizer, scheduler) -> TrainProgress | None:
    """At an in-process restart with --recover-from-replicas: this rank's state restored, from itself or a
    replica, and the progress to go on from; None (on every rank alike) to load a checkpoint instead.
    Collective."""
    global _kept
    if not args.recover_from_replicas or generation == 0 or _why_not(args, optimizer) is not None:
        return None
    started = time.time()
    table = _gather_status(optimizer)
    try:
        target, transfers = plan(table)
    except FallBack as err:
        _say_fallback(str(err))
        return None
    phase_marks.mark("chosen")
    rank = parallel.rank()
    own, moved, why = _kept, {"bytes": 0, "tensors": 0}, ""
    try:
        own = _exchange(transfers, rank, own, model, moved)
        _check_model_layout(own, model, rank)
        _check_shard_layout(own, optimizer, rank)
    except FallBack as err:  # every rank's reason is gathered: all fall back together
        why = str(err)
    if (why := _first_reason(why)) is not None:
        _say_fallback(f"a transfer failed its check ({why})")
        return None
    for chunk, state in zip(model, own.model, strict=True):
        chunk.load_state_dict(state)
    optimizer.load_state_dict(own.optimizer)
    _apply_shards(optimizer, own.shards)  # after load_state_dict, which allocates the shards' state
    scheduler.load_state_dict(own.scheduler)
    parallel.set_rng_state(own.rng)
    progress = dataclasses.replace(own.progress)
    _kept = None  # the old engine's tensors go with it; the new engine commits its own
    phase_marks.mark("loaded")  # the "load" phase of this attempt's restart_phases is the transfer
    restart_phases.attempt_detail("same_step", True)
    moved = _sum_over_ranks(moved)
    received = sorted({dst for _, dst in transfers})
    how = ("; ".join(f"rank {dst} receives its state from rank {src}" for src, dst in transfers)
           if transfers else "no rank had lost its state")
    events.decision("recovery", f"same-step recovery at iteration {target}: {how} "
                    f"({moved['bytes'] / 1e6:.1f} MB in {moved['tensors']} tensors, each checked); the other "
                    f"ranks keep their own; no checkpoint read; training goes on at iteration {target + 1} "
                    f"({time.time() - started:.2f} s)",
                    iteration=target, receivers=received, transfers=[list(t) for t in transfers],
                    bytes=moved["bytes"], tensors=moved["tensors"], seconds=round(time.time() - started, 3))
    return progress


def plan(table: list[list[int]]) -> tuple[int, list[tuple[int, int]]]:
    """From every rank's status row: the iteration to go on from, and the (source, receiver) transfers,
    in order. FallBack when no live replica can give a behind rank the state."""
    suspect = [r for r, row in enumerate(table) if row[1]]
    if suspect:
        raise FallBack(f"the state of rank{'s' if len(suspect) > 1 else ''} "
                       f"{', '.join(map(str, suspect))} is suspect (a step rejected, or replicas that "
                       "differed, since the last load)")
    held = [_NONE if row[2] else row[0] for row in table]  # a rank caught in an update holds nothing
    target = max(held)
    if target == _NONE:
        raise FallBack("no rank holds a committed step (the failure came before the first, or inside every "
                       "rank's update)")
    sets: dict[tuple, list[int]] = {}
    for r, row in enumerate(table):
        sets.setdefault(tuple(row[3:7]), []).append(r)
    transfers = []
    for key, members in sets.items():
        holders = [r for r in members if held[r] == target]
        if not holders:
            updating = [r for r in members if table[r][2]]
            raise FallBack(f"no live replica of the shard at pipeline rank {key[0]}, tensor rank {key[1]}, "
                           f"context rank {key[2]}, optimizer shard {key[3]} holds iteration {target} (ranks "
                           f"{members} hold {sorted({held[r] for r in members})}"
                           + (f", ranks {updating} caught inside an update" if updating else "")
                           + "; every replica of it was lost)")
        if len({table[r][7] for r in holders}) > 1:
            raise FallBack(f"the replicas {holders} of one shard hold different models at iteration "
                           f"{target}: the state is mixed")
        transfers += [(holders[0], r) for r in members if table[r][0] != target]
    return target, sorted(transfers, key=lambda t: (t[1], t[0]))


def _gather_status(optimizer) -> list[list[int]]:
    kept = _kept
    row = [kept.iteration if kept is not None else _NONE, 1 if _suspect else 0, 1 if _updating else 0,
           parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
           parallel_state.get_context_parallel_rank(), _shard_index(optimizer),
           _digest(kept) if kept is not None else 0]
    mine = torch.tensor(row, dtype=torch.int64, device=parallel.device())
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def _digest(kept: Kept) -> int:
    """The model's bytes, hashed to a signed 63-bit number (replicas at one step hold equal models)."""
    h = hashlib.sha256()
    for state in kept.model:
        for name in sorted(state):
            if isinstance(state[name], torch.Tensor):
                h.update(name.encode())
                h.update(_bytes_of(state[name]))
    return int.from_bytes(h.digest()[:8], "big") >> 1


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


# ---- the transfer -------------------------------------------------------------------------------------

def _exchange(transfers: list[tuple[int, int]], rank: int, own: Kept | None, model: list,
              moved: dict) -> Kept | None:
    """This rank's state afterwards (received, or its own). Each step is agreed on by every rank before
    the next, so that no rank waits for a message that will not come: the sources encode their state
    (once, whatever the number of receivers), then the headers go and are checked by their receivers,
    then the tensors go, and each is checked. Collective."""
    outgoing: tuple[dict, list[torch.Tensor]] | None = None
    why = ""
    if any(src == rank for src, _ in transfers):
        try:
            outgoing = _encode(own)
        except FallBack as err:
            why = f"rank {rank}: {err}"
    if (agreed := _first_reason(why)) is not None:
        raise FallBack(agreed)
    received: dict | None = None
    for src, dst in transfers:
        if rank == src:
            _send_header(outgoing[0], dst)
        elif rank == dst:
            try:
                received = _receive_header(src, _limit_bytes(model))
            except FallBack as err:
                why = f"rank {rank}: the header from rank {src}: {err}"
    if (agreed := _first_reason(why)) is not None:
        raise FallBack(agreed)
    if received is not None:
        _die_once_if_told()
    tensors: list[torch.Tensor] = []
    for src, dst in transfers:
        if rank == src:
            header, payload = outgoing
            for i, tensor in enumerate(payload):
                tensor = tensor.detach().to(parallel.device()).contiguous()
                if i == 0 and os.environ.get(CORRUPT_TRANSFER_ENV) == "1" and tensor.numel():
                    tensor = tensor.clone()
                    tensor.view(-1).view(torch.uint8)[0] ^= 0xFF
                dist.send(tensor, dst)
            moved["bytes"] += header["bytes"]
            moved["tensors"] += len(payload)
        elif rank == dst:
            for entry in received["header"]["tensors"]:
                buffer = torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]], device=parallel.device())
                dist.recv(buffer, src)
                tensors.append(buffer.cpu() if buffer.is_cuda else buffer)
    if received is None:
        return own
    for i, (entry, tensor) in enumerate(zip(received["header"]["tensors"], tensors, strict=True)):
        if hashlib.sha256(_bytes_of(tensor)).hexdigest() != entry["sha256"]:
            raise FallBack(f"rank {rank}: tensor {i} of the state from rank {received['src']} "
                           f"({entry['path']}) does not match its checksum")
    return _decode(received["header"]["skeleton"], tensors)


def _die_once_if_told() -> None:
    marker = os.environ.get(DIE_RECEIVING_ENV)
    if marker:
        _die_once(marker, f"rank {parallel.rank()} is killed while it receives its state "
                  f"({DIE_RECEIVING_ENV})")


def _fault_after_update_if_told(*_) -> None:
    updating = (_kept.iteration if _kept is not None else 0) + 1
    for env, what in ((DIE_AFTER_UPDATE_ENV, "is killed"),
                      (HOLD_AFTER_UPDATE_ENV, "stops until the restart")):
        if not os.environ.get(env):
            continue
        rank, iteration, marker = os.environ[env].split(":", 2)
        if parallel.rank() == int(rank) and updating == int(iteration):
            said = (f"rank {rank} {what} right after its optimizer updated its state in iteration "
                    f"{iteration} ({env})")
            if env == DIE_AFTER_UPDATE_ENV:
                _die_once(marker, said)
            elif _first_time(marker):
                print(f"[resil] fault: {said}", flush=True)
                while True:  # NVRx's RankShouldRestart ends it, raised into this thread
                    time.sleep(0.01)


def _first_time(marker: str) -> bool:
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def _die_once(marker: str, said: str) -> None:
    if not _first_time(marker):
        return
    print(f"[resil] fault: {said}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _limit_bytes(model: list) -> int:
    own = sum(p.numel() * p.element_size() for chunk in model for p in chunk.parameters())
    return _STATE_PER_MODEL_BYTES * own + _SLACK_BYTES


def _encode(kept: Kept) -> tuple[dict, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []
    paths: list[str] = []
    state = {"iteration": kept.iteration, "model": kept.model, "optimizer": kept.optimizer,
             "scheduler": kept.scheduler, "rng": kept.rng, "progress": dataclasses.asdict(kept.progress),
             "shards": kept.shards}
    skeleton = _flatten(state, tensors, paths, "state")
    entries = [{"path": path, "shape": list(t.shape), "dtype": str(t.dtype),
                "sha256": hashlib.sha256(_bytes_of(t)).hexdigest()} for path, t in zip(paths, tensors,
                                                                                      strict=True)]
    header = {"skeleton": skeleton, "tensors": entries,
              "bytes": sum(t.numel() * t.element_size() for t in tensors)}
    return header, tensors


def _flatten(value, tensors: list, paths: list, path: str):
    """JSON with every container tagged, and each tensor (or numpy array) replaced by its index."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        paths.append(path)
        return {"t": len(tensors) - 1}
    if isinstance(value, np.ndarray):
        if str(value.dtype) not in _NUMPY_DTYPES:
            raise FallBack(f"{path}: a numpy array of {value.dtype} cannot be sent")
        tensors.append(torch.from_numpy(value.astype(np.int64)))
        paths.append(path)
        return {"n": len(tensors) - 1, "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {"d": [[_flatten(k, tensors, paths, f"{path}.key"), _flatten(v, tensors, paths, f"{path}.{k}")]
                      for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"l" if isinstance(value, list) else "u":
                [_flatten(v, tensors, paths, f"{path}[{i}]") for i, v in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    raise FallBack(f"{path}: a {type(value).__name__} cannot be sent")


def _decode(skeleton, tensors: list[torch.Tensor]) -> Kept:
    state = _unflatten(skeleton, tensors)
    if not isinstance(state, dict) or set(state) != {"iteration", "model", "optimizer", "scheduler", "rng",
                                                     "progress", "shards"}:
        raise FallBack("the state received is not a rank's state")
    try:
        progress = TrainProgress(**state["progress"])
    except TypeError as err:
        raise FallBack(f"the progress received does not fit: {err}") from None
    return Kept(state["iteration"], state["model"], state["optimizer"], state["scheduler"], state["rng"],
                progress, state["shards"])


def _unflatten(node, tensors: list[torch.Tensor]):
    if not isinstance(node, dict) or len(node) not in (1, 2):
        raise FallBack("malformed header")
    if "t" in node:
        return tensors[_index(node["t"], tensors)]
    if "n" in node:
        if node.get("dtype") not in _NUMPY_DTYPES:
            raise FallBack("malformed header: numpy dtype")
        return tensors[_index(node["n"], tensors)].numpy().astype(node["dtype"])
    (tag, items), = node.items()
    if tag == "v":
        if items is not None and not isinstance(items, (bool, int, float, str)):
            raise FallBack("malformed header: value")
        return items
    if not isinstance(items, list):
        raise FallBack("malformed header: container")
    if tag == "d":
        if not all(isinstance(pair, list) and len(pair) == 2 for pair in items):
            raise FallBack("malformed header: dict")
        out = {}
        for key, value in items:
            key = _unflatten(key, tensors)
            if not isinstance(key, (int, str)):
                raise FallBack("malformed header: dict key")
            out[key] = _unflatten(value, tensors)
        return out
    if tag in ("l", "u"):
        values = [_unflatten(v, tensors) for v in items]
        return values if tag == "l" else tuple(values)
    raise FallBack("malformed header: tag")


def _index(i, tensors: list) -> int:
    if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(tensors):
        raise FallBack("malformed header: tensor index")
    return i


def _send_header(header: dict, dst: int) -> None:
    data = json.dumps(header, allow_nan=True).encode()
    dist.send(torch.tensor([len(data), len(header["tensors"]), header["bytes"]], dtype=torch.int64,
                           device=parallel.device()), dst)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(parallel.device()), dst)


def _receive_header(src: int, limit: int) -> dict:
    sizes = torch.empty(3, dtype=torch.int64, device=parallel.device())
    dist.recv(sizes, src)
    length, count, total = sizes.tolist()
    if not (0 < length <= _MAX_HEADER_BYTES and 0 <= count <= _MAX_TENSORS and 0 <= total <= limit):
        # What the sender sends next cannot be received safely: nothing more is read, and every rank falls
        # back (the sender's sends end with the process groups).
        raise FallBack(f"{length} header bytes, {count} tensors, {total} bytes: beyond the bounds "
                       f"({_MAX_HEADER_BYTES}, {_MAX_TENSORS}, {limit})")
    data = torch.empty(length, dtype=torch.uint8, device=parallel.device())
    dist.recv(data, src)
    try:
        header = json.loads(bytes(data.cpu().numpy()))
    except ValueError as err:
        raise FallBack(f"unreadable header ({err})") from None
    entries = header.get("tensors") if isinstance(header, dict) else None
    if not isinstance(entries, list) or len(entries) != count or header.get("bytes") != total:
        raise FallBack("the header does not match its sizes")
    declared = 0
    for entry in entries:
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)
                and entry.get("dtype") in _DTYPES and isinstance(entry.get("sha256"), str)
                and isinstance(entry.get("path"), str)):
            raise FallBack("a malformed tensor entry")
        declared += int(np.prod(shape, dtype=np.int64)) * _DTYPES[entry["dtype"]].itemsize
    if declared != total:
        raise FallBack(f"the tensors declared hold {declared} bytes, not {total}")
    return {"src": src, "header": header}


def _check_model_layout(kept: Kept | None, model: list, rank: int) -> None:
    """The state to apply fits this rank's freshly built model: the same names, shapes and dtypes."""
    if kept is None:
        raise FallBack(f"rank {rank}: no state to apply")
    if len(kept.model) != len(model):
        raise FallBack(f"rank {rank}: {len(kept.model)} model chunks, not {len(model)}")
    for chunk, state in zip(model, kept.model, strict=True):
        expected = {k: (tuple(v.shape), v.dtype) for k, v in chunk.state_dict().items()
                    if isinstance(v, torch.Tensor)}
        got = {k: (tuple(v.shape), v.dtype) for k, v in state.items() if isinstance(v, torch.Tensor)}
        if expected != got:
            diff = sorted(set(expected.items()) ^ set(got.items()))[:3]
            raise FallBack(f"rank {rank}: the model state does not fit this model (first differences: "
                           f"{diff})")


def _check_shard_layout(kept: Kept, optimizer, rank: int) -> None:
    """The optimizer shards to apply fit this rank's distributed optimizers: as many parameters, each
    state tensor shaped as its main parameter's shard."""
    leaves = [leaf for leaf in _leaves(optimizer) if _is_sharded(leaf)]
    if not isinstance(kept.shards, list) or len(kept.shards) != len(leaves):
        raise FallBack(f"rank {rank}: optimizer shards for {len(kept.shards)} distributed optimizers, "
                       f"not {len(leaves)}")
    for leaf, states in zip(leaves, kept.shards, strict=True):
        index = leaf.model_param_group_index_map
        if not isinstance(states, list) or len(states) != len(index):
            raise FallBack(f"rank {rank}: an optimizer shard of {len(states)} parameters, not {len(index)}")
        for (group, order), tensors in zip(index.values(), states, strict=True):
            main = leaf.optimizer.param_groups[group]["params"][order]
            if not (isinstance(tensors, dict) and "param" in tensors and all(
                    isinstance(t, torch.Tensor) and (t.numel() == 1 if k == "step" else t.shape == main.shape)
                    for k, t in tensors.items())):
                raise FallBack(f"rank {rank}: an optimizer shard does not fit this rank's (a main parameter "
                               f"of {tuple(main.shape)})")


def _first_reason(why: str) -> str | None:
    """Every rank's reason (empty: none), gathered: the lowest rank's, or None if no rank has one.
    Collective, so every rank takes the same branch."""
    mine = torch.zeros(_REASON_BYTES, dtype=torch.uint8, device=parallel.device())
    data = why.encode()[:_REASON_BYTES]
    mine[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    for t in out:
        text = bytes(t.cpu().numpy()).rstrip(b"\0").decode(errors="replace")
        if text:
            return text
    return None


def _sum_over_ranks(moved: dict) -> dict:
    t = torch.tensor([moved["bytes"], moved["tensors"]], dtype=torch.int64, device=parallel.device())
    dist.all_reduce(t)
    return {"bytes": int(t[0]), "tensors": int(t[1])}


def _say_fallback(why: str) -> None:
    global _kept
    _kept = None
    events.decision("recovery", f"same-step recovery not possible: {why}; every rank loads the newest "
                    "checkpoint instead", reason=why)
