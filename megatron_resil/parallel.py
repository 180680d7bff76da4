"""Process groups, seeds and per-rank RNG state: what every rank sets up before building the model."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import random
import weakref
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_resil import gpu_features, group_connections
from megatron_resil.rank_process import is_rank0, rank  # noqa: F401 - the trainer's modules ask them here

# The store torch.distributed starts from during one in-process restart attempt (see
# inprocess_restart.py), None otherwise. A second attempt cannot rendezvous through the launcher's
# environment again: init_process_group would find the first attempt's keys in the launcher's store.
# A module variable set around the call, not a parameter: `training.pretrain(args)` is the unit that
# restarts, and neither it nor its callers need to know that an attempt is one of several.
_attempt_store: dist.Store | None = None


@contextlib.contextmanager
def attempt_store(store: dist.Store) -> Iterator[None]:
    """Inside this block, `initialize` starts torch.distributed from `store` (a fresh namespace)."""
    global _attempt_store
    previous, _attempt_store = _attempt_store, store
    try:
        yield
    finally:
        _attempt_store = previous


def initialize(args: argparse.Namespace) -> None:
    """Start torch.distributed from torchrun's environment and build megatron-core's groups."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    with group_connections.tracking():  # for an abort on gloo (group_connections.py)
        if not dist.is_initialized():
            timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
            if _attempt_store is not None:
                dist.init_process_group(backend=args.distributed_backend, timeout=timeout,
                                        store=_attempt_store, rank=int(os.environ["RANK"]),
                                        world_size=int(os.environ["WORLD_SIZE"]))
            elif "RANK" in os.environ:  # launched by torchrun, ft_launcher or srun
                dist.init_process_group(backend=args.distributed_backend, timeout=timeout)
            else:  # `python pretrain.py ...`: one process, no launcher needed
                dist.init_process_group(backend=args.distributed_backend, timeout=timeout,
                                        store=dist.HashStore(), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
            order="tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",  # as Megatron-LM
            create_gloo_process_groups=args.use_gloo_process_groups,
            # As Megatron-LM: every group megatron-core makes (data-parallel, tensor-parallel, ...) times
            # out as the default one does. Left out, they waited 30 minutes whatever the flag said.
            distributed_timeout_minutes=args.distributed_timeout_minutes,
        )
    set_seeds(args.seed, **gpu_features.seed_kwargs(args))
    gpu_features.set_up(args)


def shutdown() -> None:
    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# Groups megatron-core's destroy_model_parallel leaves set (0.16 to 0.19): the distributed optimizer's
# instance-local data-parallel groups (with one instance, the data-parallel group itself) and the
# hierarchical context-parallel groups. Held, they keep their gloo connections open.
_LEFT_BY_DESTROY = ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
                    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
                    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS")


# The model chunks built in this process, so that a failed attempt's can be let go (release_process_groups).
_engines: weakref.WeakSet = weakref.WeakSet()


def track_for_release(model: list) -> None:
    _engines.update(model)


_ENGINE_HOOKS_IN_CONFIG = ("no_sync_func", "grad_sync_func", "param_sync_func", "finalize_model_grads_func",
                           "grad_scale_func")


def _let_go_of_engines() -> None:
    """The model's config, shared by every layer, holds the schedules' hooks: DDP's and the optimizer's
    bound methods. Under the distributed optimizer the collector did not free a failed attempt's engine
    while they were set (what holds it is out of Python's sight: tests/test_release_between_attempts.py),
    so DDP, its buffers and its process groups lived on; unset, all of it goes."""
    for chunk in list(_engines):
        config = getattr(chunk, "config", None)
        for name in _ENGINE_HOOKS_IN_CONFIG:
            if getattr(config, name, None) is not None:
                setattr(config, name, None)


def empty_leaked_engines() -> int:
    """After a failed attempt has unwound and its groups were released: a DDP chunk still alive is held
    from outside Python's sight. Seen on gloo: a rank interrupted inside its optimizer step kept its DDP,
    reachable from DDP's own gradient hooks through their C++ autograd nodes, and with it the groups its peers
    were blocked in until NVRx's hard timeout. Its attributes are dropped (the module, the gradient buffers,
    the bucket groups and their process groups), then collected. Returns how many were."""
    leaked = list(_engines)
    for chunk in leaked:
        chunk.__dict__.clear()  # an nn.Module's parameters, submodules and hooks live in its __dict__
    if leaked:
        gc.collect()
    return len(leaked)


def release_process_groups() -> None:
    """Drop every process group this process holds, in whatever state (an attempt that failed): first
    megatron-core's references, then torch.distributed's, then the cycles. On gloo a group that is no
    longer referenced closes its connections, which frees a peer blocked in a collective with this rank
    (gloo's `abort()` and `shutdown()` leave it waiting); a collective of this rank's own, blocked with a
    hung peer, is ended by the abort before this (group_connections.end)."""
    _let_go_of_engines()
    parallel_state.destroy_model_parallel()
    for name in _LEFT_BY_DESTROY:  # so these go too (a peer in the instance's groups is released)
        if getattr(parallel_state, name, None) is not None:
            setattr(parallel_state, name, None)
    if dist.is_initialized():
        dist.destroy_process_group()
    group_connections.forget()
    gc.collect()


def set_seeds(seed: int, **tracker) -> None:
    """Megatron-LM's seeding: each pipeline stage its own seed, the same on every tensor- and
    data-parallel rank (they must draw identical dropout masks on replicated activations), and
    megatron-core's tracker for the streams that differ per tensor- and expert-parallel rank (`tracker`: which
    one, gpu_features.seed_kwargs)."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, **tracker)


def rng_state() -> dict:
    """Everything random this rank will draw from, so a resume continues bit for bit."""
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def all_ranks_agree(flag: bool) -> bool:
    """True only if every rank passes True: one collective, so all ranks take the same branch."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def any_rank(flag: bool) -> bool:
    return not all_ranks_agree(not flag)


def all_gather_object(obj) -> list:
    """Every rank's `obj`, indexed by rank (one collective)."""
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def device() -> torch.device:
    """Where this rank computes and where its collectives' tensors live."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
