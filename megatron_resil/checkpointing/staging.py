"""The host copy an async save writes from: one arena of shared memory per run, the copy into it at the save
iteration, and how the staged tensors reach the worker process (by reference, never by value).

The arena is allocated at the first async save, sized from that save's plan (the shapes and dtypes of the
tensors this rank writes), and cut into one slot per tensor; later saves of the same structure copy into the
same slots. A new structure is re-planned: the slots are cut again, and the arena is replaced only when the
new plan no longer fits. With CUDA the arena is pinned (page-locked) once, and the device-to-host copy is
enqueued on a side stream that waits for the training stream by an event. Host tensors (all of them without
CUDA) are copied once each, into their slots, by a thread beside the training thread (torch's copy releases
the GIL), as the side stream copies beside the next forward and backward pass. Either way the trainer goes
on as soon as the copies are under way, and waits for them (`wait_copied`) only before something changes
what they read (the next optimizer step, a load).

Each slot is a tensor whose storage is exactly its slice of the arena, so megatron-core and torch.save see
ordinary tensors (a view of a larger storage would be cloned, or saved whole). The worker maps the arena
once (`ArenaPickler` sends the slots as (offset, size, shape, ...) references to it); the staged data is
read there without another copy.
"""

from __future__ import annotations

import io
import math
import pickle
import threading
import time
import weakref
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from megatron_resil import events

_ALIGN = 256  # bytes between slots: any dtype's alignment, and a cache line
_STAGED = "staged"


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _pin(storage: torch.UntypedStorage) -> bool:
    """Page-lock the arena for the GPU's DMA engine (as torch's DCP async staging does); False if the
    driver refused (e.g. a locked-memory limit): the copy then runs at pageable-memory speed."""
    cudart = torch.cuda.cudart()
    ptr, size = storage.data_ptr(), storage.nbytes()
    if int(cudart.cudaHostRegister(ptr, size, 1)) != 0:  # cudaHostRegisterPortable
        return False
    weakref.finalize(storage, cudart.cudaHostUnregister, ptr)
    return True


