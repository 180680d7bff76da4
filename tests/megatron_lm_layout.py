"""Megatron-LM's side of the checkpoint layout test (test_megatron_lm_layout.py), run under torchrun.

It loads a checkpoint the way Megatron-LM's `load_checkpoint` (core_v0.16.1,
megatron/training/checkpointing.py) does and saves it back the way its `save_checkpoint` and
`generate_state_dict` do: written here from reading that code, sharing nothing with
megatron_resil.checkpointing, so a layout difference between the two programs fails the test. The
model, optimizer and scheduler are megatron-core's, built from pretrain.py's flags.

    torchrun ... tests/megatron_lm_layout.py --megatron-load DIR --megatron-save DIR <pretrain.py flags>
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_resil import patches  # noqa: E402

# As pretrain.py does before megatron-core is imported (patches.install below decides the rest): its
# torch.compile decorators would import TorchInductor, seconds of CPU per rank.
patches.install_import_speedups()

from megatron.core import dist_checkpointing, tensor_parallel  # noqa: E402
from megatron.core import parallel_state as mpu  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject  # noqa: E402
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy  # noqa: E402
from megatron.core.dist_checkpointing.strategies.fully_parallel import (  # noqa: E402
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.rerun_state_machine import get_rerun_state_machine  # noqa: E402
from megatron.core.utils import unwrap_model  # noqa: E402

from megatron_resil import parallel  # noqa: E402
from megatron_resil.arguments import parse_args  # noqa: E402
from megatron_resil.resilience import rerun  # noqa: E402
from megatron_resil.tokenizer import build_tokenizer  # noqa: E402
from megatron_resil.training import build_engine  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"


def sharded_sd_metadata(args) -> dict:
    """Megatron-LM's _build_sharded_state_dict_metadata."""
    metadata = {}
    if args.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = \
            "fully_reshardable" if args.dist_ckpt_optim_fully_reshardable else "dp_reshardable"
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    metadata["dp_cp_group"] = mpu.get_data_parallel_group(with_context_parallel=True)
    return metadata


def get_rng_state():
    """Megatron-LM's get_rng_state for torch_dist, without --data-parallel-random-init."""
    rng_state = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                  "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
                  "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}]
    pp_rank, pp_size = mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()
    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    if mpu.get_expert_model_parallel_world_size() > 1:
        dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
        dp_size = mpu.get_data_parallel_world_size(with_context_parallel=True)
        return ShardedObject("rng_state", rng_state, (pp_size, tp_size, dp_size), (pp_rank, tp_rank, dp_rank),
                             replica_id=0)
    return ShardedObject("rng_state", rng_state, (pp_size, tp_size), (pp_rank, tp_rank),
                         replica_id=mpu.get_data_parallel_rank(with_context_parallel=True))


def generate_state_dict(args, model, optimizer, scheduler, rng_state, iteration=None, optim_sd_kwargs=None,
                        model_sd_kwargs=None, rerun_state=None) -> dict:
    """Megatron-LM's generate_state_dict for --ckpt-format torch_dist."""
    state_dict = {"args": args, "checkpoint_version": 3.0}
    if iteration is not None:
        state_dict["iteration"] = iteration
    for i in range(len(model)):
        key = "model" if len(model) == 1 else f"model{i}"
        state_dict[key] = model[i].sharded_state_dict(**model_sd_kwargs)
    if not args.no_save_optim:
        if optimizer is not None:
            state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, **optim_sd_kwargs)
        if scheduler is not None:
            state_dict["opt_param_scheduler"] = scheduler.state_dict()
    if rerun_state:
        state_dict["rerun_state_machine"] = rerun_state
    if not args.no_save_rng and rng_state:
        state_dict["rng_state"] = rng_state
    return state_dict


