"""The CPU accommodations megatron-core 0.16.1 needs, in one place, applied only without CUDA.

megatron-core's torch_dist checkpointing calls `torch.cuda.synchronize()` after staging tensors and
creates small status tensors on `torch.cuda.current_device()`. Without CUDA both raise. We make
them harmless: synchronising nothing is correct when there is no device, and 'cpu' is a valid
device for those status tensors (gloo reduces CPU tensors). Attention uses our own core-attention
module on CPU (see model.py), so megatron-core's CUDA scratch buffer is never touched.

The rerun state machine (see rerun.py) saves and restores the CUDA RNG state around a rerun and
all-reduces its per-rank flags in tensors it creates on 'cuda'. Without CUDA there is no CUDA RNG,
so its state is empty and restoring it is a no-op, and the flags are reduced in CPU tensors instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_applied = False


def apply_if_needed() -> bool:
    """Patch the CUDA entry points megatron-core uses when CUDA is absent. Returns True if patched."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.get_rng_state = lambda device="cuda": torch.empty(0, dtype=torch.uint8)
        torch.cuda.set_rng_state = lambda new_state, device="cuda": None
        _reduce_rerun_flags_on_cpu()
        _applied = True
    return True


def _reduce_rerun_flags_on_cpu() -> None:
    from megatron.core.rerun_state_machine import RerunStateMachine

    if not hasattr(RerunStateMachine, "_reduce_any"):  # a release that reduces its flags some other way
        return

    def reduce_any(self, value):
        # Same contract as megatron-core's: True where any rank passed True; a tuple for a list.
        flags = torch.tensor(value if isinstance(value, list) else [value], dtype=torch.int32)
        dist.all_reduce(flags)
        reduced = tuple(bool(x > 0) for x in flags.tolist())
        return reduced if isinstance(value, list) else reduced[0]

    RerunStateMachine._reduce_any = reduce_any
