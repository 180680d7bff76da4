"""megatron-core on a host without CUDA: the accommodations it needs to train and checkpoint, in one place.

megatron-core's engine (DDP, the distributed optimizer, pipeline schedules, MoE dispatchers, torch_dist
checkpointing) assumes a CUDA device throughout. Without one each assumption raises "Torch not compiled
with CUDA enabled", so each is given the meaning it has on a host with no device: synchronising or
emptying a cache does nothing, a "current device" is the CPU, a stream is the one implicit CPU stream,
and a tensor asked for on 'cuda' lives on the CPU (gloo reduces CPU tensors). Every record here applies
only where CUDA is absent; nothing outside this package knows which case it runs in.

The scopes are as narrow as megatron-core allows: `torch.cuda` entry points that dozens of modules (and
NVRx) call are patched process-wide; literal `device='cuda'` tensors and streams are mapped only inside
the megatron-core modules that create them (`_MODULES_CREATING_CUDA_TENSORS`); the `tensor.type()` and
`tensor.cuda()` idioms only while the named functions run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import types
from collections.abc import Callable, Iterator

import torch

from megatron_resil.patches.registry import Has, Patch, Says, Takes

PACKAGE = "megatron-core"
WRITTEN_FOR = ">=0.16.1,<0.20"


def without_cuda(args: argparse.Namespace | None) -> bool:
    return not torch.cuda.is_available()


# ---- torch.cuda entry points, process-wide ------------------------------------------------------------

def _patch_cuda_entry_points() -> None:
    """`torch.cuda.synchronize()` after staging a checkpoint (dist_checkpointing), `current_device()` as the
    device of status tensors and buffers (DDP, the optimizers, dist_checkpointing, NVRx), the CUDA RNG
    state saved around a rerun (rerun_state_machine) and `empty_cache()` (DDP, the in-process restart):
    called from too many modules to patch one by one, and each has an exact CPU meaning."""
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.empty_cache = lambda: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda new_state, device="cuda": None


# ---- 'cuda' tensors and streams inside megatron-core's modules -----------------------------------------

# The modules that create tensors with a literal device='cuda', or use CUDA streams and events, on the
# paths we run: DDP's grad buffers and communication stream, the optimizers' status tensors and the grad
# scaler, grad clipping, the pipeline schedules' token counters and p2p shape exchange, the rerun state
# machine's flags, the MoE aux-loss tracker and dispatcher streams, the causal mask, and the fully
# parallel checkpoint exchange. (Muon's layer-wise optimizer: `_layer_wise_optimizer_on_host`.)
_MODULES_CREATING_CUDA_TENSORS = (
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.rerun_state_machine",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.utils",
    "megatron.core.utils",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)
_FACTORIES = frozenset({"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
                        "randint", "zeros_like", "ones_like", "empty_like", "full_like"})


def _host_device(device):
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _HostStream:
    """A CUDA stream or event on a host without one: work is already ordered, so waiting is a no-op."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __eq__(self, other) -> bool:  # one implicit stream: every stream is the current one
        return isinstance(other, _HostStream)

    __hash__ = object.__hash__

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _HostStream:
        return _HostStream()

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CudaOnHost(types.SimpleNamespace):
    """`torch.cuda` as the listed modules see it: streams and events are `_HostStream`s; the rest is
    torch.cuda itself (already patched above where it would raise)."""

    Stream = Event = _HostStream

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)

    @staticmethod
    def stream(stream=None):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device=None) -> _HostStream:
        return _HostStream()

    default_stream = current_stream


