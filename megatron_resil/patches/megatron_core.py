"""megatron-core: workarounds for its bugs that strike on any device, the deferral of its torch.compile
decorations, the hooks our checkpoint saving and loading put into dist_checkpointing, and the private names
our code builds on. Each fix is checked against the code it fixes, so a release that changed that code
stops the run instead of being patched blindly. CPU-only accommodations: megatron_core_cpu.py."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
from collections.abc import Callable

from megatron_resil.patches.registry import (
    STAND_DOWN,
    AnyOf,
    Has,
    NotImported,
    Patch,
    Says,
    Takes,
    _resolve,
    _source_on_disk,
)

PACKAGE = "megatron-core"
WRITTEN_FOR = ">=0.16.1,<0.20"
_DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_SERIALIZATION = "megatron.core.dist_checkpointing.serialization"
_COMMON = "megatron.core.dist_checkpointing.strategies.common"
_ROUTER = "megatron.core.transformer.moe.router"  # imported by every run (pipeline schedules import it)
_FILESYSTEM_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_RERUN = "megatron.core.rerun_state_machine"
_TORCH_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch:TorchDistSaveShardedStrategy"
_FULLY_PARALLEL = ("megatron.core.dist_checkpointing.strategies.fully_parallel"
                   ":FullyParallelSaveStrategyWrapper")
_TENSOR_AWARE = "megatron.core.dist_checkpointing.tensor_aware_state_dict:MCoreTensorAwareStateDict"


# ---- torch.compile deferred in megatron.core.jit -------------------------------------------------------
# megatron-core decorates dozens of functions with `torch.compile` (its `jit_fuser`) as its modules are
# imported, and the decoration alone imports TorchInductor, about 2 s of every process's start on two
# cores, although nothing on the paths we run calls those functions. The decoration is deferred to a
# function's first call, where torch.compile would compile it anyway: the same compiled function, later.
# The deferral is bound when `megatron.core.jit` is first imported, through an import hook: so it is
# installed first, before anything imports megatron-core.

def _deferred(compile_now: Callable) -> Callable:
    def compile_on_first_call(model=None, **options):
        if model is None:  # used as @torch.compile(...) with options
            return lambda fn: compile_on_first_call(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return call

    return compile_on_first_call


class _DeferCompileLoader(importlib.abc.Loader):
    """Runs megatron.core.jit's module code with torch.compile deferred; torch.compile itself is left
    as it was."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        import torch  # imported already: megatron.core's package imports it first

        real_compile = torch.compile
        torch.compile = _deferred(real_compile)
        try:
            self.loader.exec_module(module)  # binds jit_fuser to torch.compile as it is now
        finally:
            torch.compile = real_compile


class _WithoutOptionalImportsLoader(importlib.abc.Loader):
    """Runs a megatron-core module's code with the optional modules it imports (_WITHOUT[its name]:
    torch.utils.tensorboard, wandb) unimportable, so that it takes its own ImportError fallbacks
    (`SummaryWriter = None`, `wandb = None`); they import as ever afterwards."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        blocked = [name for name in _WITHOUT[module.__name__] if name not in sys.modules]
        for name in blocked:
            sys.modules[name] = None  # an import of it raises ImportError
        try:
            self.loader.exec_module(module)
        finally:
            for name in blocked:
                if sys.modules.get(name, False) is None:
                    del sys.modules[name]


class _LoaderHook(importlib.abc.MetaPathFinder):
    """Has one module's code run by a loader of ours that wraps its own."""

    def __init__(self, module_name: str, wrapper) -> None:
        self.module_name, self.wrapper = module_name, wrapper

    def find_spec(self, name, path, target=None):
        if name != self.module_name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = self.wrapper(spec.loader)
        return spec


def _defer_jit_compile() -> None:
    sys.meta_path.insert(0, _LoaderHook("megatron.core.jit", _DeferCompileLoader))


def _defer_router_compile() -> None:
    sys.meta_path.insert(0, _LoaderHook(_ROUTER, _DeferCompileLoader))


def _router_compiles_nothing_at_import() -> str | None:
    if "@torch.compile" not in _source_on_disk(_ROUTER):
        return "its MoE router decorates nothing with torch.compile"
    return None


# ---- the timers without TensorBoard -------------------------------------------------------------------

_TENSORBOARD = "torch.utils.tensorboard"
_TIMERS = "megatron.core.timers"


