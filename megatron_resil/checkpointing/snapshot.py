"""The host copy of the state that an async save writes while training goes on.

The tensors are copied at the save iteration into buffers in shared memory that live as long as the tier
and are reused from save to save. Why shared: the worker process reads them without a copy (a tensor
already in shared memory crosses the process queue as a handle; a private one is copied into shared memory
by the trainer on its way there, 0.1 CPU-second per 170 MiB here). Why reused: memory allocated once is
not faulted in again at every save. Reuse is safe because one async save runs at a time and the next one
starts only after the previous one's worker is done with them (AsyncSaves.submit waits first). The cost:
one host copy of this rank's checkpointed state stays allocated for the job's life.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedTensor


class SnapshotBuffers:
    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def take(self, sharded_state: dict) -> dict:
        """Point every ShardedTensor of `sharded_state` at this save's copy of its data (in place)."""
        position = 0

        def copy(value):
            nonlocal position
            if isinstance(value, ShardedTensor) and value.data is not None:
                value.data = self._copy_into(position, value.data.detach())
                position += 1
            return value

        dict_list_map_inplace(copy, sharded_state)
        del self._buffers[position:]  # a smaller state than last time: free what it no longer needs
        return sharded_state

    def _copy_into(self, position: int, live: torch.Tensor) -> torch.Tensor:
        if position < len(self._buffers):
            buffer = self._buffers[position]
            if buffer.shape == live.shape and buffer.dtype == live.dtype:
                return buffer.copy_(live)
        buffer = torch.empty(live.shape, dtype=live.dtype, device="cpu").share_memory_()
        buffer.copy_(live)
        if position < len(self._buffers):
            self._buffers[position] = buffer
        else:
            self._buffers.append(buffer)
        return buffer