class _TorchOnHost(types.ModuleType):
    """`torch` as the listed modules see it: a factory asked for a 'cuda' tensor makes a CPU one (and
    does not pin memory, which needs CUDA); `torch.cuda` is `_CudaOnHost`."""

    cuda = _CudaOnHost()

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        @functools.wraps(attr)
        def on_host(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _host_device(kwargs["device"])
            kwargs.pop("pin_memory", None)
            return attr(*args, **kwargs)

        return on_host


def _map_cuda_tensors_to_cpu() -> None:
    torch_on_host = _TorchOnHost()
    for name in _MODULES_CREATING_CUDA_TENSORS:
        importlib.import_module(name).torch = torch_on_host


# ---- Muon's layer-wise distributed optimizer ---------------------------------------------------------------

class _Done:
    """The handle of a collective that has already completed."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _DistributedWithUnevenAllGather(types.ModuleType):
    """`torch.distributed` whose all_gather takes pieces of different sizes, as NCCL does and gloo does
    not: each rank's piece is padded to the largest, gathered, and cut back (then, asked for an
    asynchronous one, a handle that is already done)."""

    def __init__(self) -> None:
        super().__init__("torch.distributed")

    def __getattr__(self, name: str):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = [piece.numel() for piece in tensor_list]
        if len(set(sizes)) <= 1:
            return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        padded = [tensor.new_empty(max(sizes)) for _ in sizes]
        source = tensor.new_zeros(max(sizes))
        source[:tensor.numel()] = tensor.reshape(-1)
        torch.distributed.all_gather(padded, source, group=group)
        for piece, gathered, size in zip(tensor_list, padded, sizes, strict=True):
            piece.view(-1).copy_(gathered[:size])
        return _Done() if async_op else None


class _TorchOnHostForLayerWise(_TorchOnHost):
    distributed = _DistributedWithUnevenAllGather()


def _layer_wise_optimizer_on_host() -> None:
    # After the 'cuda' tensors record: the grad buffers' module keeps its CPU factories and streams.
    for name in (_LAYER_WISE, _GRAD_BUFFER):
        importlib.import_module(name).torch = _TorchOnHostForLayerWise()


def _muon_refused() -> str | None:
    """Why the layer-wise optimizer is never used here, or None: this megatron-core's Muon is refused."""
    from megatron_resil.arguments.training import muon_support_missing

    missing = muon_support_missing()
    return f"--optimizer muon is refused on this installation ({missing})" if missing else None


def _uses_layer_wise_optimizer(args: argparse.Namespace | None) -> bool:
    # Set by the arguments' validation; --use-checkpoint-args installs the patches before it.
    return without_cuda(args) and (args is None
                                   or getattr(args, "use_layer_wise_distributed_optimizer", False))


# ---- tensor.type() and tensor.cuda() inside named functions ---------------------------------------------

@contextlib.contextmanager
def _cpu_tensors_pass_as_cuda() -> Iterator[None]:
    """While it is open, `t.type()` names a CPU tensor as its CUDA type ('torch.cuda.FloatTensor') and
    `t.cuda()` returns `t`: the optimizers accept only parameters of those type names, and a few places
    move a tensor to the device that is, here, the CPU."""
    real_type, real_cuda = torch.Tensor.type, torch.Tensor.cuda

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is not None or kwargs:
            return real_type(self, dtype, non_blocking, **kwargs)
        name = real_type(self)
        return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = real_type, real_cuda