def load_checkpoint(args, model, optimizer, scheduler, load_dir: str) -> int:
    """Megatron-LM's load_checkpoint for a torch_dist checkpoint; returns the iteration."""
    with open(os.path.join(load_dir, TRACKER)) as f:
        iteration = int(f.read().strip())
    name = os.path.join(load_dir, f"iter_{iteration:07d}")
    common = dist_checkpointing.load_common_state_dict(name)
    ckpt_args = common["args"]
    for key in ("num_layers", "hidden_size", "num_attention_heads"):  # check_checkpoint_args
        assert getattr(ckpt_args, key) == getattr(args, key), key
    assert getattr(ckpt_args, "add_position_embedding", True) is True
    ckpt_tp_pp = (getattr(ckpt_args, "tensor_model_parallel_size", 1),
                  getattr(ckpt_args, "pipeline_model_parallel_size", 1))
    rng = get_rng_state() if ckpt_tp_pp == (args.tensor_model_parallel_size,
                                             args.pipeline_model_parallel_size) else None
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    metadata["dp_cp_group"] = mpu.get_data_parallel_group(with_context_parallel=True)
    rerun_state = None
    if "rerun_state_machine" in common and get_rerun_state_machine().validate_state_dict(
            common["rerun_state_machine"]):
        rerun_state = get_rerun_state_machine().state_dict(data_iterator=None, ckpt_format="torch_dist",
                                                           force=True)
    template = generate_state_dict(args, unwrap_model(model), optimizer, scheduler, rng,
                                   optim_sd_kwargs=dict(metadata=metadata, is_loading=True),
                                   model_sd_kwargs=dict(metadata=metadata), rerun_state=rerun_state)
    state_dict = dist_checkpointing.load(template, name)
    iteration = state_dict["iteration"]
    args.consumed_train_samples = getattr(state_dict["args"], "consumed_train_samples", 0)
    args.consumed_valid_samples = getattr(state_dict["args"], "consumed_valid_samples", 0)
    if len(model) == 1:
        model[0].load_state_dict(state_dict["model"], strict=True)
    else:
        for i in range(len(model)):
            model[i].load_state_dict(state_dict[f"model{i}"], strict=True)
    # Megatron-LM calls it outside no_grad: on GPU its fp32 main params are separate leaves; here (fp32
    # on CPU) they are views of the model's parameters, which an in-place copy may not touch with grad on.
    with torch.no_grad():
        optimizer.load_state_dict(state_dict["optimizer"])
    scheduler.load_state_dict(state_dict["opt_param_scheduler"])
    if rng is not None:
        rng_state = state_dict["rng_state"][0]
        random.setstate(rng_state["random_rng_state"])
        np.random.set_state(rng_state["np_rng_state"])
        torch.set_rng_state(rng_state["torch_rng_state"])
        torch.cuda.set_rng_state(rng_state["cuda_rng_state"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng_state["rng_tracker_states"])
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"  successfully loaded checkpoint from {load_dir} [ t 1/{args.tensor_model_parallel_size}, "
              f"p 1/{args.pipeline_model_parallel_size} ] at iteration {iteration} "
              f"(consumed samples {args.consumed_train_samples})", flush=True)
    return iteration


def save_checkpoint(args, model, optimizer, scheduler, save_dir: str, iteration: int) -> None:
    """Megatron-LM's save_checkpoint for torch_dist: the directory written in place, then a barrier, then
    the tracker overwritten by rank 0."""
    name = os.path.join(save_dir, f"iter_{iteration:07d}")
    metadata = sharded_sd_metadata(args)
    rerun_state = get_rerun_state_machine().state_dict(data_iterator=None, ckpt_format="torch_dist")
    state_dict = generate_state_dict(args, unwrap_model(model), optimizer, scheduler, get_rng_state(),
                                     iteration=iteration, optim_sd_kwargs=dict(metadata=metadata),
                                     model_sd_kwargs=dict(metadata=metadata), rerun_state=rerun_state)
    state_dict["num_floating_point_operations_so_far"] = 0
    if dist.get_rank() == 0:
        os.makedirs(name, exist_ok=True)
    dist.barrier()
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"),
                                                mpu.get_data_parallel_group(with_context_parallel=True))
    content = {k: v for k, v in metadata.items() if k != "dp_cp_group"}  # _clean_metadata_for_serialization
    dist_checkpointing.save(state_dict, name, strategy, content_metadata=content)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, TRACKER), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"  successfully saved checkpoint from iteration {iteration:7d} to {save_dir}", flush=True)


def main() -> int:
    outer = argparse.ArgumentParser(add_help=False)
    outer.add_argument("--megatron-load", required=True)
    outer.add_argument("--megatron-save", required=True)
    ours, pretrain_flags = outer.parse_known_args()
    args = parse_args(pretrain_flags)
    patches.install(args)
    parallel.initialize(args)
    rerun.initialize(rerun.RerunConfig.from_args(args))
    model, optimizer, scheduler = build_engine(args, build_tokenizer(args).vocab_size)
    # Megatron-LM's own attributes that pretrain.py does not have.
    args.ckpt_format, args.use_dist_ckpt, args.ckpt_fully_parallel_save = "torch_dist", True, True
    iteration = load_checkpoint(args, model, optimizer, scheduler, ours.megatron_load)
    save_checkpoint(args, model, optimizer, scheduler, ours.megatron_save, iteration)
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
