"""torch outside DCP: what a rank's start-up pays for and does not use.

torch.optim keeps its optimizers out of torch.compile's way with wrappers that import torch._dynamo
(its docstrings: to keep dynamo out of torch's own imports) when first called: the methods wrapped by
`torch._compile._disable_dynamo` (`add_param_group`, `state_dict`, `zero_grad`, ... and each functional
optimizer behind `step`), and `step` itself, whose `_use_grad_for_differentiable` wrapper imports dynamo
on every call to mark two graph breaks. Building and stepping the optimizer therefore imports dynamo in
every rank, at every start and restart: about 0.5 s of CPU per rank here (17% of a tiny run's worker;
imports are the largest phase of a restart, BENCHMARKS.md "Where a restart's time goes"), for a compiler
nothing calls on CPU.

While torch._dynamo has not been imported nothing can be compiling, so there is nothing to disable and no
graph to break: the wrapped functions run as they are. The `_disable_dynamo` wrapper caches what it calls
on the wrapped function as `__dynamo_disable`; we put our own there, and its first call after anything
imported dynamo (torch.compile does) makes torch's own disabled function and caches it in our place.
`step` is replaced on the optimizer classes torch.optim defines by one that does what torch's wrapper
does minus the graph breaks, and hands over to torch's wrapper once dynamo is imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys

from megatron_resil.patches.registry import STAND_DOWN, Has, Patch, Says

PACKAGE = "torch"
WRITTEN_FOR = ">=2.6,<2.14"
_DISABLE = "torch._compile:_disable_dynamo"
_USE_GRAD = "torch.optim.optimizer:_use_grad_for_differentiable"
_CACHE = "__dynamo_disable"  # the attribute torch's wrapper looks for on the wrapped function


def _dynamo_imported() -> bool:
    return "torch._dynamo" in sys.modules  # never imported: nothing is being compiled


def _until_dynamo_is_imported(fn, recursive: bool):
    def call(*args, **kwargs):
        if not _dynamo_imported():
            return fn(*args, **kwargs)
        import torch._dynamo

        disabled = torch._dynamo.disable(fn, recursive, wrapping=False)  # what torch's wrapper makes
        setattr(fn, _CACHE, disabled)
        return disabled(*args, **kwargs)

    return call


def _closure(function) -> dict:
    """A function's free variables that are bound (a cell can be empty: a name not assigned yet)."""
    bound = {}
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=True):
        try:
            bound[name] = cell.cell_contents
        except ValueError:
            pass
    return bound


def _optimizer_classes() -> list[type]:
    import torch.optim

    classes, found = [torch.optim.Optimizer], []
    while classes:
        cls = classes.pop()
        found.append(cls)
        classes.extend(cls.__subclasses__())
    return found


def wrapped_by_disable_dynamo() -> list:
    """(wrapped function, recursive) for each function of torch.optim that torch's `_disable_dynamo`
    wraps: the optimizers' methods, and the functional optimizers their `step`s call (each kept, already
    wrapped, in its `maybe_fallback` closure)."""
    import torch._compile
    import torch.optim

    inner_code = torch._compile._disable_dynamo(lambda: None).__code__
    candidates = [method for cls in _optimizer_classes() for method in vars(cls).values()]
    candidates += [value for name, module in sys.modules.items() if name.startswith("torch.optim.")
                   for value in vars(module).values()]
    found, seen = [], set()
    for candidate in candidates:
        if not callable(candidate) or not hasattr(candidate, "__code__"):
            continue
        for function in (candidate, *(v for v in _closure(candidate).values() if hasattr(v, "__code__"))):
            if function.__code__ is inner_code and id(function) not in seen:
                seen.add(id(function))
                closure = _closure(function)
                found.append((closure["fn"], closure["recursive"]))
    return found