def _within_cpu_tensors_pass_as_cuda(function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with _cpu_tensors_pass_as_cuda():
            return function(*args, **kwargs)

    return wrapper


_EXCHANGES = ("exchange_loaded_tensors_gather_object", "exchange_loaded_tensors_gather_rounds",
              "exchange_loaded_tensors_broadcast", "exchange_loaded_objects_gather_object")
# What `_report_cpu_tensors_as_cuda` wraps.
_PASSING_AS_CUDA = (
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.get_parameter_state_dp_zero",
    "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
    "megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32",
    "megatron.core.optimizer.grad_scaler:DynamicGradScaler.load_state_dict",
    "megatron.core.models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer",
    *(f"megatron.core.dist_checkpointing.exchange_utils:{name}" for name in _EXCHANGES),
)


def _report_cpu_tensors_as_cuda() -> None:
    from megatron.core.dist_checkpointing import exchange_utils
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler, optimizer

    # Float16OptimizerWithFloat16Params and DistributedOptimizer sort parameters by `param.type()` and
    # raise TypeError for anything but torch.cuda.{Float,Half,BFloat16}Tensor.
    for cls in (optimizer.Float16OptimizerWithFloat16Params, distrib_optimizer.DistributedOptimizer):
        cls.__init__ = _within_cpu_tensors_pass_as_cuda(cls.__init__)
    # The fully reshardable checkpoint format gathers each rank's state on data-parallel rank 0, moving it
    # with `.cuda()` when the exchange is not over gloo.
    distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero = _within_cpu_tensors_pass_as_cuda(
        distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero)
    # clip_grad_by_total_norm_fp32 asserts `grad.type() == 'torch.cuda.FloatTensor'`; optimizer.py calls
    # it through its own imported name.
    wrapped_clip = _within_cpu_tensors_pass_as_cuda(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = wrapped_clip
    optimizer.clip_grad_by_total_norm_fp32 = wrapped_clip
    # The fp16 loss scaler moves its restored scale to the device with `.cuda()`.
    grad_scaler.DynamicGradScaler.load_state_dict = _within_cpu_tensors_pass_as_cuda(
        grad_scaler.DynamicGradScaler.load_state_dict)
    # With pipeline stages and tied embeddings, the last stage's output layer starts as a copy moved to
    # the device with `.cuda()`.
    LanguageModule.setup_embeddings_and_output_layer = _within_cpu_tensors_pass_as_cuda(
        LanguageModule.setup_embeddings_and_output_layer)
    # The fully parallel load's exchange of loaded shards between ranks moves them with `.cuda()`.
    for name in _EXCHANGES:
        setattr(exchange_utils, name, _within_cpu_tensors_pass_as_cuda(getattr(exchange_utils, name)))



# ---- the tensor-parallel RNG tracker ---------------------------------------------------------------------

def _rng_tracker_on_cpu_generator() -> None:
    """megatron-core's CudaRNGStatesTracker keeps named CUDA generator states (dropout inside tensor- and
    expert-parallel regions draws from a per-rank stream) and `model_parallel_cuda_manual_seed` seeds it;
    sequence parallelism and MoE need it. On CPU the generator that dropout draws from is the CPU one, so
    the tracker keeps CPU generator states and `fork` swaps the CPU generator's state in and out."""
    from megatron.core.tensor_parallel import random as tp_random

    class CpuRngStatesTracker(tp_random.CudaRNGStatesTracker):
        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_state, outer_name = torch.get_rng_state(), self._current_state_name
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    def initialize_rng_tracker(*args, force_reset: bool = False, **kwargs) -> None:
        if force_reset or tp_random._CUDA_RNG_STATE_TRACKER is None:
            tp_random._CUDA_RNG_STATE_TRACKER = CpuRngStatesTracker()
            tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    tp_random.initialize_rng_tracker = initialize_rng_tracker


# ---- the MoE all-to-all dispatcher's split sizes ----------------------------------------------------------

def _moe_split_sizes_on_host() -> None:
    """The alltoall dispatcher computes its all-to-all split sizes on the device and gets host (numpy)
    copies from `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts only CUDA tensors: on CPU
    the sizes stay tensors, and torch's all_to_all_single rejects tensors as split sizes."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    move = moe_utils.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


# ---- FSDP2's device mesh ----------------------------------------------------------------------------------

_TORCH_FSDP = "megatron.core.distributed.torch_fully_sharded_data_parallel"


def _fsdp2_used_without_cuda(args: argparse.Namespace | None) -> bool:
    return without_cuda(args) and (args is None or getattr(args, "use_torch_fsdp2", False))


class _HostDeviceMesh:
    """torch's DeviceMesh as TorchFullyShardedDataParallel sees it: a mesh asked for on 'cuda' is on the CPU,
    where gloo shards, gathers and reduces the parameters."""

    @staticmethod
    def from_group(group, device_type: str, *args, **kwargs):
        from torch.distributed import DeviceMesh

        return DeviceMesh.from_group(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _fsdp2_mesh_on_host() -> None:
    importlib.import_module(_TORCH_FSDP).DeviceMesh = _HostDeviceMesh


_TP_RANDOM = "megatron.core.tensor_parallel.random"
_LAYER_WISE = "megatron.core.optimizer.layer_wise_optimizer"
_GRAD_BUFFER = "megatron.core.distributed.param_and_grad_buffer"
_CUDA = ("synchronize", "current_device", "empty_cache", "get_rng_state", "set_rng_state")

PATCHES = (
    Patch(
        name="CUDA entry points on the host",
        package="torch", written_for=">=2.6,<2.14",
        target="torch.cuda:synchronize",
        why="dist_checkpointing, DDP, the optimizers, the rerun state machine and NVRx call "
            f"torch.cuda.{{{','.join(_CUDA)}}}; without CUDA each raises, and each has an exact CPU meaning",
        checks=tuple(Has(f"torch.cuda:{name}") for name in _CUDA),
        apply=_patch_cuda_entry_points, when=without_cuda,
    ),
    Patch(
        name="'cuda' tensors and streams inside megatron-core's modules",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target="megatron.core.distributed.param_and_grad_buffer:torch",
        why="these modules create tensors with device='cuda' and use CUDA streams and events; each sees a "
            "`torch` whose factories make CPU tensors and whose streams are the one CPU stream",
        checks=tuple(Has(f"{name}:torch") for name in _MODULES_CREATING_CUDA_TENSORS),
        apply=_map_cuda_tensors_to_cpu, when=without_cuda,
    ),
    Patch(
        name="Muon's layer-wise optimizer on the host",
        package=PACKAGE, written_for=">=0.19,<0.20",
        target=f"{_LAYER_WISE}:torch",
        why="LayerWiseDistributedOptimizer (--optimizer muon --use-distributed-optimizer) makes a status "
            "tensor on device='cuda', and under --no-use-layer-wise-param-layout it (or, with "
            "--overlap-param-gather, the grad buffers) all-gathers each rank's parameters as pieces of "
            "different sizes, which NCCL accepts and gloo refuses; both modules see a torch whose factories "
            "make CPU tensors and whose all_gather pads the pieces to one size",
        checks=(Has(f"{_LAYER_WISE}:torch"), Has(f"{_GRAD_BUFFER}:torch"),
                Says(f"{_LAYER_WISE}:LayerWiseDistributedOptimizer.allgather_params",
                     "torch.distributed.all_gather(gather_list, src, group=group)"),
                Says(f"{_LAYER_WISE}:LayerWiseDistributedOptimizer.has_grad_norm_group", "device='cuda'"),
                Says(f"{_GRAD_BUFFER}:_ParamAndGradBucketGroup.start_param_sync",
                     "bucket.layerwise_param_flat_sizes[i]")),
        apply=_layer_wise_optimizer_on_host, when=_uses_layer_wise_optimizer,
        not_needed=_muon_refused, not_needed_on="<0.19",
    ),
    Patch(
        name="CPU tensors pass as CUDA inside named functions",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target="megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
        why="the optimizers accept only parameters whose type() is torch.cuda.*Tensor, grad clipping asserts "
            "it, and a few functions move tensors with .cuda(); only while those functions run",
        checks=(*(Has(path) for path in _PASSING_AS_CUDA), Has("torch:Tensor.type"),
                Has("torch:Tensor.cuda")),
        apply=_report_cpu_tensors_as_cuda, when=without_cuda,
    ),
    Patch(
        name="tensor-parallel RNG tracker on the CPU generator",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_TP_RANDOM}:initialize_rng_tracker",
        why="megatron-core's RNG tracker keeps CUDA generator states; sequence parallelism and MoE need it, "
            "and on CPU dropout draws from the CPU generator",
        checks=(
            Takes(f"{_TP_RANDOM}:initialize_rng_tracker",
                  ("use_te_rng_tracker", "inference_rng_tracker", "use_cudagraphable_rng", "force_reset")),
            Has(f"{_TP_RANDOM}:_CUDA_RNG_STATE_TRACKER"),
            Has(f"{_TP_RANDOM}:_CUDA_RNG_STATE_TRACKER_INITIALIZED"),
            Has(f"{_TP_RANDOM}:_MODEL_PARALLEL_RNG_TRACKER_NAME"),
            Says(f"{_TP_RANDOM}:CudaRNGStatesTracker.reset", "self.states_ = {}"),
            Says(f"{_TP_RANDOM}:CudaRNGStatesTracker.reset", "self.seeds_ = set()"),
            Says(f"{_TP_RANDOM}:CudaRNGStatesTracker.reset", "self._current_state_name"),
        ),
        apply=_rng_tracker_on_cpu_generator, when=without_cuda,
    ),
    Patch(
        name="MoE all-to-all split sizes on the host",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target="megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
        why="maybe_move_tensor_to_cpu(..., as_numpy=True) converts only CUDA tensors: on CPU the alltoall "
            "dispatcher's split sizes stay tensors, which all_to_all_single rejects",
        checks=(
            Takes("megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",
                  ("tensor", "as_numpy", "record_stream")),
            Has("megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu"),
        ),
        apply=_moe_split_sizes_on_host, when=without_cuda,
    ),
    Patch(
        name="FSDP2's device mesh on the host",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_TORCH_FSDP}:DeviceMesh",
        why="TorchFullyShardedDataParallel builds its mesh with DeviceMesh.from_group(group, 'cuda'), and "
            "fully_shard places the parameters on the mesh's device: without CUDA it raises; torch's FSDP2 "
            "itself runs on a CPU mesh over gloo",
        checks=(Has(f"{_TORCH_FSDP}:DeviceMesh"),
                Says(f"{_TORCH_FSDP}:TorchFullyShardedDataParallel.__init__",
                     'DeviceMesh.from_group(self.process_group, "cuda")')),
        apply=_fsdp2_mesh_on_host, when=_fsdp2_used_without_cuda,
    ),
)
