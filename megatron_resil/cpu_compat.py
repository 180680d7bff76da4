"""The accommodations megatron-core 0.16.1 needs to train and checkpoint without CUDA, in one place.

megatron-core's engine (DDP, the distributed optimizer, pipeline schedules, MoE dispatchers, torch_dist
checkpointing) assumes a CUDA device throughout. Without one each assumption raises "Torch not compiled
with CUDA enabled", so each is given the meaning it has on a host with no device: synchronising or
emptying a cache does nothing, a "current device" is the CPU, a stream is the one implicit CPU stream,
and a tensor asked for on 'cuda' lives on the CPU (gloo reduces CPU tensors). `apply_if_needed` does
nothing where CUDA is present; nothing outside this module knows which case it runs in.

The scopes are as narrow as megatron-core allows: `torch.cuda` entry points that dozens of modules (and
NVRx) call are patched process-wide; literal `device='cuda'` tensors and streams are mapped only inside
the megatron-core modules that create them (`_MODULES_CREATING_CUDA_TENSORS`); the `tensor.type()` and
`tensor.cuda()` idioms only while the named functions run.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Callable, Iterator

import torch

_applied = False


def apply_if_needed() -> bool:
    """Apply every accommodation when CUDA is absent (once per process). Returns True if applied."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        _patch_cuda_entry_points()
        _map_cuda_tensors_to_cpu()
        _report_cpu_tensors_as_cuda()
        _rng_tracker_on_cpu_generator()
        _moe_split_sizes_on_host()
        _applied = True
    return True


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
# parallel checkpoint exchange.
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
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:  # a release that imports torch differently: leave it
            module.torch = torch_on_host


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
    if getattr(optimizer, "clip_grad_by_total_norm_fp32", None) is not None:
        optimizer.clip_grad_by_total_norm_fp32 = wrapped_clip
    # The fp16 loss scaler moves its restored scale to the device with `.cuda()`.
    grad_scaler.DynamicGradScaler.load_state_dict = _within_cpu_tensors_pass_as_cuda(
        grad_scaler.DynamicGradScaler.load_state_dict)
    # With pipeline stages and tied embeddings, the last stage's output layer starts as a copy moved to
    # the device with `.cuda()`.
    LanguageModule.setup_embeddings_and_output_layer = _within_cpu_tensors_pass_as_cuda(
        LanguageModule.setup_embeddings_and_output_layer)
    # The fully parallel load's exchange of loaded shards between ranks moves them with `.cuda()`.
    for name in ("exchange_loaded_tensors_gather_object", "exchange_loaded_tensors_gather_rounds",
                 "exchange_loaded_tensors_broadcast", "exchange_loaded_objects_gather_object"):
        if hasattr(exchange_utils, name):
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
