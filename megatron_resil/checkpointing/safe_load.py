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

The patches installed at start-up (patches/torch_dcp.py, patches/megatron_core.py) put the allow-list
into the torch functions that unpickle (DCP's metadata reader and the default load planner's `load_bytes`)
and into megatron-core 0.19's legacy common.pt reader; `GlobalTier.verify` calls `check_checkpoint` before
any load, so a refused checkpoint is rejected like a corrupt one, and the loader moves on to the next
candidate. A refusal is one line naming the file and the class it asked for.

The weights-only allow-list is ours, not torch's global one: torch and megatron-core register classes
whose construction acts on the process (torch's `DeviceMesh` starts a process group; `DTensor` and the
nested-tensor rebuild build device objects; `io.BytesIO` carries bytes that Transformer Engine unpickles
in full later), so each read admits only the registered classes a checkpoint needs, and a layer's
`_extra_state` bytes are themselves unpickled through an allow-list before anything else sees them.
Every file is opened through `untrusted` (inside the checkpoint, regular, bounded in size), and a zip
archive is read only if it cannot take more memory than its size (torch_archive: no compressed entry).
"""

from __future__ import annotations

import contextlib
import enum
import io
import itertools
import os
import pickle
import re
import sys

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.strategies import common as core_common
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from torch.distributed.checkpoint import default_planner, filesystem
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from megatron_resil.checkpointing import torch_archive, untrusted
from megatron_resil.checkpointing.manifest import MANIFEST_NAME
from megatron_resil.checkpointing.tier import CheckpointDataError
from megatron_resil.module_files import module_path

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


# Of the classes registered with torch.serialization.add_safe_globals (by torch, megatron-core and us),
# the ones a checkpoint holds: the saved arguments, NumPy RNG states, megatron-core's optimizer config and
# our rerun state. Enums are admitted too (building one looks up a member). Nothing else, whoever
# registered it.
_CHECKPOINT_CLASSES = frozenset({
    "argparse.Namespace", "types.SimpleNamespace", "pathlib.PosixPath",
    "numpy.ndarray", "numpy.dtype",
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.Call", "megatron.core.rerun_state_machine.Caller",
})


def _admitted(registered) -> bool:
    target = registered[0] if isinstance(registered, tuple) else registered
    if isinstance(target, type) and issubclass(target, enum.Enum):
        return True
    module = getattr(target, "__module__", "")
    name = f"{module}.{getattr(target, '__qualname__', '')}"
    return name in _CHECKPOINT_CLASSES or (module == "numpy.dtypes" and name.endswith("DType"))


@contextlib.contextmanager
def _only_checkpoint_classes(extra: tuple = ()):
    """torch's registered safe globals cut down to `_CHECKPOINT_CLASSES` (plus `extra`) for one read,
    through torch's public registry functions; restored afterwards."""
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals([g for g in registered if _admitted(g)] + list(extra))
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(registered)


class AbsentUpstreamValue:
    """Stands for a value of a megatron-core class the installed megatron-core does not have: a newer
    release's enum in the saved arguments (Megatron-LM main saves `InferenceCudaGraphScope`, which 0.16
    lacks). It keeps what was saved and does nothing; `upstream` names the class."""

    upstream = ""

    def __init__(self, *args) -> None:
        self.args = args

    def __setstate__(self, state) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.upstream}{self.args!r}: absent from this megatron-core>"


_MAX_ABSENT = 16  # stand-ins one read may need; a checkpoint naming more is refused as ever


def _absent_from_megatron_core(wanted: str) -> bool:
    """`wanted` ("module.Name") is a megatron-core name this installation lacks (not one it has but the
    allow-list refuses: that stays refused)."""
    module, _, attribute = wanted.rpartition(".")
    if not module.startswith("megatron.core.") or not attribute.isidentifier():
        return False
    if module in sys.modules:  # imported already (megatron-core's enums are, by every run)
        return not hasattr(sys.modules[module], attribute)
    return module_path(module) is None  # not imported: nothing is, on a checkpoint's say-so


