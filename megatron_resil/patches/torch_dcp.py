"""torch's distributed checkpoint (DCP): its two unpicklers routed through our allow-lists, and the private
names of its filesystem module our shard writer and checkpoint checks use; and the private names of torch
that async saves use (the shared-memory staging arena, the trainers' store the workers meet in). Why a
checkpoint is read only through allow-lists: checkpointing/safe_load.py."""

from __future__ import annotations

import pickle

from megatron_resil.patches.registry import AnyOf, Has, Patch, Says, Takes

PACKAGE = "torch"
WRITTEN_FOR = ">=2.6,<2.14"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_LOAD_BYTES = "torch.distributed.checkpoint.default_planner:DefaultLoadPlanner.load_bytes"


class _PickleForMetadata:
    """Stands in for the `pickle` module inside torch's DCP filesystem module, whose only `pickle.load`
    is the one reading `.metadata`; writing is unchanged."""

    dump = staticmethod(pickle.dump)

    @staticmethod
    def load(file):
        from megatron_resil.checkpointing import safe_load

        return safe_load.load_metadata(file, getattr(file, "name", ".metadata"))

    def __getattr__(self, attribute):
        return getattr(pickle, attribute)


def _metadata_read_through_allow_list() -> None:
    from torch.distributed.checkpoint import filesystem

    filesystem.pickle = _PickleForMetadata()


def _load_bytes_weights_only(self, read_item, value) -> None:
    """DefaultLoadPlanner.load_bytes, with weights_only=True instead of its weights_only=False."""
    from torch.distributed.checkpoint import default_planner

    from megatron_resil.checkpointing import safe_load

    storage = getattr(self, "metadata", None) and self.metadata.storage_data.get(read_item.storage_index)
    name = f"{storage.relative_path if storage else 'a .distcp file'} (item {read_item.dest_index.fqn})"
    loaded = safe_load.load_object_item(value, name, read_item.dest_index.fqn)
    if self.flatten_state_dict:
        default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
    else:
        self.state_dict[read_item.dest_index.fqn] = loaded


def _byte_items_read_weights_only() -> None:
    from torch.distributed.checkpoint import default_planner

    default_planner.DefaultLoadPlanner.load_bytes = _load_bytes_weights_only


_WRITE_ITEM_PARAMS = ("stream", "data", "write_item", "storage_key", "serialization_format")


def _async_saves(args) -> bool:
    return args is None or bool(getattr(args, "async_save", False))


def _async_replication(args) -> bool:
    return _async_saves(args) and (args is None or (getattr(args, "non_persistent_ckpt_type", None) == "local"
                                                    and bool(getattr(args, "replication", False))))

PATCHES = (
    Patch(
        name="DCP .metadata read through an allow-list",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_FILESYSTEM}:pickle",
        why="FileSystemReader reads .metadata with plain pickle.load: a crafted checkpoint runs code on "
            "load; the module's `pickle` is replaced by one whose load admits only DCP's metadata classes",
        checks=(
            Has(f"{_FILESYSTEM}:pickle"),
            Says(_FILESYSTEM, "metadata = pickle.load(metadata_file)"),
            Says(_FILESYSTEM, "pickle.load", count=1),  # the one load our stand-in takes over
        ),
        apply=_metadata_read_through_allow_list,
    ),
    Patch(
        name="DCP byte items read weights-only",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=_LOAD_BYTES,
        why="the default load planner reads byte items (rng state, param groups, extra state) with "
            "torch.load(weights_only=False): a crafted checkpoint runs code on load",
        checks=(
            Takes(_LOAD_BYTES, ("self", "read_item", "value")),
            Says(_LOAD_BYTES, "self.mappings[read_item.dest_index.fqn]"),
            Says(_LOAD_BYTES, "self.state_dict[read_item.dest_index.fqn]"),
            Says(_LOAD_BYTES, "self.original_state_dict"),
            Has("torch.distributed.checkpoint.default_planner:set_element"),
        ),
        apply=_byte_items_read_weights_only,
    ),
    # ---- dependencies ----------------------------------------------------------------------------------
    Patch(
        name="DCP record writer",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_FILESYSTEM}:_write_item",
        why="our torch_dist shard writer writes each planned record with torch's private _write_item, "
            "through a stream that checksums the bytes as they go out",
        checks=(
            AnyOf((Takes(f"{_FILESYSTEM}:_write_item", ("transforms", *_WRITE_ITEM_PARAMS)),
                   Takes(f"{_FILESYSTEM}:_write_item", _WRITE_ITEM_PARAMS))),
            Has(f"{_FILESYSTEM}:SerializationFormat.TORCH_SAVE"),
        ),
    ),
    Patch(
        name="async staging arena",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target="torch.storage:_StorageBase",
        why="an async save's staging arena is allocated straight in shared memory with UntypedStorage's "
            "private constructor _new_shared (checkpointing/staging.py), so that the worker maps it without "
            "a copy",
        # In its class: a classmethod's bound object is new on each access.
        checks=(Says("torch.storage:_StorageBase", "def _new_shared(cls, size, *, device="),
                Says("torch.storage:_StorageBase", "return cls._new_using_fd_cpu(size)")),
        when=_async_saves,
    ),
    Patch(
        name="async workers' replication store",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target="torch.distributed.distributed_c10d:_get_default_store",
        why="with --async-save the local tier's replicas are exchanged by the background workers, which meet "
            "in the TCP store under the trainers' default process group (checkpointing/replication.py)",
        checks=(Has("torch.distributed.distributed_c10d:_get_default_store"),
                Has("torch.distributed:PrefixStore.underlying_store"), Has("torch.distributed:TCPStore.host"),
                Has("torch.distributed:TCPStore.port")),
        when=_async_replication,
    ),
    Patch(
        name="DCP metadata file name",
        package=PACKAGE, written_for=WRITTEN_FOR,
        target=f"{_FILESYSTEM}:_metadata_fn",
        why="checking a checkpoint before loading it reads .metadata under the name DCP gives it",
        checks=(Has(f"{_FILESYSTEM}:_metadata_fn"),),
    ),
)