_WANDB = "wandb"
# 0.16.1's megatron.core imports its dynamic inference context (through inference_params), which imports wandb
_DYNAMIC_CONTEXT = "megatron.core.inference.contexts.dynamic_context"
_WITHOUT: dict[str, list[str]] = {}  # module -> the optional modules its code runs without (records add)


def _without(module: str, optional: str) -> None:
    if module not in _WITHOUT:
        _WITHOUT[module] = []
        sys.meta_path.insert(0, _LoaderHook(module, _WithoutOptionalImportsLoader))
    _WITHOUT[module].append(optional)


def _timers_without_tensorboard() -> None:
    _without(_TIMERS, _TENSORBOARD)


def _without_wandb() -> None:
    _without(_TIMERS, _WANDB)
    if _context_imports_wandb():
        _without(_DYNAMIC_CONTEXT, _WANDB)


def _context_imports_wandb() -> bool:
    return "\n    import wandb  # pylint: disable=unused-import\n" in _source_on_disk(_DYNAMIC_CONTEXT)


def _no_tensorboard_dir(args) -> bool:
    # With a writer, Timers.write's `isinstance(writer, SummaryWriter)` needs the real class.
    return args is None or not getattr(args, "tensorboard_dir", None)


def _no_wandb_project(args) -> bool:
    # With W&B, Timers.write's `writer == wandb` needs the real module (train_log.py passes it).
    return args is None or not getattr(args, "wandb_project", None)


# ---- the MoE router's GEMM without Transformer Engine ---------------------------------------------------

def _router_gemm_without_transformer_engine() -> None:
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None


def _router_gemm_defined() -> str | None:
    if hasattr(_resolve(_MOE_UTILS), "te_general_gemm"):
        return "moe_utils defines te_general_gemm"
    return None


# ---- the distributed optimizer on torch's Adam ------------------------------------------------------------

