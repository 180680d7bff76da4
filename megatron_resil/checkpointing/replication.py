"""Replica groups for the local tier: NVRx's CliqueReplicationStrategy over a group wrapper whose
point-to-point transfer works on gloo as well as NCCL.

NVRx 0.4.1 sends and receives shards during retrieval through `.cuda()` tensors, so on CPU a lost
rank's shard could never be fetched from its replica. Here the tensors travel on the device the
process group supports: the CPU for gloo, the current GPU for NCCL.

An async local save replicates in the background workers, over a gloo process group of their own
(WorkerReplication): the workers meet in the trainers' store under a name that changes whenever any
rank's worker is replaced, so a new worker never joins a group its predecessor left half-used.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import (
    GroupWrapper,
    parse_group_sequence,
)
from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
    CliqueReplicationStrategy,
)

from megatron_resil import group_connections


def comm_device() -> str:
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"


class _PointToPointGroup(GroupWrapper):
    """Overrides NVRx's transfer methods, checked at start-up against the installed NVRx (patches/nvrx.py)."""

    def isend_state_dict(self, state_dict, dst: int) -> dict:
        tensors = state_dict.pop_tensors()  # already on the communication device
        self.send_object(state_dict, dst)
        for tensor in tensors:
            dist.send(tensor, dst, group=self.group)
        state_dict.insert_tensors(tensors)
        state_dict.copy_tensors_to_cpu()
        return {"data_sent": sum(t.nbytes for t in tensors)}

    def irecv_state_dict(self, src: int):
        received = self.recv_object(src)
        received.init_tensors()  # empty tensors on the communication device
        for tensor in received.tensors:
            dist.recv(tensor, src, group=self.group)
        received.copy_tensors_to_cpu()
        return received, {"data_recv": sum(t.nbytes for t in received.tensors)}


def clique_groups(world_size: int, jump: int, factor: int) -> list[list[int]]:
    """Ranks n, n+J, ..., n+(F-1)J hold each other's shards (NVRx's layout)."""
    return parse_group_sequence(replication_jump=jump, replication_factor=factor, world_size=world_size)


def build_clique_strategy(jump: int, factor: int) -> CliqueReplicationStrategy:
    """Collective: every rank creates every clique's group (torch requires it), then keeps its own."""
    mine = None
    for ranks in clique_groups(dist.get_world_size(), jump, factor):
        group = group_connections.new_group(ranks)  # an abort ends a replication blocked with a hung peer
        if dist.get_rank() in ranks:
            mine = group
    assert mine is not None
    return CliqueReplicationStrategy(_PointToPointGroup(mine), target_device="cpu")


def world_retrieval() -> CliqueReplicationStrategy:
    """NVRx's retrieval over every rank: a shard may come from any rank holding a verified copy, not only
    from its clique (a directory read on the node its rank was moved off, local_tier._find_left_behind)."""
    return CliqueReplicationStrategy(_PointToPointGroup(dist.group.WORLD), target_device="cpu")


@dataclass(frozen=True)
class WorkerReplication:
    """Where and how the async workers of a job form their replication group (pickled to each worker)."""
    host: str  # the trainers' TCP store, which every rank's worker can reach
    port: int
    name: str  # the key prefix of this generation of workers
    rank: int
    world_size: int
    jump: int
    factor: int
    timeout_s: float

    @classmethod
    def for_this_job(cls, generation: str, jump: int, factor: int,
                     timeout_s: float = 600.0) -> WorkerReplication:
        """In the trainer: the workers of `generation` (AsyncSaves' name for the current set of workers)."""
        host, port = trainers_store()
        return cls(host, port, f"resil-ckpt-workers/{generation}", dist.get_rank(), dist.get_world_size(),
                   jump, factor, timeout_s)

    def strategy(self) -> CliqueReplicationStrategy:
        """In the worker: the clique replication over the workers' gloo group, formed at its first use and
        formed again under a new generation (collective among the workers)."""
        global _worker_group
        if _worker_group is None or _worker_group[0] != self.name:
            if dist.is_initialized():
                dist.destroy_process_group()
            timeout = datetime.timedelta(seconds=self.timeout_s)
            store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)
            dist.init_process_group("gloo", store=dist.PrefixStore(self.name, store), rank=self.rank,
                                    world_size=self.world_size, timeout=timeout)
            _worker_group = (self.name, build_clique_strategy(self.jump, self.factor))
        return _worker_group[1]


_worker_group: tuple[str, CliqueReplicationStrategy] | None = None  # the worker's (generation, strategy)


def trainers_store() -> tuple[str, int]:
    """(host, port) of the TCP store under this trainer's default process group (torchrun's, Slurm's or an
    in-process restart attempt's, each a TCPStore under prefixes)."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        raise RuntimeError(f"the process group's store is a {type(store).__name__}, not a TCP store: the "
                           "background workers cannot meet there to replicate")
    return store.host, store.port