def load_weights_only(file, name: str, extra: tuple = ()):
    """torch.load with weights_only=True (explicitly, so TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD cannot turn it
    off) and only the classes a checkpoint needs (plus `extra`), a refusal as UnsafeCheckpointError. A
    megatron-core class the installed megatron-core lacks is read as an AbsentUpstreamValue, said once.
    A zip archive is first checked to take no more memory than its size (torch_archive)."""
    start = file.tell() if hasattr(file, "seek") else None
    if start is not None:
        torch_archive.check(file, name)
    absent: dict[str, type] = {}
    while True:
        try:
            with _only_checkpoint_classes(extra + tuple((cls, wanted) for wanted, cls in absent.items())):
                loaded = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            wanted = _wanted_class(err)
            if start is None or wanted in absent or len(absent) >= _MAX_ABSENT or \
                    not _absent_from_megatron_core(wanted):
                raise _refusal(name, wanted) from None
            absent[wanted] = type(wanted.rpartition(".")[2], (AbsentUpstreamValue,), {"upstream": wanted})
            file.seek(start)
            continue
        if absent:
            _say_absent(name, sorted(absent))
        return loaded


def _say_absent(name: str, classes: list[str]) -> None:
    from megatron_resil import events

    events.print_rank_0(f"[resil] load: {name} names {', '.join(classes)}, which megatron-core "
                        f"{core_version()} lacks (a newer release wrote it): kept as placeholders")


def core_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def _is_extra_state(fqn: str) -> bool:
    return "._extra_state" in fqn or fqn.startswith("_extra_state")