def _distributed_optimizer_on_torch_adam() -> None:
    import torch
    from megatron.core.optimizer import distrib_optimizer

    optimizer_class = distrib_optimizer.DistributedOptimizer
    state_dict, load_state_dict = optimizer_class.state_dict, optimizer_class.load_state_dict

    @functools.wraps(state_dict)
    def state_dict_before_first_step(self):
        if self.optimizer.state:
            return state_dict(self)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for param in params:
            self.optimizer.state[param] = {"step": torch.tensor(0.0)}
        try:
            return state_dict(self)
        finally:
            self.optimizer.state.clear()

    @functools.wraps(load_state_dict)
    def load_state_dict_with_own_steps(self, saved):
        load_state_dict(self, saved)
        steps = {group.get("step") for group in saved.get("optimizer", {}).get("param_groups", [])} - {None}
        if len(steps) != 1:
            return
        (step,) = steps
        for param_state in self.optimizer.state.values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = torch.tensor(float(step), dtype=param_state["step"].dtype)

    set_states = optimizer_class._set_main_param_and_optimizer_states

    @functools.wraps(set_states)
    def set_states_but_step(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            own_step = self.optimizer.state.get(main_param, {}).get("step")
            if own_step is not None:
                tensors = {**tensors, "step": own_step}  # copied onto itself: unchanged
        return set_states(self, model_param, tensors)

    optimizer_class.state_dict = state_dict_before_first_step
    optimizer_class.load_state_dict = load_state_dict_with_own_steps
    optimizer_class._set_main_param_and_optimizer_states = set_states_but_step


def _optimizer_from_apex_or_te() -> str | None:
    if getattr(_resolve("megatron.core.optimizer.distrib_optimizer"), "HAVE_APEX_OR_TE", False):
        return "it wraps Apex's or Transformer Engine's Adam here, which keeps the step in its param groups"
    return None


# ---- destroy_model_parallel forgets groups ----------------------------------------------------------------

def _destroy_model_parallel_forgets_no_group() -> None:
    import torch
    from megatron.core import parallel_state

    destroy = parallel_state.destroy_model_parallel

    def holds_process_group(value) -> bool:
        if isinstance(value, torch.distributed.ProcessGroup):
            return True
        if isinstance(value, (list, tuple)):
            return any(isinstance(item, torch.distributed.ProcessGroup) for item in value)
        return False

    @functools.wraps(destroy)
    def destroy_every_group() -> None:
        destroy()
        for name, value in list(vars(parallel_state).items()):
            if not (name.startswith("_") and name.isupper()):
                continue
            if isinstance(value, dict) and holds_process_group(list(value.values())):
                value.clear()
            elif holds_process_group(value):
                setattr(parallel_state, name, None)

    parallel_state.destroy_model_parallel = destroy_every_group


# ---- the dp_reshardable format's padding ------------------------------------------------------------------

def _distributed_optimizer_padding_saved_as_zeros() -> None:
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor
    from megatron.core.optimizer import distrib_optimizer

    optimizer_class = distrib_optimizer.DistributedOptimizer
    sharded_param_state = optimizer_class.sharded_param_state_dp_reshardable

    @functools.wraps(sharded_param_state)
    def with_zeroed_padding(self, *args, **kwargs):
        state = sharded_param_state(self, *args, **kwargs)
        for key, per_dtype in state.items():
            if not isinstance(key, int):
                continue  # per_bucket_numel and the like
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        padding = entry.get("padding")
                        if isinstance(padding, LocalNonpersistentObject) and padding.obj is True:
                            for value in entry.values():
                                if isinstance(value, ShardedTensor) and value.data is not None:
                                    value.data.zero_()
        return state

    optimizer_class.sharded_param_state_dp_reshardable = with_zeroed_padding


def _no_dp_reshardable_format() -> str | None:
    if not hasattr(_resolve(_DISTRIB_OPTIMIZER), "sharded_param_state_dp_reshardable"):
        return "DistributedOptimizer has no sharded_param_state_dp_reshardable (no dp_reshardable format)"
    return None


# ---- rank 0's writes inside a collective save (checkpointing/dcp_writer.py) -------------------------------

def _common_pt_write_fails_late() -> None:
    from megatron.core.dist_checkpointing.strategies import common

    from megatron_resil.checkpointing import dcp_writer

    strategy = common.TorchCommonSaveStrategy
    strategy.save_common = dcp_writer.failing_late(strategy.save_common)


def _no_common_pt() -> str | None:
    if not hasattr(_resolve(_COMMON), "TorchCommonSaveStrategy"):
        return "it writes no common.pt (the common state travels in the torch_dist shards)"
    return None


def _metadata_writes_fail_late() -> None:
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_resil.checkpointing import dcp_writer

    writer = filesystem_async.FileSystemWriterAsync
    writer.finish = dcp_writer.failing_late(writer.finish)
    serialization.save_config = dcp_writer.failing_late(serialization.save_config)


def _write_results_queue_ours() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_resil.checkpointing import dcp_writer

    name = "get_write_results_queue" if hasattr(filesystem_async, "get_write_results_queue") \
        else "_get_write_results_queue"  # megatron-core 0.16's name
    setattr(filesystem_async, name, dcp_writer.results_queue_from(getattr(filesystem_async, name)))


# ---- a legacy common.pt read weights-only (checkpointing/safe_load.py) -----------------------------------

def _legacy_common_pt_weights_only() -> None:
    from megatron.core.dist_checkpointing import serialization

    from megatron_resil.checkpointing import safe_load

    serialization.load_common = safe_load.read_legacy_common


def _common_pt_read_through_our_strategy() -> str | None:
    if not hasattr(_resolve(_SERIALIZATION), "load_common"):
        return "its load() reads common.pt only through the common strategy we pass it"
    return None


def _no_common_load_strategy() -> str | None:
    if not hasattr(_resolve(_COMMON), "TorchCommonLoadStrategy"):
        return "it has no common.pt reader class (load() takes no common strategy)"
    return None


# ---- the rerun state machine's records in a checkpoint ---------------------------------------------------

_RERUN_CLASSES = ("RerunMode", "RerunState", "RerunDiagnostic", "Call", "Caller")


def _rerun_classes_loadable_weights_only() -> None:
    import torch
    from megatron.core import rerun_state_machine

    torch.serialization.add_safe_globals([getattr(rerun_state_machine, name) for name in _RERUN_CLASSES])


# ---- the rerun state machine as rerun.py drives it --------------------------------------------------------

_MACHINE = f"{_RERUN}:RerunStateMachine"


def _rerun_validations_reported() -> None:
    from megatron.core.rerun_state_machine import RerunStateMachine

    from megatron_resil.resilience import rerun

    validate = RerunStateMachine.validate_result

    @functools.wraps(validate)
    def validate_result(self, result, rejection_func, message, comparison_func=None, tolerance=0.0,
                        fatal=True):
        return rerun.report_validation(functools.partial(validate, self), result, rejection_func, message,
                                       comparison_func, tolerance, fatal)

    RerunStateMachine.validate_result = validate_result


def _rerun_report_left_to_rerun_py() -> None:
    from megatron.core.rerun_state_machine import RerunStateMachine

    def _maybe_report_stats(self) -> None:
        """rerun.StepValidation reports the determinism statistics (its _report_stats)."""

    RerunStateMachine._maybe_report_stats = _maybe_report_stats


def _reports_determinism_stats(args) -> bool:
    return args is None or getattr(args, "rerun_mode", None) in ("report_determinism_stats", "report_stats")


def _rerun_fresh_step_forgets_the_last_rejection() -> None:
    from megatron.core.rerun_state_machine import RerunState, RerunStateMachine

    should_run = RerunStateMachine.should_run_forward_backward

    @functools.wraps(should_run)
    def should_run_forward_backward(self, data_iterator):
        if self.state == RerunState.NOT_RUNNING_YET:  # a fresh step, not one resumed for a rerun
            self.failed_validation_call = None
            self.initial_result = None
        return should_run(self, data_iterator)

    RerunStateMachine.should_run_forward_backward = should_run_forward_backward


# ---- the optimizer's state matched to FSDP2's parameters ------------------------------------------------

_DIST_OPTIMIZER_CKPT = "megatron.core.dist_checkpointing.optimizer"


def _async_local_saves(args) -> bool:
    return args is None or (getattr(args, "async_save", False)
                            and getattr(args, "non_persistent_ckpt_type", None) == "local")


def _uses_torch_fsdp2(args) -> bool:
    return args is None or getattr(args, "use_torch_fsdp2", False)


def _to_local_returns_the_shard() -> str | None:
    from torch.distributed.tensor import DTensor

    if "view_as(" not in inspect.getsource(DTensor.to_local):
        return "torch's DTensor.to_local() returns a parameter's own local shard"
    return None


def _optimizer_params_by_local_shard() -> None:
    from torch.distributed.tensor import DTensor

    def get_optim_param_to_id_map(optim_params_iter):
        ids = {}
        for index, param in enumerate(optim_params_iter):
            ids.setdefault(id(param._local_tensor if isinstance(param, DTensor) else param), index)
        return ids

    _resolve(_DIST_OPTIMIZER_CKPT).get_optim_param_to_id_map = get_optim_param_to_id_map


_TORCH_FSDP = "megatron.core.distributed.torch_fully_sharded_data_parallel:TorchFullyShardedDataParallel"


def _fsdp2_takes_force_all_reduce() -> str | None:
    if "force_all_reduce" in inspect.signature(_resolve(_TORCH_FSDP).finish_grad_sync).parameters:
        return "its TorchFullyShardedDataParallel.finish_grad_sync takes force_all_reduce"
    return None


def _fsdp2_finish_grad_sync() -> None:
    fsdp = _resolve(_TORCH_FSDP)
    finish = fsdp.finish_grad_sync

    def finish_grad_sync(self, force_all_reduce: bool = False):
        # FSDP2 reduce-scatters each gradient in the backward pass: nothing is left to force.
        return finish(self)

    fsdp.finish_grad_sync = finish_grad_sync


PATCHES = (
    Patch(
        name="torch.compile deferred in megatron.core.jit",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target="megatron.core.jit:jit_fuser",
        why="megatron-core's modules decorate functions with torch.compile at import, which imports "
            "TorchInductor (about 2 s per process on two cores) for functions our paths never call",
        checks=(NotImported("megatron.core.jit"), Says("megatron.core.jit", "jit_fuser = torch.compile",
                                                       on_disk=True)),
        apply=_defer_jit_compile,
        on_mismatch=STAND_DOWN, without="every process imports TorchInductor at start-up (about 2 s)",
        first=True,
    ),
    Patch(
        name="torch.compile deferred in megatron.core's MoE router",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_ROUTER}:InferenceTopKRouter",
        why="0.19's router decorates a method with torch.compile itself (not jit_fuser) as the module is "
            "imported, which every run does through the pipeline schedules: dynamo imported at start-up "
            "(about 0.5 s per process) for an inference router training never calls",
        checks=(NotImported(_ROUTER), Says(_ROUTER, "@torch.compile", on_disk=True)),
        apply=_defer_router_compile,
        not_needed=_router_compiles_nothing_at_import, not_needed_on="<0.19",
        on_mismatch=STAND_DOWN, without="every process imports dynamo at start-up (about 0.5 s)",
        first=True,
    ),
    Patch(
        name="TensorBoard not imported by megatron.core.timers without --tensorboard-dir",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_TIMERS}:SummaryWriter",
        why="megatron.core imports its timers, which import torch.utils.tensorboard (and through it "
            "TensorBoard and absl: about 0.15 s of every rank's start-up and restart) for a type a run "
            "without --tensorboard-dir never uses; its own ImportError fallback is taken instead",
        checks=(NotImported(_TIMERS),
                Says(_TIMERS, "    from torch.utils.tensorboard import SummaryWriter\nexcept ImportError:\n"
                     "    SummaryWriter = None", on_disk=True),
                Says(_TIMERS, "SummaryWriter", count=6, on_disk=True)),  # none used but in write()
        apply=_timers_without_tensorboard,
        on_mismatch=STAND_DOWN, without="every process imports TensorBoard at start-up (about 0.15 s)",
        when=_no_tensorboard_dir,
        first=True,
    ),
    Patch(
        name="W&B not imported by megatron-core without --wandb-project",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_TIMERS}:wandb",
        why="megatron.core imports its timers (and 0.16's its dynamic inference context), which import "
            "wandb where it is installed (Megatron-LM's training extra installs it: about 0.5-1 s and 300 "
            "modules of every rank's start-up and restart) for a module a run without --wandb-project never "
            "uses; their own ImportError fallbacks are taken instead",
        checks=(NotImported(_TIMERS), NotImported(_DYNAMIC_CONTEXT),
                Says(_TIMERS, "try:\n    import wandb\nexcept ImportError:\n    wandb = None", on_disk=True),
                Says(_TIMERS, "wandb", count=4, on_disk=True),  # none used but in write()
                # 0.16: wandb for HAVE_WANDB and a type hint only; 0.19: not at all
                AnyOf((Says(_DYNAMIC_CONTEXT, "wandb", count=3, on_disk=True),
                       Says(_DYNAMIC_CONTEXT, "wandb", count=0, on_disk=True)))),
        apply=_without_wandb,
        on_mismatch=STAND_DOWN, without="every process imports wandb at start-up (about 0.5-1 s)",
        when=_no_wandb_project,
        first=True,
    ),
    Patch(
        name="MoE router GEMM without Transformer Engine",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_MOE_UTILS}:te_general_gemm",
        why="moe_utils tests `te_general_gemm is not None`, but binds the name only when Transformer Engine "
            "imports: without TE every MoE forward raises NameError (0.16.1; 0.19 binds it to None)",
        checks=(Says(_MOE_UTILS, "te_general_gemm is not None"),),
        apply=_router_gemm_without_transformer_engine,
        not_needed=_router_gemm_defined, not_needed_on=">=0.19",
    ),
    Patch(
        name="distributed optimizer step count on torch's Adam",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_DISTRIB_OPTIMIZER}.load_state_dict",
        why="without Apex or TE the distributed optimizer mishandles torch Adam's per-parameter `step`: "
            "state_dict() asserts before the first step, load_state_dict() gives every parameter one shared "
            "step tensor and then overwrites it (Adam's bias correction restarted after every resume), and "
            "the fully reshardable load asks for a `step` the checkpoint keeps in its param groups",
        checks=(
            Takes(f"{_DISTRIB_OPTIMIZER}.state_dict", ("self",)),
            Takes(f"{_DISTRIB_OPTIMIZER}.load_state_dict", ("self", "state_dict")),
            Takes(f"{_DISTRIB_OPTIMIZER}._set_main_param_and_optimizer_states",
                  ("self", "model_param", "tensors")),
            Says(f"{_DISTRIB_OPTIMIZER}.state_dict",
                 's["step"].item() for s in inner_state_dict["state"].values()'),
            Says(f"{_DISTRIB_OPTIMIZER}.load_state_dict", 's["step"] = step'),
            Says(f"{_DISTRIB_OPTIMIZER}._set_main_param_and_optimizer_states",
                 "self.model_param_group_index_map[model_param]"),
        ),
        apply=_distributed_optimizer_on_torch_adam,
        not_needed=_optimizer_from_apex_or_te, not_needed_on=">=0",  # with TE (GPU), on any release
    ),
    Patch(
        name="destroy_model_parallel resets every group",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target="megatron.core.parallel_state:destroy_model_parallel",
        why="destroy_model_parallel() leaves some group globals set (0.16.1: "
            "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP and its gloo twin): a group still referenced is "
            "never destroyed, so after a failure its gloo peers stay blocked (in-process restart)",
        checks=(Takes("megatron.core.parallel_state:destroy_model_parallel", ()),),
        apply=_destroy_model_parallel_forgets_no_group,
    ),
    Patch(
        name="dp_reshardable padding saved as zeros",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_DISTRIB_OPTIMIZER}.sharded_param_state_dp_reshardable",
        why="the dp_reshardable format saves each gradient bucket whole, its padding taken from torch.empty: "
            "two saves of one state differ (and so do their checksums), and garbage goes to disk",
        checks=(
            Says(f"{_DISTRIB_OPTIMIZER}.sharded_param_state_dp_reshardable", "'padding': True"),
            Says(f"{_DISTRIB_OPTIMIZER}.sharded_param_state_dp_reshardable", "torch.empty("),
            Has("megatron.core.dist_checkpointing.mapping:LocalNonpersistentObject"),
            Has("megatron.core.dist_checkpointing.mapping:ShardedTensor"),
        ),
        apply=_distributed_optimizer_padding_saved_as_zeros,
        not_needed=_no_dp_reshardable_format,
    ),
    Patch(
        name="common.pt write fails late",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_COMMON}:TorchCommonSaveStrategy.save_common",
        why="rank 0 alone writes common.pt before the collective shard write: an error there (a full disk) "
            "would leave every other rank waiting in that collective; held until the collectives complete",
        checks=(Takes(f"{_COMMON}:TorchCommonSaveStrategy.save_common",
                      ("self", "common_state_dict", "checkpoint_dir")),),
        apply=_common_pt_write_fails_late,
        not_needed=_no_common_pt, not_needed_on=">=0.19",
    ),
    Patch(
        name=".metadata and metadata.json writes fail late",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_FILESYSTEM_ASYNC}:FileSystemWriterAsync.finish",
        why="rank 0 alone writes DCP's .metadata (between the shard-write gather and the broadcast of its "
            "outcome) and metadata.json (before a barrier): an error there would leave the others waiting",
        checks=(
            Takes(f"{_FILESYSTEM_ASYNC}:FileSystemWriterAsync.finish", ("self", "metadata", "results")),
            Takes(f"{_SERIALIZATION}:save_config", ("config", "checkpoint_dir")),
            Says(f"{_SERIALIZATION}:save", "save_config("),
        ),
        apply=_metadata_writes_fail_late,
    ),
    Patch(
        name="legacy common.pt read weights-only",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_SERIALIZATION}:load_common",
        why="megatron-core 0.19's load() reads a legacy common.pt through serialization.load_common, with "
            "torch's default weights_only (an environment variable turns it off) and torch's whole "
            "allow-list; ours is weights-only with the classes a checkpoint needs (see safe_load.py)",
        checks=(
            Takes(f"{_SERIALIZATION}:load_common", ("checkpoint_dir",)),
            Says(f"{_SERIALIZATION}:load_common_state_dict", "return load_common(checkpoint_dir)"),
        ),
        apply=_legacy_common_pt_weights_only,
        not_needed=_common_pt_read_through_our_strategy, not_needed_on="<0.19",
    ),
    Patch(
        name="rerun state loadable weights-only",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target="torch.serialization:add_safe_globals",
        why="a checkpoint saved for exit 16 or 17 holds the rerun state machine's enums and call records, "
            "which torch.load(weights_only=True) refuses unless they are registered",
        checks=(Has("torch.serialization:add_safe_globals"),
                *(Has(f"{_RERUN}:{name}") for name in _RERUN_CLASSES)),
        apply=_rerun_classes_loadable_weights_only,
    ),
    # ---- dependencies: private names our code uses as they are -----------------------------------------
    Patch(
        name="torch_dist shard writer",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target="megatron.core.dist_checkpointing.strategies.torch:TorchDistSaveShardedStrategy"
               "._get_save_and_finalize_callbacks",
        why="ChecksummedTorchDistSaveStrategy overrides this private method to write the planned buckets "
            "itself, checksumming as it writes; it takes the request's async_fn arguments as megatron-core's "
            "writer builds them. For an async save it also overrides async_save to stage the main replicas "
            "this rank writes (the data-parallel spread is applied before, and only main replicas are kept), "
            "and feeds the worker's write results to the queue the writer's finalisation reads",
        checks=(
            Takes("megatron.core.dist_checkpointing.strategies.torch:TorchDistSaveShardedStrategy"
                  "._get_save_and_finalize_callbacks", ("self", "writer", "save_state_dict_ret"), more=True),
            Has("megatron.core.dist_checkpointing.strategies.async_utils:AsyncRequest.async_fn"),
            Has("megatron.core.dist_checkpointing.strategies.async_utils:AsyncRequest._replace"),
            Says(f"{_FILESYSTEM_ASYNC}:FileSystemWriterAsync.get_save_function_and_args",
                 "[torch.distributed.get_rank(), self.write_buckets, self.results_queue]"),
            Takes(f"{_TORCH_STRATEGY}.async_save", ("self", "sharded_state_dict", "checkpoint_dir")),
            Says(f"{_TORCH_STRATEGY}.async_save", "self.keep_only_main_replica"),
            Says(f"{_FULLY_PARALLEL}.async_save", "self.apply_saving_parallelization(sharded_state_dict)"),
            Says(f"{_FULLY_PARALLEL}.async_save", "self.base_strategy.async_save("),
            Says(f"{_FILESYSTEM_ASYNC}:FileSystemWriterAsync.retrieve_write_results",
                 "self.results_queue.get_nowait()"),
        ),
    ),
    Patch(
        name="write results queue",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_FILESYSTEM_ASYNC}:get_write_results_queue",  # 0.16: _get_write_results_queue
        why="megatron-core's writer asks its module's queue getter at each save; ours answers (dcp_writer) "
            "with an in-process queue for every save: a synchronous save's writer reports in this process, "
            "an async save's worker sends its results back with its reply",
        checks=(AnyOf((Has(f"{_FILESYSTEM_ASYNC}:get_write_results_queue"),
                       Has(f"{_FILESYSTEM_ASYNC}:_get_write_results_queue"))),
                AnyOf((Says(f"{_FILESYSTEM_ASYNC}:FileSystemWriterAsync.prepare_write_data",
                            "self.results_queue = get_write_results_queue()"),
                       Says(f"{_FILESYSTEM_ASYNC}:FileSystemWriterAsync.prepare_write_data",
                            "self.results_queue = _get_write_results_queue()")))),
        apply=_write_results_queue_ours,
        on_mismatch=STAND_DOWN,
        without="megatron-core starts its own Manager, which costs each rank an interpreter and dies with a "
                "job-wide SIGTERM",
    ),
    Patch(
        name="local tier's staged state",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_TENSOR_AWARE}.restore_tensor_device",
        why="an async local save stages the tensors of megatron-core's tensor-aware state dict itself and "
            "marks each that came from a GPU with `orig_device`, as its copy_tensors_to_cpu does, so that a "
            "load puts it back there",
        checks=(Says(f"{_TENSOR_AWARE}.copy_tensors_to_cpu", 'setattr(sh_ten, "orig_device", '),
                Says(f"{_TENSOR_AWARE}.restore_tensor_device", "sh_ten.data.to(sh_ten.orig_device")),
        when=_async_local_saves,
    ),
    Patch(
        name="common.pt reader subclass",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_COMMON}:TorchCommonLoadStrategy",
        why="CommonLoadWeightsOnly overrides load_common and load_sharded_objects of megatron-core 0.16's "
            "common strategy, which load() calls",
        checks=(
            Takes(f"{_COMMON}:TorchCommonLoadStrategy.load_common", ("self", "checkpoint_dir")),
            Takes(f"{_COMMON}:TorchCommonLoadStrategy.load_sharded_objects",
                  ("self", "sharded_objects_state_dict", "checkpoint_dir")),
            Says(f"{_SERIALIZATION}:load", "common_strategy.load_common(checkpoint_dir)"),
        ),
        not_needed=_no_common_load_strategy, not_needed_on=">=0.19",
    ),
    Patch(
        name="rerun state machine's validations reported to the step",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_MACHINE}.validate_result",
        why="rerun.py's one line for a rejected step says what was rejected on which rank, with the value "
            "and the rerun's; megatron-core says it only in its own log lines, one per rank and pass. Each "
            "validate_result call (rerun.py's on the loss, DDP's on each gradient bucket) goes through "
            "rerun.report_validation, which calls megatron-core's",
        checks=(Takes(f"{_MACHINE}.validate_result", ("self", "result", "rejection_func", "message",
                                                       "comparison_func", "tolerance", "fatal")),),
        apply=_rerun_validations_reported,
    ),
    Patch(
        name="rerun state machine's determinism report left to rerun.py",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_MACHINE}._maybe_report_stats",
        why="under --rerun-mode report_determinism_stats 0.16.1's own report reads Caller.filename, which "
            "Caller lacks: AttributeError on rank 0 at the first report (no upstream issue known; 0.19 reads "
            "the message); and every release's logs at INFO, which nothing shows. rerun.StepValidation "
            "reports instead",
        checks=(Takes(f"{_MACHINE}._maybe_report_stats", ("self",)),
                Says(f"{_MACHINE}.should_run_forward_backward", "self._maybe_report_stats()", count=1)),
        apply=_rerun_report_left_to_rerun_py,
        when=_reports_determinism_stats,
    ),
    Patch(
        name="rerun state machine forgets an earlier step's rejected result",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_MACHINE}.should_run_forward_backward",
        why="the machine keeps the rejected call of an earlier step and its result: in a later step rerun "
            "because another rank rejected a result, a rank whose own call matches the old one compares its "
            "rerun's result with the earlier step's, and that comparison joins the step's verdict (continue, "
            "or save and exit 16). 0.16.1 and 0.19.2; no upstream issue known. A fresh step starts without "
            "them",
        checks=(Takes(f"{_MACHINE}.should_run_forward_backward", ("self", "data_iterator")),
                Says(f"{_MACHINE}.__init__", "self.failed_validation_call"),
                Says(f"{_MACHINE}.__init__", "self.initial_result"),
                Says(f"{_MACHINE}.validate_result", "validation_call == self.failed_validation_call"),
                Has(f"{_RERUN}:RerunState.NOT_RUNNING_YET")),
        apply=_rerun_fresh_step_forgets_the_last_rejection,
    ),
    Patch(
        name="optimizer state matched to FSDP2 parameters' local shards",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_DIST_OPTIMIZER_CKPT}:get_optim_param_to_id_map",
        why="it matches each optimizer parameter to the model's ShardedTensor by id(to_local(param)), the "
            "model's being param._local_tensor; torch 2.13's to_local() of a Parameter(DTensor) is a fresh "
            "view (pytorch gh-166156), so no parameter matches and saving the optimizer under "
            "--use-torch-fsdp2 raises 'Param id 0 does not match any model sharded param'",
        checks=(
            Says(f"{_DIST_OPTIMIZER_CKPT}:get_optim_param_to_id_map", "param = to_local_if_dtensor(param)"),
            Says(f"{_DIST_OPTIMIZER_CKPT}:get_param_id_to_sharded_param_map",
                 "id(ten.data) in param_to_id_map"),
            Says("megatron.core.utils:make_tp_sharded_tensor_for_checkpoint",
                 "tensor = tensor._local_tensor"),
        ),
        apply=_optimizer_params_by_local_shard, not_needed=_to_local_returns_the_shard,
        when=_uses_torch_fsdp2,
    ),
    Patch(
        name="FSDP2's finish_grad_sync takes force_all_reduce",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_TORCH_FSDP}.finish_grad_sync",
        why="finalize_model_grads calls model_chunk.finish_grad_sync(force_all_reduce=...), which 0.16's "
            "TorchFullyShardedDataParallel (the base class's no-op) does not take: TypeError at the first "
            "step under --use-torch-fsdp2 (0.19 adds the parameter)",
        checks=(Says("megatron.core.distributed.finalize_model_grads:finalize_model_grads",
                     "finish_grad_sync(force_all_reduce=force_all_reduce)"),
                Takes(f"{_TORCH_FSDP}.finish_grad_sync", ("self",))),
        apply=_fsdp2_finish_grad_sync, not_needed=_fsdp2_takes_force_all_reduce, not_needed_on=">=0.19",
        when=_uses_torch_fsdp2,
    ),
)
