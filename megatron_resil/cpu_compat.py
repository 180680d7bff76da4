"""The CPU accommodations megatron-core 0.16.1 needs, in one place, applied only without CUDA.

megatron-core's torch_dist checkpointing calls `torch.cuda.synchronize()` after staging tensors and
creates small status tensors on `torch.cuda.current_device()`. Without CUDA both raise. We make
them harmless: synchronising nothing is correct when there is no device, and 'cpu' is a valid
device for those status tensors (gloo reduces CPU tensors). Attention uses our own core-attention
module on CPU (see model.py), so megatron-core's CUDA scratch buffer is never touched.
"""

from __future__ import annotations

import torch

_applied = False


def apply_if_needed() -> bool:
    """Patch the CUDA entry points megatron-core uses when CUDA is absent. Returns True if patched."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"
        _applied = True
    return True
