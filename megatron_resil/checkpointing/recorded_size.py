"""How many tensor elements a checkpoint can hold, from what it records of itself and read before any model
is built: the shapes DCP's `.metadata` declares (through safe_load's allow-list) or zarr's zarr.json, no
more than the bytes its files hold where each element takes one at least (no compression). A model larger
than this cannot be what the checkpoint holds, so --use-checkpoint-args refuses saved arguments that
describe one (arguments/checkpoint_args.py) rather than allocate it."""

from __future__ import annotations

import math
import os

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_resil.checkpointing import safe_load, torch_format, untrusted, zarr_strategy
from megatron_resil.checkpointing.tier import CheckpointDataError

METADATA = ".metadata"


def recorded_elements(path: str) -> tuple[int, str]:
    """(the most tensor elements the checkpoint directory `path` holds, what that figure is, as a clause).
    Raises CheckpointDataError for records that are no shapes, OSError for what the storage does."""
    stored = sum(os.lstat(os.path.join(path, name)).st_size for name in untrusted.regular_files(path))
    in_files = f"its files hold {stored:,} bytes"
    if torch_format.is_torch_checkpoint(path):  # torch.save keeps every element whole
        return stored, in_files
    metadata_path = os.path.join(path, METADATA)
    if not os.path.lexists(metadata_path):
        declared = zarr_strategy.declared_elements(path)  # chunks equal to the fill value are not written
        return declared, f"its arrays' zarr.json declare {declared:,} elements"
    with untrusted.open_regular(metadata_path, untrusted.MAX_METADATA_BYTES, "DCP .metadata") as f:
        metadata = safe_load.load_metadata(f, metadata_path)
    declared = _declared(metadata, metadata_path)
    said = f"its .metadata declares tensors of {declared:,} elements"
    # DCP's stream transforms (compression) are the one way its items take less than their elements.
    transformed = any(getattr(info, "transform_descriptors", None) for info in metadata.storage_data.values())
    if declared <= stored or transformed:
        return declared, said
    return stored, f"{in_files} (its .metadata claims tensors of {declared:,} elements)"


def _declared(metadata, name: str) -> int:
    if not (isinstance(metadata.state_dict_metadata, dict) and isinstance(metadata.storage_data, dict)):
        raise CheckpointDataError(f"{name}: its index of items is not a mapping, as DCP writes it")
    total = 0
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        shape = entry.size
        if not (isinstance(shape, tuple) and all(type(n) is int and n >= 0 for n in shape)):
            item = f"item {ascii(fqn[:80])}" if isinstance(fqn, str) else "an item"
            raise CheckpointDataError(f"{name}: {item} has a shape that is no tensor's (a tuple of sizes)")
        total += math.prod(shape)
    return total
