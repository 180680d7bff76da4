"""Reading a checkpoint never runs code from it.

A checkpoint directory is untrusted input, and a torch_dist checkpoint holds three kinds of pickled
bytes: DCP's `.metadata` (torch reads it with plain `pickle.load`), `common.pt` (megatron-core reads it
with `torch.load`), and the byte items inside the `.distcp` files (rng_state, the optimizer's
param_groups, Transformer Engine's extra state; torch reads them with `torch.load(weights_only=False)`).
A pickle can name any callable, so each of these would run whatever a planted file asks for, as root,
on every rank, with only `--load` given; checksums do not help, since whoever writes the bytes can
write the manifest too.

So every read goes through an allow-list:
- `.metadata` through `MetadataUnpickler`, which resolves only the classes torch's DCP writes there;
- `common.pt` and the byte items through `torch.load(weights_only=True)`, whose unpickler allows
  tensors, plain containers and the classes registered with `torch.serialization.add_safe_globals`
  (megatron-core's own list, and our rerun state).

`install()` puts the allow-list into the two torch functions that unpickle (DCP's metadata reader and
the default load planner's `load_bytes`); `GlobalTier.verify` calls `check_checkpoint` before any load,
so a refused checkpoint is rejected like a corrupt one, and the loader moves on to the next candidate.
A refusal is one line naming the file and the class it asked for.
"""

from __future__ import annotations

import io
import os
import pickle
import re

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from torch.distributed.checkpoint import default_planner, filesystem
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from megatron_resil.checkpointing.tier import CheckpointDataError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
# What torch's DCP writer (and megatron-core's, which caches its save plans in it) puts in `.metadata`.
_METADATA_CLASSES = frozenset({
    (_DCP_METADATA, "Metadata"), (_DCP_METADATA, "MetadataIndex"), (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "ChunkStorageMetadata"), (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "TensorStorageMetadata"), (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    (_DCP_PLANNER, "SavePlan"), (_DCP_PLANNER, "WriteItem"), (_DCP_PLANNER, "WriteItemType"),
    (_DCP_PLANNER, "TensorWriteData"), (_DCP_PLANNER, "BytesIOWriteData"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # A cached save plan's storage_data (Megatron's --ckpt-assume-constant-structure): a prefix string.
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to torch's layout object
    ("torch", "Size"),
    ("collections", "OrderedDict"),
})


class UnsafeCheckpointError(CheckpointDataError):
    """A checkpoint file asked for a class outside the allow-list; nothing of it was run."""


def _refusal(path: str, wanted: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{path} asks to unpickle {wanted}, which no checkpoint of torch_dist or "
                                 "megatron-core holds; refused without running it")


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata`: its dataclasses, enums, torch.Size and dtypes, nothing else."""

    def __init__(self, file, name: str) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES or \
                (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _refusal(self.name, f"{module}.{name}")


def load_metadata(file, name: str) -> Metadata:
    metadata = MetadataUnpickler(file, name).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{name} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def _wanted_class(err: Exception) -> str:
    """The global torch's weights-only unpickler refused, from its message."""
    found = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(err))
    return found.group(1) if found else f"something it does not allow ({str(err).splitlines()[0][:120]})"


def load_weights_only(file, name: str):
    """torch.load with weights_only=True (explicitly, so TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD cannot turn it
    off), a refusal as UnsafeCheckpointError."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise _refusal(name, _wanted_class(err)) from None


class _PickleForMetadata:
    """Stands in for the `pickle` module inside torch's DCP filesystem module, whose only `pickle.load`
    is the one reading `.metadata`; writing is unchanged."""

    dump = staticmethod(pickle.dump)

    @staticmethod
    def load(file):
        return load_metadata(file, getattr(file, "name", ".metadata"))

    def __getattr__(self, attribute):
        return getattr(pickle, attribute)


def _load_bytes_weights_only(self, read_item, value: io.BytesIO) -> None:
    """DefaultLoadPlanner.load_bytes, with weights_only=True instead of its weights_only=False."""
    storage = getattr(self, "metadata", None) and self.metadata.storage_data.get(read_item.storage_index)
    name = f"{storage.relative_path if storage else 'a .distcp file'} (item {read_item.dest_index.fqn})"
    loaded = load_weights_only(value, name)
    if self.flatten_state_dict:
        default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
    else:
        self.state_dict[read_item.dest_index.fqn] = loaded


class CommonLoadWeightsOnly(TorchCommonLoadStrategy):
    """megatron-core's common.pt reader with weights_only=True stated (its own call leaves it to torch's
    default, which an environment variable can turn off)."""

    def load_common(self, checkpoint_dir):
        path = os.path.join(str(checkpoint_dir), COMMON_STATE_FNAME)
        with open(path, "rb") as f:
            return load_weights_only(f, path)

    def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
        """The sharded objects a format without its own object storage (zarr) keeps as `<key>/<shard>.pt`."""
        def load(sharded_object):
            path = os.path.join(str(checkpoint_dir), f"{sharded_object.unique_key}.pt")
            with open(path, "rb") as f:
                return load_weights_only(f, path)
        return dict_list_map_inplace(load, sharded_objects_state_dict)


def install() -> None:
    filesystem.pickle = _PickleForMetadata()
    default_planner.DefaultLoadPlanner.load_bytes = _load_bytes_weights_only


def check_checkpoint(path: str, backend: str = "torch_dist") -> str | None:
    """Reads every pickled object of a checkpoint through the allow-lists, without loading any tensor:
    None if all of it is plain data, else the refusal (the first file and class) or why it is unreadable."""
    try:
        if backend != "torch_dist":  # zarr: common.pt and the sharded objects' .pt files
            for directory, _, files in os.walk(path):
                for name in sorted(f for f in files if f.endswith(".pt")):
                    with open(os.path.join(directory, name), "rb") as f:
                        load_weights_only(f, os.path.join(directory, name))
            return None
        with open(os.path.join(path, filesystem._metadata_fn), "rb") as f:
            metadata = load_metadata(f, os.path.join(path, filesystem._metadata_fn))
        if os.path.exists(os.path.join(path, COMMON_STATE_FNAME)):
            with open(os.path.join(path, COMMON_STATE_FNAME), "rb") as f:
                load_weights_only(f, os.path.join(path, COMMON_STATE_FNAME))
        for index, stored in metadata.storage_data.items():
            if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                continue
            file = os.path.join(path, stored.relative_path)
            with open(file, "rb") as f:
                f.seek(stored.offset)
                load_weights_only(io.BytesIO(f.read(stored.length)), f"{file} (item {index.fqn})")
    except UnsafeCheckpointError as err:
        return str(err)
    except (OSError, EOFError, pickle.UnpicklingError, RuntimeError, ValueError, TypeError,
            AttributeError) as err:
        first_line = (str(err).splitlines() or [""])[0][:200]
        return f"unreadable object data: {type(err).__name__}: {first_line}"
    return None


install()
