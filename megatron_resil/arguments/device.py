"""Whether this machine has CUDA, asked only while validating: importing the argument modules stays free
of torch, so a process that merely re-imports pretrain.py (the checkpoint writer's spawned helper)
starts in a fraction of a second."""

from __future__ import annotations


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def package_available(module: str) -> bool:
    """Whether a package of GPU kernels a feature needs (flash-linear-attention's `fla`, ...) is installed:
    found, not imported (several import Triton or CUDA at import time)."""
    import importlib.util

    return importlib.util.find_spec(module) is not None
