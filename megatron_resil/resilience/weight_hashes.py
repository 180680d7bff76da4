"""Silent divergence of data-parallel replicas (--check-weight-hash-across-dp-replicas-interval): before
training and every N iterations each rank hashes its weights and compares them with its data-parallel
peers'. Replicas must hold identical weights; when they do not (a silent data corruption, or a bug), one
decision line names the ranks that differ (by majority of the replicas, where there is one) and the first
weight that differs, and the rerun mode decides as it does for a result that fails validation:

    validate_results (default)  the state is corrupted: stop without saving, exit 17 (do not requeue)
    report_determinism_stats    report it and train on
    disabled                    raise, as Megatron-LM's assertion does (no save; exit 1 without a record)

The hashes are megatron-core's check_param_hashes_across_dp_replicas (SHA-1 of each weight, gathered over
the data-parallel group, the experts' over theirs); repeated here because that function moves the hashes
with `.cuda()`, which has no CPU meaning, and only says whether this rank's differ.
"""

from __future__ import annotations

import hashlib
import socket
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

from megatron_resil import events, exit_codes, parallel
from megatron_resil.resilience import rerun

VERDICT = "weights-differ"  # the `verdict` of the `rerun` event


@dataclass(frozen=True)
class Divergence:
    """One data-parallel group whose replicas' weights differ, in global ranks."""

    group: tuple[int, ...]
    odd: tuple[int, ...]  # outside the majority; the whole group when no majority holds one copy
    majority: bool
    weight: str  # the first weight (in the model's order) whose hashes differ

    def describe(self, hosts: dict[int, str]) -> str:
        def who(ranks: Sequence[int]) -> str:
            return ", ".join(f"{r} ({hosts.get(r, '?')})" for r in ranks)

        if self.majority:
            agree = [r for r in self.group if r not in self.odd]
            odd = f"rank {who(self.odd)} is the odd one out" if len(self.odd) == 1 \
                else f"ranks {who(self.odd)} are the odd ones out"
            what = f"{odd} (ranks {', '.join(map(str, agree))} agree)"
        elif len(self.group) == 2:
            what = f"ranks {who(self.group[:1])} and {who(self.group[1:])} disagree (two replicas: no " \
                   "majority says which is right)"
        else:
            what = f"ranks {who(self.group)} disagree with no majority"
        return f"{what}; first differing weight: {self.weight}"


def compare(group: Sequence[int], hashes: Sequence[Sequence[bytes]],
            names: Sequence[str]) -> Divergence | None:
    """The divergence of one data-parallel group (None if its replicas agree): `group`, its global ranks;
    `hashes[i]`, member i's hash of each weight, in the order of `names`."""
    copies = Counter(tuple(h) for h in hashes)
    if len(copies) == 1:
        return None
    first = next(names[w] for w in range(len(names)) if len({h[w] for h in hashes}) > 1)
    common, count = copies.most_common(1)[0]
    if 2 * count > len(group):
        odd = tuple(rank for rank, h in zip(group, hashes, strict=True) if tuple(h) != common)
        return Divergence(tuple(group), odd, True, first)
    return Divergence(tuple(group), tuple(group), False, first)


def _hash(param: torch.Tensor) -> torch.Tensor:
    digest = hashlib.sha1(param.detach().to("cpu").float().numpy(force=True).tobytes()).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def divergences(chunks: list) -> tuple[list[Divergence], dict[int, str]]:
    """Collective on every rank: the divergent groups of the whole job and the hosts of its ranks (global
    rank -> host), the same on every rank, so every rank takes the same decision. ([], {}) when all agree."""
    named = [(f"{name} (model chunk {i})", param) for i, chunk in enumerate(chunks)
             for name, param in chunk.named_parameters()]
    groups = ((False, parallel_state.get_data_parallel_group()),
              (True, parallel_state.get_expert_data_parallel_group()))
    found = []
    for expert, group in groups:
        params = [(name, p) for name, p in named if (not getattr(p, "allreduce", True)) == expert]
        if not params or dist.get_world_size(group) == 1:
            continue
        local = torch.stack([_hash(p) for _, p in params]).to(parallel.device())
        gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        hashes = [[row.tobytes() for row in g.cpu().numpy()] for g in gathered]
        if (divergence := compare(dist.get_process_group_ranks(group), hashes, [n for n, _ in params])):
            found.append(divergence)
    if not parallel.any_rank(bool(found)):  # the other groups' news reaches every rank
        return [], {}
    everyone = parallel.all_gather_object((socket.gethostname(), found))
    hosts = {rank: host for rank, (host, _) in enumerate(everyone)}
    return list(dict.fromkeys(d for _, mine in everyone for d in mine)), hosts  # one per group


def check(chunks: list, iteration: int) -> rerun.RerunStop | None:
    """Collective on every rank: compare the replicas' weights after `iteration` (0: before training).
    None when they agree, or when --rerun-mode report_determinism_stats reported that they do not; else
    the stop that ends the run without a save (exit 17). --rerun-mode disabled raises instead."""
    found, hosts = divergences(chunks)
    if not found:
        events.print_rank_0(f">>> Weight hashes match after {iteration} iterations...")  # Megatron-LM's line
        return None
    what = f"iteration {iteration}: weight hashes differ across data-parallel replicas: " + \
        "; ".join(d.describe(hosts) for d in found)
    fields = {"iteration": iteration, "verdict": VERDICT, "ranks": sorted({r for d in found for r in d.odd}),
              "weights": [d.weight for d in found]}
    mode = get_rerun_state_machine().mode
    if mode == RerunMode.REPORT_DETERMINISM_STATS:
        events.decision("rerun", f"{what}; --rerun-mode report_determinism_stats: reported, training "
                        "continues", **fields)
        return None
    if mode == RerunMode.DISABLED:  # as megatron-core raises for a rejected result in this mode
        events.decision("rerun", f"{what}; --rerun-mode disabled: raising, as Megatron-LM's assertion "
                        "does; nothing is saved", **fields)
        raise RuntimeError(f"Parameter hashes not matching across DP replicas after {iteration} iterations")
    code = exit_codes.RERUN_FAILED_VALIDATION
    events.decision("rerun", f"{what}; the replicas no longer hold one model: nothing is saved, the newest "
                    "checkpoint stays the newest (resume from it once the devices named are checked); "
                    f"exiting with code {code}", exit_code=code, **fields)
    events.record("exit", message=what, iteration=iteration, exit_code=code, requeue=False)
    return rerun.RerunStop(what, code, requeue=False, checkpoint=False, verdict=VERDICT,
                           iteration=iteration + 1, findings=tuple(d.describe(hosts) for d in found))
