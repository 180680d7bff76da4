"""Startup without TorchInductor: megatron-core decorates dozens of functions with `torch.compile` (its
`jit_fuser`) as its modules are imported, and the decoration alone imports TorchInductor, about 2 s of
every process's start on two cores, although nothing on the paths we run calls those functions. Here the
decoration is deferred to a function's first call, where torch.compile would compile it anyway: the same
compiled function, later. Applied before megatron-core is first imported (megatron_resil/__init__.py)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch


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


def import_megatron_core() -> None:
    """Import megatron-core with its jit_fuser bound to the deferred torch.compile (once per process);
    torch.compile itself is left as it was."""
    if "megatron.core.jit" in sys.modules:
        return  # imported already, by someone who did not ask for this
    real_compile = torch.compile
    torch.compile = _deferred(real_compile)
    try:
        import megatron.core.jit  # noqa: F401 - binds jit_fuser to torch.compile as it is now
    finally:
        torch.compile = real_compile
