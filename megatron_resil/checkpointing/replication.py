"""Replica groups for the local tier: NVRx's CliqueReplicationStrategy over a group wrapper whose
point-to-point transfer works on gloo as well as NCCL.

NVRx 0.4.1 sends and receives shards during retrieval through `.cuda()` tensors, so on CPU a lost
rank's shard could never be fetched from its replica. Here the tensors travel on the device the
process group supports: the CPU for gloo, the current GPU for NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import (
    GroupWrapper,
    parse_group_sequence,
)
from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
    CliqueReplicationStrategy,
)


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
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    assert mine is not None
    return CliqueReplicationStrategy(_PointToPointGroup(mine), target_device="cpu")
