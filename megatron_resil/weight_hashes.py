"""Silent divergence of data-parallel replicas (--check-weight-hash-across-dp-replicas-interval): every N
iterations each rank hashes its weights and compares them with its data-parallel peers'. Replicas must hold
identical weights; a mismatch (a silent data corruption, or a bug) stops the run without saving, with exit
code 1, as Megatron-LM's assertion does, after one decision line naming the first differing weight.

The algorithm is megatron-core's check_param_hashes_across_dp_replicas (SHA-1 of each weight, gathered over
the data-parallel group, the experts' over theirs); it is repeated here because that function moves the
hashes with `.cuda()`, which has no CPU meaning.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_resil import events, parallel


def _hash(param: torch.Tensor) -> torch.Tensor:
    digest = hashlib.sha1(param.detach().to("cpu").float().numpy(force=True).tobytes()).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def first_mismatch(chunks: list) -> str | None:
    """Collective on every rank: the name of the first weight whose hash differs between data-parallel
    replicas (the same answer on every rank), or None."""
    named = [(f"chunk {i}: {name}", param) for i, chunk in enumerate(chunks)
             for name, param in chunk.named_parameters()]
    groups = ((False, parallel_state.get_data_parallel_group()),
              (True, parallel_state.get_expert_data_parallel_group()))
    found = torch.zeros(1, dtype=torch.int64, device=parallel.device())
    first = None
    for expert, group in groups:
        params = [(name, p) for name, p in named if (not getattr(p, "allreduce", True)) == expert]
        if not params or dist.get_world_size(group) == 1:
            continue
        local = torch.stack([_hash(p) for _, p in params]).to(parallel.device())
        gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        differs = torch.stack([(g != local).any(dim=1) for g in gathered]).any(dim=0)
        if differs.any() and first is None:
            first = params[int(differs.nonzero()[0])][0]
            found += 1
    dist.all_reduce(found)  # a rank whose own replicas agree still stops with the others
    if not found.item():
        return None
    return first or "a weight of another data-parallel group"


def check(chunks: list, iteration: int) -> None:
    """Stop the run (exit code 1, no save) when the replicas' weights differ."""
    name = first_mismatch(chunks)
    if name is None:
        events.print_rank_0(f">>> Weight hashes match after {iteration} iterations...")  # Megatron-LM's line
        return
    events.decision("exit", f"weight hashes differ across data-parallel replicas at iteration {iteration} "
                    f"({name}); stopping without a save, exit code 1", iteration=iteration, exit_code=1)
    raise SystemExit(1)