def _step_without_graph_breaks(torch_step):
    """torch's `_use_grad_for_differentiable` wrapper, less its two `torch._dynamo.graph_break()`s while
    dynamo is not imported (they mark a graph for a compiler that is not running)."""
    func = _closure(torch_step)["func"]

    @functools.wraps(func)
    def step(*args, **kwargs):
        if _dynamo_imported():
            return torch_step(*args, **kwargs)
        import torch

        self = args[0]
        previous = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return func(*args, **kwargs)
        finally:
            torch.set_grad_enabled(previous)

    step.torch_step = torch_step
    return step


def _optimizers_skip_dynamo_until_it_is_imported() -> None:
    optimizer_module = importlib.import_module("torch.optim.optimizer")  # torch.optim deletes the name
    for fn, recursive in wrapped_by_disable_dynamo():
        if getattr(fn, _CACHE, None) is None:
            setattr(fn, _CACHE, _until_dynamo_is_imported(fn, recursive))
    use_grad_code = optimizer_module._use_grad_for_differentiable(lambda self: None).__code__
    for cls in _optimizer_classes():
        step = vars(cls).get("step")
        if getattr(step, "__code__", None) is use_grad_code:
            cls.step = _step_without_graph_breaks(step)


PATCHES = (
    Patch(
        name="optimizers skip importing dynamo until something does",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=_DISABLE,
        why="torch.optim's optimizers import torch._dynamo when first built and stepped (about 0.5 s of "
            "every rank's start-up and restart), only to disable a compiler and break graphs of a compiler "
            "that nothing has imported; until something imports it, they run as they are",
        checks=(
            Has("torch.optim:Optimizer.add_param_group"),
            Says(_USE_GRAD, "import torch._dynamo"),
            Says(_USE_GRAD, 'torch.set_grad_enabled(self.defaults["differentiable"])'),
            Says(_USE_GRAD, "torch._dynamo.graph_break()", count=2),
            Says(_USE_GRAD, "ret = func(*args, **kwargs)"),
            Says(_DISABLE, f'getattr(fn, "{_CACHE}", None)'),
            Says(_DISABLE, "torch._dynamo.disable(fn, recursive, wrapping=False)"),
            Says(_DISABLE, f"fn.{_CACHE} = disable_fn"),
        ),
        apply=_optimizers_skip_dynamo_until_it_is_imported,
        on_mismatch=STAND_DOWN,
        without="each rank imports torch._dynamo when it builds and steps its optimizer (about 0.5 s)",
    ),
)


# ---- a standby's questions about CUDA (standby_warmup.py) ---------------------------------------------
# Not a record: nothing here stays installed. torch marks a process whose CUDA runtime was asked for its
# device count (torch.cuda.device_count() without NVML, is_available()) so that every process forked from
# it later refuses CUDA ("Cannot re-initialize CUDA in forked subprocess"). A standby imports and parses
# before it forks the ranks, and megatron-core, NVRx and our arguments ask that question while it does;
# for that while, torch's two entry points answer with the count a forked child found.

def cuda_device_count_in_a_child() -> int:
    """torch.cuda.device_count() as a forked child finds it (the child is marked, not this process)."""
    import torch

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            os.write(write, str(torch.cuda.device_count()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        found = answer.read()
    os.waitpid(pid, 0)
    return int(found or b"0")


def forks_cannot_use_cuda() -> bool:
    """Whether a process forked from this one now would be refused CUDA by torch."""
    import torch

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) != 0


@contextlib.contextmanager
def cuda_count_answered(count: int):
    """While inside, torch.cuda.device_count() and torch._C._cuda_getDeviceCount() return `count`."""
    import torch

    saved = torch.cuda.device_count, getattr(torch._C, "_cuda_getDeviceCount", None)
    torch.cuda.device_count = lambda: count
    if saved[1] is not None:
        torch._C._cuda_getDeviceCount = lambda: count
    try:
        yield
    finally:
        torch.cuda.device_count = saved[0]
        if saved[1] is not None:
            torch._C._cuda_getDeviceCount = saved[1]
