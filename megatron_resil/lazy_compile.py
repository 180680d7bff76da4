"""Startup without TorchInductor: megatron-core decorates dozens of functions with `torch.compile` (its
`jit_fuser`) as its modules are imported, and the decoration alone imports TorchInductor, about 2 s of
every process's start on two cores, although nothing on the paths we run calls those functions. Here the
decoration is deferred to a function's first call, where torch.compile would compile it anyway: the same
compiled function, later.

The deferral is bound when `megatron.core.jit` is first imported, by whoever imports it: an import hook
installed by megatron_resil/__init__.py, which itself imports nothing heavy, so a process that only
parses arguments or serves a queue (the writer's Manager re-imports pretrain.py) never pays for torch
and megatron-core."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable


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


class _JitImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "megatron.core.jit":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferCompileLoader(spec.loader)
        return spec


def install() -> None:
    """Once per process, before megatron-core is imported (a no-op if someone imported it already)."""
    if "megatron.core.jit" in sys.modules or any(isinstance(f, _JitImportHook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitImportHook())