class _Opaque:
    """Stands for a Transformer Engine class while its extra state is only being checked on a host
    without Transformer Engine: it takes any arguments and state and does nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        pass


class ExtraStateUnpickler(pickle.Unpickler):
    """Unpickles a layer's extra state as Transformer Engine pickles it (a dict of tensors, numbers and
    its recipe dataclasses), nothing else: TE itself reads these bytes with plain `pickle.loads`."""

    _ALLOWED = frozenset({("torch._utils", "_rebuild_tensor_v2"), ("torch", "Size"),
                          ("collections", "OrderedDict"), ("torch.storage", "_load_from_bytes")})

    def __init__(self, file, name: str) -> None:
        super().__init__(file)
        self.name = name

    # How a pickled tensor names the function that rebuilds its storage: torch's own, or the weights-only
    # stand-in megatron-core 0.19 puts in its place at import (so TE's state pickled next to it names that).
    _STORAGE_FROM_BYTES = frozenset({("torch.storage", "_load_from_bytes"),
                                     ("megatron.core.safe_globals", "safe_load_from_bytes")})

    def find_class(self, module: str, name: str):
        if (module, name) in self._STORAGE_FROM_BYTES:  # a storage torch.save'd inside
            return lambda data: load_weights_only(io.BytesIO(data), self.name)
        if (module, name) in self._ALLOWED or \
                (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if module == "transformer_engine.common.recipe":
            try:
                found = super().find_class(module, name)
            except (ImportError, AttributeError):
                return _Opaque  # no TE here: the structure is checked, nothing of TE is built
            if isinstance(found, type) and \
                    (issubclass(found, enum.Enum) or hasattr(found, "__dataclass_fields__")):
                return found
        raise _refusal(self.name, f"{module}.{name}")


def check_extra_state(value, name: str) -> None:
    """Raises UnsafeCheckpointError unless `value` (a loaded `_extra_state` item) is None, plain tensors,
    or bytes that unpickle through the allow-lists (a torch.save archive or TE's pickled dict)."""
    if value is None:
        return
    if isinstance(value, (list, tuple)):
        for part in value:
            check_extra_state(part, name)
        return
    if isinstance(value, dict):
        for part in value.values():
            check_extra_state(part, name)
        return
    if isinstance(value, io.BytesIO):
        payload = value.getvalue()
    elif isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1:
        payload = value.numpy().tobytes()
    elif isinstance(value, torch.Tensor):
        return
    else:
        raise UnsafeCheckpointError(f"{name} holds a {type(value).__name__}, which is no layer's extra state")
    if not payload:
        return
    if payload[:2] == b"PK":  # torch.save's archive
        check_extra_state(load_weights_only(io.BytesIO(payload), name), name)
        return
    try:
        ExtraStateUnpickler(io.BytesIO(payload), name).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever else stops it, the bytes are not extra state
        raise UnsafeCheckpointError(f"{name}: extra state that does not unpickle as a layer's "
                                    f"({type(err).__name__}: {str(err)[:120]})") from None


def load_object_item(data, name: str, fqn: str):
    """A DCP byte item, read weights-only; a layer's extra state also checked inside."""
    if not _is_extra_state(fqn):
        return load_weights_only(data, name)
    value = load_weights_only(data, name, extra=(io.BytesIO,))  # older TE saves its state as a BytesIO
    check_extra_state(value, name)
    return value


class CommonLoadWeightsOnly(getattr(core_common, "TorchCommonLoadStrategy", object)):
    """megatron-core's common-state reader with weights_only=True stated (its own call leaves it to
    torch's default, which an environment variable can turn off), through `untrusted`. megatron-core 0.16
    takes it as load()'s common_strategy; 0.19 has no such class (nor argument). Either lane reads either
    layout: common.pt (0.16 and Megatron-LM before it) or the "common_state" object inside the torch_dist
    shards (0.19), so a checkpoint resumes on the lane that did not write it."""

    def load_common(self, checkpoint_dir):
        path = os.path.join(str(checkpoint_dir), COMMON_STATE_FNAME)
        if not os.path.lexists(path):
            return read_common_from_shards(str(checkpoint_dir))
        return _read_common_pt(path)

    def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
        """The sharded objects a format without its own object storage (zarr) keeps as `<key>/<shard>.pt`."""
        def load(sharded_object):
            path = untrusted.inside(str(checkpoint_dir), f"{sharded_object.unique_key}.pt")
            with untrusted.open_regular(path, untrusted.MAX_OBJECT_BYTES, "object file") as f:
                return load_object_item(f, path, sharded_object.key)
        return dict_list_map_inplace(load, sharded_objects_state_dict)


# megatron-core 0.19's key for the common state inside the shards: ShardedObject("common_state", None,
# (1,), (0,)).unique_key, spelled out so megatron-core 0.16 reads it too.
COMMON_STATE_KEY = "common_state/shard_0_1"


def read_common_from_shards(checkpoint_dir: str) -> dict:
    """The common state megatron-core 0.19 keeps in the shards: one byte item, a torch.save of a
    one-element list holding the dict. Read through DCP, whose `.metadata` reader and byte items go
    through the allow-lists the torch_dcp patches put in place (megatron_resil.patches), then unpickled
    weights-only here."""
    from torch.distributed import checkpoint as dcp

    # Without those patches DCP would unpickle `.metadata` and the byte items with no allow-list.
    if type(filesystem.pickle).__name__ != "_PickleForMetadata" or \
            default_planner.DefaultLoadPlanner.load_bytes.__name__ != "_load_bytes_weights_only":
        raise RuntimeError("read_common_from_shards needs megatron_resil.patches.install() first")
    state = {COMMON_STATE_KEY: io.BytesIO()}
    dcp.load(state, storage_reader=filesystem.FileSystemReader(checkpoint_dir), no_dist=True)
    loaded = state[COMMON_STATE_KEY]
    if isinstance(loaded, io.BytesIO):
        loaded.seek(0)
        loaded = load_weights_only(loaded, f"{checkpoint_dir} (item {COMMON_STATE_KEY})")
    if not isinstance(loaded, (list, tuple)) or len(loaded) != 1 or not isinstance(loaded[0], dict):
        raise CheckpointDataError(f"{checkpoint_dir}: item {COMMON_STATE_KEY} is not a common state "
                                  "(a one-element list holding a dict)")
    return loaded[0]


def _read_common_pt(path: str) -> dict:
    with untrusted.open_regular(path, untrusted.MAX_COMMON_BYTES, "common.pt") as f:
        return load_weights_only(f, path)


def read_legacy_common(checkpoint_dir) -> dict:
    """megatron-core 0.19's reader of a legacy common.pt, weights-only (patches/megatron_core.py)."""
    return _read_common_pt(os.path.join(str(checkpoint_dir), COMMON_STATE_FNAME))


def _check_items(path: str, metadata: Metadata, share: tuple[int, int]) -> None:
    """Every storage entry of `.metadata` names a regular file inside `path` and a byte range within
    it, read as stored (no DCP transform: a decompressing one is unbounded), checked before any of them is
    read; then every byte item is read through the allow-lists, and the tensor items in this caller's
    `share` = (index, count) of the files have their archives checked (torch_archive): DCP torch.load's
    each whole."""
    sizes: dict[str, int] = {}
    for index, stored in metadata.storage_data.items():
        relative = getattr(stored, "relative_path", None)
        if relative not in sizes:
            file = untrusted.inside(path, relative, shown_as=f"{relative} (for item {index.fqn})")
            sizes[relative] = os.lstat(file).st_size
        offset, length = getattr(stored, "offset", None), getattr(stored, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset
                and 0 <= length <= sizes[relative] - offset):
            raise untrusted.UntrustedPathError(
                f"{os.path.join(path, relative)}: item {index.fqn} is said to lie at bytes {offset}+{length} "
                f"of a file of {sizes[relative]}")
        if getattr(stored, "transform_descriptors", None):
            raise untrusted.UntrustedPathError(
                f"{os.path.join(path, relative)}: item {index.fqn} is stored through DCP's transforms "
                f"{stored.transform_descriptors!r}, which no checkpoint of torch_dist or megatron-core uses; "
                "refused before anything decompresses it")
    # A rank checks the tensor items of the files that are its share of the manifest's checksums (the same
    # order), so it opens no file it would not read anyway; every rank reads every byte item.
    mine, ranks = share
    order = [name for name in untrusted.regular_files(path) if name != MANIFEST_NAME]
    ours = {name for position, name in enumerate(order) if position % ranks == mine}
    for relative, entries in itertools.groupby(sorted(metadata.storage_data.items(), key=_by_place),
                                               key=lambda entry: entry[1].relative_path):
        objects, tensors = [], []
        for index, stored in entries:
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                objects.append((index, stored))
            elif relative in ours:
                tensors.append((index, stored))
        if not objects and not tensors:
            continue
        file = os.path.join(path, relative)
        with untrusted.open_regular(file) as f:
            for index, stored in objects:
                if stored.length > untrusted.MAX_OBJECT_BYTES:
                    raise untrusted.OversizedFileError(
                        f"{file}: item {index.fqn} has {stored.length} bytes, more than any object item can "
                        f"have ({untrusted.MAX_OBJECT_BYTES}); refused without reading it")
                f.seek(stored.offset)
                load_object_item(io.BytesIO(f.read(stored.length)), f"{file} (item {index.fqn})", index.fqn)
            for index, stored in tensors:
                torch_archive.check_item(f, stored.offset, stored.length, f"{file} (item {index.fqn})")


def _by_place(item) -> tuple[str, int]:
    """A storage entry's file and offset: one order on every rank, and each file read front to back."""
    return item[1].relative_path, item[1].offset


def check_checkpoint(path: str, backend: str = "torch_dist", share: tuple[int, int] = (0, 1)) -> str | None:
    """Reads every pickled object of a checkpoint through the allow-lists, without loading any tensor,
    after checking that every file it names lies inside it, and checks the tensor items' archives in this
    caller's `share` = (index, count) of its files: None if all of it is plain data, else the refusal (the
    first file and class) or why it is unreadable."""
    try:
        if backend != "torch_dist":  # zarr: common.pt and the sharded objects' .pt files
            for relative in untrusted.regular_files(path):
                if relative.endswith(".pt"):
                    file = os.path.join(path, relative)
                    limit = untrusted.MAX_COMMON_BYTES if relative == COMMON_STATE_FNAME else \
                        untrusted.MAX_OBJECT_BYTES
                    with untrusted.open_regular(file, limit, relative) as f:
                        load_object_item(f, file, relative[:-len(".pt")])
            return None
        metadata_path = os.path.join(path, filesystem._metadata_fn)
        with untrusted.open_regular(metadata_path, untrusted.MAX_METADATA_BYTES, "DCP .metadata") as f:
            metadata = load_metadata(f, metadata_path)
        if os.path.lexists(os.path.join(path, COMMON_STATE_FNAME)):
            CommonLoadWeightsOnly().load_common(path)
        _check_items(path, metadata, share)
    except CheckpointDataError as err:
        return str(err)
    except (OSError, EOFError, pickle.UnpicklingError, RuntimeError, ValueError, TypeError,
            AttributeError, MemoryError, RecursionError) as err:
        first_line = (str(err).splitlines() or [""])[0][:200]
        return f"unreadable object data: {type(err).__name__}: {first_line}"
    return None

