"""What a checkpoint holds, in Megatron-LM's layout so either program resumes the other's checkpoints:
args (a Namespace of plain values, consumed samples inside), checkpoint_version, iteration, model (model0,
model1, ... with virtual pipeline stages), optimizer (megatron-core's own sharded state: the distributed
optimizer's shards under --use-distributed-optimizer), opt_param_scheduler, rng_state (one ShardedObject per
pipeline and tensor-parallel rank, and per data-parallel rank too under expert parallelism where the matching
Megatron-LM does so: see `_RNG_BY_DATA_PARALLEL_RANK`), rerun_state_machine (None unless saved for
exit 16 or 17; see rerun_state.py) and num_floating_point_operations_so_far. Non-tensor values land in
common.pt, which loads with torch.load(weights_only=True).

The sharding metadata Megatron-LM records in metadata.json (`content_metadata`: the distributed optimizer's
sharding type) says how the optimizer state is laid out; a load builds its template from the checkpoint's
own metadata, so a checkpoint saved with one sharding type loads into a run configured with another. The
RNG states' layout is likewise read from the checkpoint (`saved_rng_shape`), so either Megatron-LM's loads.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re

import torch
from megatron.core import package_info, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.safe_globals import register_safe_globals
from megatron.core.utils import unwrap_model

from megatron_resil import events, parallel
from megatron_resil.checkpointing import rerun_state, safe_load, torch_format, untrusted
from megatron_resil.checkpointing.resumed_schedule import apply_overridden_schedule, check_resumed_schedule
from megatron_resil.checkpointing.tier import CheckpointFormatError
from megatron_resil.progress import TrainProgress

CHECKPOINT_VERSION = 3.0
_PLAIN = (int, float, str, bool, type(None))
# argparse.Namespace and megatron-core's enums, as safe for torch.load(weights_only=True), which is how
# megatron-core reads common.pt.
register_safe_globals()
# Under expert parallelism Megatron-LM core_v0.16.x keeps one RNG state per pipeline, tensor- and
# data-parallel rank (PR #2658); every release before it, and core_v0.17.0 on (the revert, #3736), one per
# pipeline and tensor-parallel rank, as without expert parallelism. Each reads only its own layout. No
# megatron-core builds this object (Megatron-LM's get_rng_state does, in megatron.training), so nothing
# can be asked; a Megatron-LM release ships the megatron-core of the same version, which therefore names
# the Megatron-LM the user runs beside us. A load reads whichever layout the checkpoint holds.
_RNG_BY_DATA_PARALLEL_RANK = (package_info.MAJOR, package_info.MINOR) == (0, 16)
# A ShardedObject's key: "<name>/shard_<offsets>_<global shape>", each dotted.
_RNG_KEY = re.compile(r"rng_state/shard_(\d+(?:\.\d+)*)_(\d+(?:\.\d+)*)")


def args_record(args: argparse.Namespace) -> argparse.Namespace:
    """The command line as a Namespace of plain values (what Megatron-LM reads back), nothing that would
    need unpickling of arbitrary objects."""
    out = argparse.Namespace()
    for key, value in vars(args).items():
        if isinstance(value, _PLAIN):
            setattr(out, key, value)
        elif isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
            setattr(out, key, list(value))
    return out


def sharding_metadata(args: argparse.Namespace, for_local_tier: bool = False,
                      ckpt_format: str = "torch_dist") -> dict:
    """How model and optimizer state are sharded (Megatron-LM's `sharded_sd_metadata`), for a save. The
    node-local tier keeps each rank's own shards (dp_reshardable), as Megatron-LM requires. `ckpt_format`
    torch: no sharding at all (each rank's plain state dicts, Megatron-LM's legacy format)."""
    if ckpt_format == torch_format.FORMAT:
        return {"ckpt_format": torch_format.FORMAT}
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    # Muon's layer-wise optimizer keeps its other parameters in a distributed optimizer: the same sharding
    # type for it, as Megatron-LM records it.
    if args.use_distributed_optimizer or getattr(args, "use_layer_wise_distributed_optimizer", False):
        fully = args.dist_ckpt_optim_fully_reshardable and not for_local_tier
        metadata["distrib_optim_sharding_type"] = "fully_reshardable" if fully else "dp_reshardable"
    return metadata


def _with_groups(metadata: dict | None) -> dict:
    return {**(metadata or {}),
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


def _by_data_parallel_rank(rng_shape: tuple[int, ...] | None) -> bool:
    """Whether the RNG states are (or, for a save, `rng_shape` None, will be) kept per data-parallel rank."""
    if rng_shape is not None:
        return len(rng_shape) == 3
    return _RNG_BY_DATA_PARALLEL_RANK and parallel_state.get_expert_model_parallel_world_size() > 1


def _rng_object(by_data_parallel_rank: bool) -> ShardedObject:
    """This rank's RNG states, keyed as Megatron-LM keys them: per pipeline and tensor-parallel rank, the
    data-parallel ranks holding replicas of one state; or per data-parallel rank too."""
    pp = parallel_state.get_pipeline_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    dp = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    if by_data_parallel_rank:
        dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        return ShardedObject("rng_state", [parallel.rng_state()], (pp_size, tp_size, dp_size), (pp, tp, dp),
                             replica_id=0)
    return ShardedObject("rng_state", [parallel.rng_state()], (pp_size, tp_size), (pp, tp), replica_id=dp)


def saved_rng_shape(path: str) -> tuple[int, ...] | None:
    """The global shape of the RNG states' ShardedObject in the checkpoint directory `path`, from its own
    metadata (the item names in DCP's `.metadata`, read through the allow-list, or zarr's object files):
    (PP, TP), or (PP, TP, DP) as Megatron-LM core_v0.16 keeps them under expert parallelism. None where it
    holds no RNG state or `path` is no checkpoint directory (a node-local candidate: saved by this
    program under this run's parallel layout)."""
    metadata_path = os.path.join(path, ".metadata")
    if os.path.isfile(metadata_path):
        with untrusted.open_regular(metadata_path, untrusted.MAX_METADATA_BYTES, "DCP .metadata") as f:
            names = list(safe_load.load_metadata(f, metadata_path).state_dict_metadata)
    elif os.path.isdir(objects := os.path.join(path, "rng_state")):
        names = [f"rng_state/{name.removesuffix('.pt')}" for name in os.listdir(objects)]
    else:
        return None
    for name in names:
        if match := _RNG_KEY.fullmatch(name):
            return tuple(int(size) for size in match.group(2).split("."))
    return None


def _model_keys(model: list) -> list[str]:
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def build_sharded_state(model: list, optimizer, scheduler, progress: TrainProgress, args: argparse.Namespace,
                        *, with_optimizer: bool, with_rng: bool, metadata: dict | None = None,
                        loading: bool = False, rng_shape: tuple[int, ...] | None = None) -> dict:
    """The sharded state dict to save (`metadata`: this run's `sharding_metadata`) or, with `loading`, the
    template to load a checkpoint into (`metadata`: the checkpoint's own; `rng_shape`: its
    `saved_rng_shape`, None for this program's layout)."""
    if (metadata or {}).get("ckpt_format") == torch_format.FORMAT:
        return _torch_format_state(model, optimizer, scheduler, progress, args, with_optimizer=with_optimizer,
                                   with_rng=with_rng, loading=loading)
    metadata = _with_groups(metadata)
    record = args_record(args)
    record.consumed_train_samples = progress.consumed_train_samples
    record.consumed_valid_samples = progress.consumed_valid_samples
    record.skipped_train_samples = progress.skipped_train_samples
    state = {
        "args": record,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": progress.iteration,
        "num_floating_point_operations_so_far": progress.floating_point_operations_so_far,
        "rerun_state_machine": rerun_state.checkpoint_state(),
    }
    # Keyed by the models themselves, as Megatron-LM keys them: without the DDP and Float16Module wrappers.
    for key, chunk in zip(_model_keys(model), unwrap_model(model), strict=True):
        state[key] = chunk.sharded_state_dict(metadata=metadata)
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_object(_by_data_parallel_rank(rng_shape))
    return state


def _torch_format_state(model: list, optimizer, scheduler, progress: TrainProgress, args: argparse.Namespace,
                        *, with_optimizer: bool, with_rng: bool, loading: bool) -> dict:
    """Megatron-LM's generate_state_dict for --ckpt-format torch: plain state dicts, the RNG states as a
    list of one, and (collective over data-parallel ranks) the distributed optimizer's gathered parameter
    state for distrib_optim.pt. Loading: what to read (the tier reads whole files)."""
    if loading:
        return {"ckpt_format": torch_format.FORMAT, "model_keys": _model_keys(model),
                "optimizer": with_optimizer, "distributed_optimizer": bool(args.use_distributed_optimizer)}
    record = args_record(args)
    record.consumed_train_samples = progress.consumed_train_samples
    record.consumed_valid_samples = progress.consumed_valid_samples
    record.skipped_train_samples = progress.skipped_train_samples
    state = {"args": record, "checkpoint_version": CHECKPOINT_VERSION, "iteration": progress.iteration}
    for key, chunk in zip(_model_keys(model), unwrap_model(model), strict=True):
        state[key] = chunk.state_dict_for_save_checkpoint()
    if with_optimizer:
        state["optimizer"] = optimizer.state_dict()
        state["opt_param_scheduler"] = scheduler.state_dict()
        if args.use_distributed_optimizer:
            state[torch_format.PARAMETER_STATE] = torch_format.parameter_state(optimizer)
    pending_rerun = rerun_state.checkpoint_state()
    if pending_rerun is not None:  # every rank's part is in per_rank; its ShardedObject is torch_dist's
        state["rerun_state_machine"] = {k: v for k, v in pending_rerun.items() if k != "sharded"}
    if with_rng:
        state["rng_state"] = [parallel.rng_state()]
    state["num_floating_point_operations_so_far"] = progress.floating_point_operations_so_far
    return state


# What one parameter can take in a rank's whole-state file (--ckpt-format torch's files, a local shard): its
# value (at most 4 bytes) and the optimizer's fp32 main copy and two moments, 16 bytes; twice that, for
# optimizers and layouts that keep more. Plus the rest: arguments, RNG and scheduler state, extra states and
# the archive's own headers.
_BYTES_PER_PARAMETER = 32
_BYTES_BESIDE_PARAMETERS = 256 << 20


def max_rank_bytes(model: list) -> int:
    """The most bytes a file of one rank's state for `model` (this rank's chunks) can hold: a larger one
    was saved for a larger model, or is no checkpoint at all, and is not read into memory."""
    parameters = sum(p.numel() for chunk in model for p in chunk.parameters())
    return parameters * _BYTES_PER_PARAMETER + _BYTES_BESIDE_PARAMETERS


def check_format(saved_args) -> None:
    """Refuse, with what to do, a checkpoint whose optimizer and RNG state we can no longer read."""
    if isinstance(saved_args, dict):  # before 0.2 we saved the args as a plain dict
        raise CheckpointFormatError(
            "it was written by megatron-resil's own optimizer, before training moved to megatron-core's: "
            "resume its weights, iteration and schedule with --no-load-optim --no-load-rng (the "
            "optimizer state starts fresh), or use --finetune")


def _seed_from(state, salt: str) -> int:
    """A seed derived from a saved generator state: the same on every rank that holds the same state."""
    data = state.numpy().tobytes() if isinstance(state, torch.Tensor) else repr(state).encode()
    return int.from_bytes(hashlib.sha256(salt.encode() + data).digest()[:8], "little") >> 1


def _seeded_state(seed: int, cuda: bool) -> torch.Tensor:
    """A fresh generator state in this device's format (CUDA's Philox or the CPU's Mersenne Twister)."""
    return torch.Generator(device="cuda" if cuda else "cpu").manual_seed(seed).get_state()


def rng_for_this_device(saved: dict) -> tuple[dict, list[str]]:
    """The saved RNG states in a form this device can set, and what had to be translated. A CPU-written
    checkpoint holds an empty CUDA state and CPU-format tracker states, which torch.cuda.set_rng_state and
    the tracker's first fork refuse on a GPU; a GPU-written one holds CUDA-format tracker states, which the
    CPU tracker (patches) refuses at the first dropout. Each state of the wrong format is replaced by one
    seeded from the saved state it stands for (the CUDA generator's from the saved CPU generator's), so
    ranks that saved equal states (data-parallel replicas) still draw equal numbers, and those that saved
    different ones (tensor-parallel ranks' tracker streams) still draw different ones."""
    cuda = torch.cuda.is_available()
    size = (torch.cuda.get_rng_state() if cuda else torch.get_rng_state()).numel()

    def foreign(state) -> bool:
        return not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.numel() == size)

    rng, translated = dict(saved), []
    if cuda and foreign(saved["cuda_rng_state"]):
        rng["cuda_rng_state"] = _seeded_state(_seed_from(saved["torch_rng_state"], "cuda"), cuda)
        translated.append("the CUDA generator")
    trackers = saved["rng_tracker_states"]
    moved = sorted(name for name, state in trackers.items() if foreign(state))
    if moved:
        rng["rng_tracker_states"] = {name: _seeded_state(_seed_from(state, name), cuda) if name in moved
                                     else state for name, state in trackers.items()}
        translated.append("the tracker's " + ", ".join(moved))
    return rng, translated


def _own_expert_stream(saved: dict) -> dict:
    """`saved` with this rank's own expert-parallel tracker stream in place of the saved one.

    A checkpoint that keeps one RNG state per pipeline and tensor-parallel rank holds, under expert
    parallelism, data-parallel rank 0's (the replicas' writer). Its other data-parallel ranks drew the same
    numbers from every stream but the expert-parallel one, which megatron-core seeds from the seed and the
    expert-parallel (and expert tensor-parallel) rank. Megatron-LM's load_checkpoint hands them rank 0's
    stream too, so its expert ranks then draw equal numbers. Here every rank keeps its own, as this run
    seeded it and drew from it to build the model, as the saving run did: megatron-core draws from it only
    to initialise expert weights (and for Megatron-LM's benchmark-only random router logits, a flag this
    program does not offer), so the resume is exact and the expert ranks' streams stay distinct."""
    name = tensor_parallel.get_expert_parallel_rng_tracker_name()
    own = tensor_parallel.get_cuda_rng_tracker().get_states()
    trackers = saved["rng_tracker_states"]
    if name not in own or name not in trackers:
        return saved
    return {**saved, "rng_tracker_states": {**trackers, name: own[name]}}


def _as_live_shards(loaded: dict, live: dict) -> dict:
    """Under --use-torch-fsdp2 a parameter is a DTensor (torch's FSDP2 shards it over the data-parallel
    ranks), and dist_checkpointing hands back this rank's shard of it as a plain tensor: make it the DTensor
    it is a shard of, laid out as the live one, which the module and torch's optimizer take."""
    from torch.distributed.tensor import DTensor

    def as_live(name, value):
        target = live.get(name)
        if not isinstance(target, DTensor) or isinstance(value, DTensor) or not torch.is_tensor(value):
            return value
        return DTensor.from_local(value, target.device_mesh, target.placements, run_check=False,
                                  shape=target.shape, stride=target.stride())

    return {name: as_live(name, value) for name, value in loaded.items()}


def _optimizer_state_as_live_shards(loaded, optimizer):
    """The loaded state of each FSDP2 parameter (Adam's moments, and the fp32 main copies under --bf16) as
    DTensors laid out as the live ones. Any other optimizer's state is returned as loaded."""
    from torch.distributed.tensor import DTensor

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(chained) != 1 or not isinstance(loaded, dict):  # FSDP2 builds one optimizer (no experts)
        return loaded
    inner = chained[0]
    if not any(isinstance(param, DTensor) for group in getattr(inner, "param_groups", ())
               for param in group.get("params", ())):  # not FSDP2: nothing is a DTensor
        return loaded
    torch_state = loaded.get("optimizer", loaded)  # megatron-core's fp16/bf16 optimizer nests torch's
    params = [param for group in inner.optimizer.param_groups for param in group["params"]]
    for index, param_state in torch_state.get("state", {}).items():
        if isinstance(index, int) and isinstance(param_state, dict):
            live = dict.fromkeys(param_state, params[index])
            torch_state["state"][index] = _as_live_shards(param_state, live)
    main_params = getattr(inner, "fp32_from_float16_groups", None)
    if main_params is not None and "fp32_from_fp16_params" in loaded:
        loaded["fp32_from_fp16_params"] = [
            list(_as_live_shards(dict(enumerate(saved)), dict(enumerate(live))).values())
            for saved, live in zip(loaded["fp32_from_fp16_params"], main_params, strict=True)]
    return loaded


def restore(loaded: dict, model: list, optimizer, scheduler, *, load_optimizer: bool, load_rng: bool,
            finetune: bool, release: bool = False, half_precision: bool = False,
            rng_shape: tuple[int, ...] | None = None, partial_model: bool = False) -> TrainProgress:
    """Apply a loaded checkpoint as Megatron-LM's load_checkpoint does. `finetune` or a `release`
    checkpoint: the weights only, at iteration 0 (no optimizer, scheduler, RNG or rerun state, no consumed
    samples). Without the optimizer state under bf16/fp16, the optimizer's fp32 main parameters are reloaded
    from the loaded weights (else the first step would write its random initial ones back over them).
    `rng_shape`: the checkpoint's `saved_rng_shape`, as its template was built with. `partial_model`: a
    --dist-ckpt-strictness that loads around model keys the checkpoint lacks; they keep their initial
    values, said in one line.
    Raises ScheduleMismatch, before anything is applied, for a schedule that differs from the checkpoint's
    with neither flag that settles it."""
    weights_only = finetune or release
    load_optimizer = load_optimizer and not weights_only
    if load_optimizer:
        check_resumed_schedule(scheduler, loaded["opt_param_scheduler"])
    for key, chunk in zip(_model_keys(model), unwrap_model(model), strict=True):
        weights = _as_live_shards(loaded[key], chunk.state_dict(keep_vars=True))
        kept = chunk.load_state_dict(weights, strict=not partial_model).missing_keys
        kept = [name for name in kept if not name.endswith("._extra_state")]  # TE's, rebuilt as it runs
        # the one line for every strictness mode that loads around them (log_*, return_*, ignore_all)
        if kept:
            events.decision("load", f"{len(kept)} model weight(s) not in the checkpoint keep their initial "
                            f"values (--dist-ckpt-strictness): {', '.join(kept[:4])}"
                            + (f" and {len(kept) - 4} more" if len(kept) > 4 else ""), kept=kept)
    flops = float(loaded.get("num_floating_point_operations_so_far") or 0)  # kept even by --finetune
    if weights_only:
        if half_precision:
            with torch.no_grad():
                optimizer.reload_model_params()
        return TrainProgress(floating_point_operations_so_far=flops)
    rerun_state.restore_state(loaded.get("rerun_state_machine"))
    record = loaded["args"]
    saved = vars(record) if isinstance(record, argparse.Namespace) else record
    progress = TrainProgress(
        iteration=int(loaded["iteration"]),
        consumed_train_samples=int(saved.get("consumed_train_samples", 0)),
        consumed_valid_samples=int(saved.get("consumed_valid_samples", 0)),
        skipped_train_samples=int(saved.get("skipped_train_samples", 0)),
        floating_point_operations_so_far=flops,
    )
    if load_optimizer:
        runtime_lrs = [(group.get("max_lr"), group.get("min_lr")) for group in optimizer.param_groups]
        with torch.no_grad():  # the distributed optimizer copies into views of fp32 parameters
            optimizer.load_state_dict(_optimizer_state_as_live_shards(loaded["optimizer"], optimizer))
            if torch_format.PARAMETER_STATE in loaded:  # --ckpt-format torch: distrib_optim.pt
                torch_format.load_parameter_state(optimizer, loaded[torch_format.PARAMETER_STATE])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
        if scheduler.override_opt_param_scheduler:
            apply_overridden_schedule(optimizer, scheduler, runtime_lrs, progress.consumed_train_samples)
    elif half_precision:
        with torch.no_grad():
            optimizer.reload_model_params()
    if load_rng:
        saved_rng = loaded["rng_state"][0]
        expert_parallel = parallel_state.get_expert_model_parallel_world_size() > 1
        if expert_parallel and not _by_data_parallel_rank(rng_shape):
            saved_rng = _own_expert_stream(saved_rng)
        rng, translated = rng_for_this_device(saved_rng)
        if translated:
            events.decision("rng", f"the checkpoint's RNG states were written on another kind of device; "
                            f"{' and '.join(translated)} reseeded deterministically from the saved states "
                            "(training continues; its dropout masks differ from a run that never moved)",
                            translated=translated)
        parallel.set_rng_state(rng)
    return progress