class HostStaging:
    """This rank's staging arena and the copy into it. One async save at a time uses it: the next save
    stages only after the previous save's worker is done reading (AsyncSaves)."""

    def __init__(self) -> None:
        self.arena: torch.UntypedStorage | None = None
        self.arena_id = 0  # bumped at each allocation: the worker maps each arena once
        self.pinned = False
        self._layout: tuple = ()
        self._slots: list[torch.Tensor] = []
        self._stream = None  # the side stream of device-to-host copies, created at the first one
        self._copied = None  # the event marking the end of the last staging's copies, until waited on
        self._copier: threading.Thread | None = None  # the host copies' thread, until waited on
        self._copy_error: BaseException | None = None
        self._said_unpinned = False
        self.copy_seconds = 0.0  # the trainer's time in the last `stage`: allocating, copying, enqueueing

    @property
    def nbytes(self) -> int:
        return 0 if self.arena is None else self.arena.nbytes()

    def stage(self, live: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of `live` in the reused slots, in order, under way when this returns: complete once
        `wait_copied` returns. Nothing may write to `live` before then."""
        began = time.monotonic()
        self.wait_copied()  # the previous save's, if nothing waited for it yet
        layout = tuple((tuple(t.shape), t.dtype) for t in live)
        if layout != self._layout:
            self._plan(layout)
        pairs = list(zip(self._slots, live, strict=True))
        on_device = [(slot, tensor) for slot, tensor in pairs if tensor.device.type == "cuda"]
        on_host = [(slot, tensor) for slot, tensor in pairs if tensor.device.type != "cuda"]
        if on_device:
            self._copy_from_device(on_device)
        if on_host:
            self._copier = threading.Thread(target=self._copy_on_host, args=(on_host,),
                                            name="ckpt-staging-copy", daemon=True)
            self._copier.start()
        self.copy_seconds = time.monotonic() - began
        return list(self._slots)

    def _copy_on_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            for slot, tensor in pairs:
                slot.copy_(tensor)
        except BaseException as err:  # noqa: BLE001 - raised to the trainer by wait_copied
            self._copy_error = err

    def _copy_from_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        # The copies read what the training stream has computed so far (this step's update), and the
        # caching allocator must not hand their sources to anyone else before the copies are done.
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for slot, tensor in pairs:
                slot.copy_(tensor, non_blocking=True)
                tensor.record_stream(self._stream)
        self._copied = torch.cuda.Event()
        self._copied.record(self._stream)

    def copying(self) -> bool:
        """True while copies of the last staging may still be running."""
        if self._copier is not None and self._copier.is_alive():
            return True
        if self._copied is not None and not self._copied.query():
            return True
        self.wait_copied()  # all done: collects an error of the host copies
        return False

    def wait_copied(self) -> None:
        """Block until the last staging's copies are complete."""
        if self._copier is not None:
            self._copier.join()
            self._copier = None
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if self._copy_error is not None:
            error, self._copy_error = self._copy_error, None
            raise RuntimeError(f"the staging copy of an async save failed: {error}") from error

    def _plan(self, layout: tuple) -> None:
        offsets, total = [], 0
        for shape, dtype in layout:
            total = _aligned(total)
            offsets.append(total)
            total += math.prod(shape) * dtype.itemsize
        reallocate = self.arena is None or self.arena.nbytes() < total
        if reallocate:
            self._slots, self.arena = [], None  # the old arena's memory goes back before the new is taken
            self.arena = torch.UntypedStorage._new_shared(max(total, 1))
            self.arena_id += 1
            self.pinned = torch.cuda.is_available() and _pin(self.arena)
            if torch.cuda.is_available() and not self.pinned and not self._said_unpinned:
                self._said_unpinned = True
                events.warn(f"async save: the {total} byte staging buffer could not be pinned "
                            "(cudaHostRegister failed); device-to-host copies run at pageable-memory speed")
        self._slots = [self._slot(offset, shape, dtype) for offset, (shape, dtype) in zip(offsets, layout,
                                                                                         strict=True)]
        self._layout = layout
        events.record("async_staging_planned", tensors=len(layout), bytes=total, arena_bytes=self.nbytes,
                      reallocated=reallocate, pinned=self.pinned)

    def _slot(self, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.empty(0, dtype=dtype).set_(self.arena[offset:offset + nbytes], 0, shape)

    def pickle(self, obj: Any) -> bytes:
        """`obj` as bytes for the worker, every staged tensor in it as a reference into the arena."""
        buffer = io.BytesIO()
        ArenaPickler(buffer, self.arena, self.arena_id).dump(obj)
        return buffer.getvalue()


class ArenaPickler(pickle.Pickler):
    """A pickler that writes each tensor whose storage lies in the arena as a reference to its place there."""

    def __init__(self, file, arena: torch.UntypedStorage | None, arena_id: int) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._base = arena.data_ptr() if arena is not None else 0
        self._size = arena.nbytes() if arena is not None else 0
        self._arena_id = arena_id

    def persistent_id(self, obj: Any):
        if not isinstance(obj, torch.Tensor) or self._size == 0 or obj.device.type != "cpu":
            return None
        storage = obj.untyped_storage()
        offset = storage.data_ptr() - self._base
        if storage.nbytes() == 0 or not 0 <= offset < self._size:
            return None
        return (_STAGED, self._arena_id, offset, storage.nbytes(), obj.storage_offset(), tuple(obj.shape),
                obj.stride(), obj.dtype)


class ArenaUnpickler(pickle.Unpickler):
    """The worker's side: staged tensors rebuilt as views of its mapping of the arena."""

    def __init__(self, file, arenas: dict[int, torch.UntypedStorage]) -> None:
        super().__init__(file)
        self._arenas = arenas

    def persistent_load(self, pid):
        kind, arena_id, offset, nbytes, storage_offset, shape, stride, dtype = pid
        if kind != _STAGED or arena_id not in self._arenas:
            raise pickle.UnpicklingError(f"staged tensor of arena {arena_id}, which this worker was not sent")
        storage = self._arenas[arena_id][offset:offset + nbytes]
        return torch.empty(0, dtype=dtype).set_(storage, storage_offset, shape, stride)


def unpickle(payload: bytes, arenas: dict[int, torch.UntypedStorage]) -> Any:
    return ArenaUnpickler(io.BytesIO(payload), arenas).load()


def structure_of(sharded_state: dict) -> tuple:
    """What a save's plan depends on: each sharded item's key, type, shape and place, not its data nor any
    plain value (the iteration). Where it is the same on every rank as at the last save, that save's plan
    (megatron-core's, and the spread over data-parallel ranks) holds again: the tiers reuse it."""
    def described(item):
        if isinstance(item, ShardedTensor):
            flat = item.flattened_range
            return ("tensor", item.key, str(item.dtype), item.local_shape, item.global_shape,
                    item.global_offset, item.axis_fragmentations, item.replica_id, item.prepend_axis_num,
                    None if flat is None else (flat.start, flat.stop))
        if isinstance(item, ShardedTensorFactory):
            return ("factory", item.key, tuple(item.data.shape), str(item.data.dtype), item.replica_id)
        if isinstance(item, ShardedObject):
            return ("object", item.key, item.global_shape, item.global_offset, item.replica_id)
        return None

    return tuple(found for item in nested_values(sharded_state) if (found := described(item)) is not None)
