"""One rank's local checkpoint, serialized once by its owner: the unit the local tier writes,
replicates and verifies.

The owner turns its tensor-aware state dict into bytes and records their size and CRC32 at that
moment. Every copy, its own file or a replica on another node, is those same bytes, so one checksum
computed by the owner verifies all of them, at rest and after every transfer. (NVRx replicates the
tensors and each holder pickles them again, so a copy could never be checked against its owner.) With
--async-save the sealing is done by the owner's background worker, from the state its trainer staged.

Reading a shard unpickles it with `torch.load(weights_only=True)` (its archive first checked to hold no
compressed entry: safe_load, torch_archive) and only megatron-core's three checkpoint classes allowed, and
only after its checksum matched: a local checkpoint directory is
node-local scratch space, and nothing found there runs code. A layer's `_extra_state` is checked inside
too, before anything loads it: Transformer Engine's set_extra_state unpickles those bytes with plain pickle.
"""

from __future__ import annotations

import io
import os

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict

from megatron_resil.checkpointing import safe_load, untrusted
from megatron_resil.checkpointing.dcp_writer import without_torch_record_crc
from megatron_resil.checkpointing.manifest import extend_checksum

_SAFE_CLASSES = (MCoreTensorAwareStateDict, ShardedTensor, ShardedObject)


def serialize(state: MCoreTensorAwareStateDict) -> torch.Tensor:
    """A shard's bytes: torch.save of the state into memory, without torch's own per-record CRCs (the
    seal's checksum covers every byte), as a uint8 tensor over that memory (not a copy of it)."""
    buffer = io.BytesIO()
    with without_torch_record_crc():
        torch.save(state, buffer)
    return torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)


def crc32_of(data) -> int:
    """CRC-32 with zlib's values, by ISA-L where installed (every save and every load runs it)."""
    return extend_checksum(0, memoryview(data).cast("B"), "crc32")


class _BufferReader(io.RawIOBase):
    """A seekable file over bytes in memory, without copying them first (io.BytesIO would)."""

    def __init__(self, buffer) -> None:
        self._view = memoryview(buffer).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        n = max(0, min(len(target), len(self._view) - self._pos))
        target[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def read_payload(path, max_bytes: int | None = None) -> torch.Tensor:
    """A file's bytes (at most `max_bytes`) as a uint8 tensor, read once into memory of its own."""
    # A FIFO planted in the local directory must not block; a sparse file of a terabyte must not be read.
    with untrusted.open_regular(str(path), max_bytes, "local shard") as f:
        buffer = bytearray(os.fstat(f.fileno()).st_size)
        view, done = memoryview(buffer), 0
        while done < len(buffer) and (n := f.readinto(view[done:])):
            done += n
    return torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)


def check_extra_states(state: MCoreTensorAwareStateDict, name: str) -> None:
    """Raises UnsafeCheckpointError unless every `_extra_state` entry of an unsealed shard (a sharded
    object's data, or an entry of its common part under such a key) passes safe_load's allow-lists."""
    def visit(value, key: str) -> None:
        if isinstance(value, ShardedObject):
            key, value = value.key, value.data
        if "_extra_state" in key:
            safe_load.check_extra_state(value, f"{name} (item {key})")
        elif isinstance(value, dict):
            for inner_key, inner in value.items():
                visit(inner, str(inner_key))
        elif isinstance(value, (list, tuple)):
            for inner in value:
                visit(inner, key)

    visit(state.common, "")
    visit(state.sharded_state_dict, "")


class SealedShard(TensorAwareStateDict):
    """Bytes plus the owner's account of them: {"iteration", "owner", "size", "crc32"}.

    To NVRx this is a state dict with a single tensor (the bytes), which is what its replication
    and its exchange plans move between ranks. `comm_device` is where the bytes travel: the CPU
    with gloo, the GPU with NCCL.
    """

    def __init__(self, payload: torch.Tensor | None, meta: dict, comm_device: str = "cpu") -> None:
        self.payload = payload
        self.meta = dict(meta)
        self.comm_device = comm_device

    @classmethod
    def seal(cls, state: MCoreTensorAwareStateDict, *, iteration: int, owner: int,
             comm_device: str = "cpu") -> SealedShard:
        return cls.of_bytes(serialize(state), iteration=iteration, owner=owner, comm_device=comm_device)

    @classmethod
    def of_bytes(cls, payload: torch.Tensor, *, iteration: int, owner: int,
                 comm_device: str = "cpu") -> SealedShard:
        """The owner's seal of its serialized shard: the bytes' size and CRC32, computed now."""
        meta = {"iteration": iteration, "owner": owner, "size": payload.numel(),
                "crc32": crc32_of(payload.numpy())}
        return cls(payload, meta, comm_device)

    def problem(self) -> str | None:
        """None if the bytes are what the owner sealed, else why not."""
        if self.payload is None:
            return "no data"
        if self.payload.numel() != self.meta["size"]:
            return f"{self.payload.numel()} bytes, its owner sealed {self.meta['size']}"
        crc = crc32_of(self.payload.numpy())
        if crc != self.meta["crc32"]:
            return f"fails its owner's checksum (crc32 {crc:08x}, owner's {self.meta['crc32']:08x})"
        return None

    def unseal(self) -> MCoreTensorAwareStateDict:
        name = f"the local shard of rank {self.meta.get('owner')}"
        state = safe_load.load_weights_only(_BufferReader(self.payload.numpy()), name, extra=_SAFE_CLASSES)
        check_extra_states(state, name)
        state.restore_tensor_device(non_blocking=False)
        return state

    # ---- TensorAwareStateDict: what NVRx calls to move the shard between ranks --------------
    def pop_tensors(self) -> list[torch.Tensor]:
        data = self.payload.to(self.comm_device)
        self.payload = None
        return [data]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.payload]

    @property
    def is_hollow(self) -> bool:
        return self.payload is None

    def insert_tensors(self, tensor_data) -> None:
        (data,) = list(tensor_data)
        self.payload = data

    def init_tensors(self) -> None:
        self.payload = torch.empty(self.meta["size"], dtype=torch.uint8, device=self.comm_device)

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        self.payload = self.payload.to("cpu")

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        pass  # the bytes live on the CPU; the unsealed state restores its own devices
