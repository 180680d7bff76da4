"""A zarr v3 sharded strategy for megatron-core's dist_checkpointing, written with tensorstore.

megatron-core 0.16 dropped its zarr strategy, but `--ckpt-format zarr` checkpoints have a use the
torch formats lack: anyone can read them outside PyTorch with tensorstore (or zarr-python, for the
dtypes it knows; bfloat16 is a zarr extension type), one array per tensor, any slice on its own.
Every chunk ends in a crc32c codec, so tensorstore verifies each chunk as it decodes it and a flipped
bit is an error rather than a silently wrong weight.

Layout under the checkpoint directory, beside megatron's common.pt, metadata.json and sharded-object
files: one zarr v3 array directory per ShardedTensor key, named by `array_name(key)` ('/' -> '.'),
holding `zarr.json` (shape = global shape, chunk shape = local shape, the original key in
attributes.megatron_key) and one file per local shard at `c/<i>/<j>/...` (chunk-grid index).
Rank 0 creates every array; each rank then writes the chunks it holds as main replica.

A checkpoint is untrusted input, and tensorstore trusts its metadata (a chunk shape of 2**40 makes it
abort the process allocating the chunk): `check_metadata` vets every array's zarr.json, and through
untrusted.py that the tree holds only plain files and directories, before tensorstore sees any of it.
Load runs it first and turns what bad data causes into CheckpointDataError, so the loader rejects the
checkpoint and falls back to an older one instead of reporting a model mismatch.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import tensorstore as ts
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import CheckpointingException, ShardedTensor, is_main_replica

try:  # megatron-core 0.16: sharded strategies registered by (backend, version)
    from megatron.core.dist_checkpointing.strategies.base import (
        LoadShardedStrategy,
        SaveShardedStrategy,
        StrategyAction,
        register_default_strategy,
    )
except ModuleNotFoundError:  # 0.19: torch_dist only, no registry; --ckpt-format zarr is refused (arguments)
    LoadShardedStrategy = SaveShardedStrategy = object
    StrategyAction = register_default_strategy = None

from megatron_resil.checkpointing import untrusted
from megatron_resil.checkpointing.tier import CheckpointDataError

BACKEND, VERSION = "zarr", 1
KEY_ATTR = "megatron_key"
_RESERVED = {"", ".", "..", "common.pt", "metadata.json"}
# numpy has no native bf16/fp8; ml_dtypes provides the numpy types tensorstore understands for them.
_ML_DTYPES = {torch.bfloat16: ml_dtypes.bfloat16, torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
              torch.float8_e5m2: ml_dtypes.float8_e5m2}
_SAME_SIZE_INT = {1: (torch.int8, np.int8), 2: (torch.int16, np.int16)}
# What a save writes and a load accepts: the dtypes of megatron's model and optimizer state that both
# torch and zarr3 name alike, with their item sizes (data_type names the torch dtype on load).
_ITEM_SIZES = {name: getattr(torch, name).itemsize for name in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
    "float8_e4m3fn", "float8_e5m2")}
# Bounds on untrusted metadata. tensorstore allocates a whole chunk to decode it, so a chunk is bounded
# in bytes; 16 GiB is far above any shard a run writes (Llama-3-8B's fp32 embedding at TP=1 is 2.1 GB).
_MAX_METADATA_BYTES = 1 << 20
_MAX_CHUNK_BYTES = 1 << 34
_MAX_RANK, _MAX_ELEMENTS = 32, 1 << 62  # tensorstore's own limits
_BYTES_CODECS = ({"name": "bytes", "configuration": {"endian": "little"}},
                 {"name": "bytes"})  # tensorstore leaves out the endianness of 1-byte types


class ChunkDataError(CheckpointingException, CheckpointDataError):
    """A chunk that is missing or fails tensorstore's crc32c check: bad data, not a model mismatch."""


class ArrayMetadataError(CheckpointingException, CheckpointDataError):
    """A zarr.json (or a file beside it) that is malformed or not what this strategy writes: bad data,
    not a model mismatch."""


def array_name(key: str) -> str:
    """Directory of a key's array. Deterministic, so load finds it from the template's key alone."""
    return key.replace("/", ".")


def _ts_spec(path: Path, **extra) -> dict:
    # tensorstore's file kvstore refuses a path with "." or ".." in it, as a relative --save may have.
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.abspath(path)}, **extra}


def _short(value) -> str:
    """An untrusted value in a one-line reason: never the whole of a 1 MiB file."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int_list(value, least: int) -> bool:
    """A list of at most _MAX_RANK integers (JSON's true and false are not), each at least `least`."""
    return isinstance(value, list) and len(value) <= _MAX_RANK and \
        all(isinstance(v, int) and not isinstance(v, bool) and v >= least for v in value)


def _chunk_problem(shape: list[int], chunk: list[int], item_size: int) -> str | None:
    """Why a chunk grid is unacceptable, or None. The save applies it too, so that no run writes a
    checkpoint its own load would reject."""
    if len(chunk) != len(shape):
        return f"chunk shape {_short(chunk)} does not have the rank of shape {_short(shape)}"
    # A dimension of length 0 still has a chunk of 1: a chunk has at least one element per dimension.
    if any(c > max(s, 1) for c, s in zip(chunk, shape, strict=True)):
        return f"chunk shape {_short(chunk)} is larger than shape {_short(shape)}"
    if math.prod(chunk) * item_size > _MAX_CHUNK_BYTES:
        return f"a chunk of shape {_short(chunk)} holds more than {_MAX_CHUNK_BYTES} bytes"
    return None


def _metadata_problem(meta, array_dir: str) -> str | None:
    """Why one array's parsed zarr.json is not one this strategy writes, or None."""
    if not isinstance(meta, dict):
        return "is not a JSON object"
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        return "is not zarr v3 array metadata (zarr_format 3, node_type array)"
    shape = meta.get("shape")
    if not (_int_list(shape, 0) and math.prod(max(s, 1) for s in shape) < _MAX_ELEMENTS):
        return f"shape {_short(shape)} is not a list of at most {_MAX_RANK} non-negative integers " \
               f"(product below 2**62)"
    dtype = meta.get("data_type")
    if not isinstance(dtype, str) or dtype not in _ITEM_SIZES:
        return f"data_type {_short(dtype)} is not one a zarr checkpoint holds ({', '.join(_ITEM_SIZES)})"
    grid = meta.get("chunk_grid")
    config = grid.get("configuration") if isinstance(grid, dict) else None
    if not (isinstance(config, dict) and grid.get("name") == "regular"):
        return f"chunk_grid {_short(grid)} is not a regular grid"
    chunk = config.get("chunk_shape")
    if not _int_list(chunk, 1):
        return f"chunk shape {_short(chunk)} is not a list of positive integers"
    if (problem := _chunk_problem(shape, chunk, _ITEM_SIZES[dtype])) is not None:
        return problem
    # load names chunk files c/<i>/<j>/... itself: the default encoding with "/" is assumed.
    if meta.get("chunk_key_encoding") != {"name": "default"}:
        return f"chunk_key_encoding {_short(meta.get('chunk_key_encoding'))} is not the default one"
    codecs = meta.get("codecs")
    if not (isinstance(codecs, list) and len(codecs) == 2 and codecs[0] in _BYTES_CODECS
            and codecs[1] == {"name": "crc32c"}):
        return f"codecs {_short(codecs)} are not bytes (little-endian) then crc32c"
    attributes = meta.get("attributes")
    key = attributes.get(KEY_ATTR) if isinstance(attributes, dict) else None
    if not isinstance(key, str) or array_name(key) != array_dir:
        return f"attributes.{KEY_ATTR} {_short(key)} does not name array directory {array_dir!r}"
    return None


def _read_array_metadata(root: str, path: str) -> dict:
    """The zarr.json at `path` (under checkpoint dir `root`), vetted. Raises CheckpointDataError, or
    OSError for what the storage does (the loader retries those)."""
    with untrusted.open_regular(path, _MAX_METADATA_BYTES, "zarr.json") as f:
        raw = f.read(_MAX_METADATA_BYTES + 1)
    if len(raw) > _MAX_METADATA_BYTES:  # it grew since it was opened
        raise ArrayMetadataError(f"{path}: more than the {_MAX_METADATA_BYTES} bytes any zarr.json can have")
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError covers bad JSON, bad UTF-8 and huge integers
        raise ArrayMetadataError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from e
    if (problem := _metadata_problem(meta, os.path.relpath(os.path.dirname(path), root))) is not None:
        raise ArrayMetadataError(f"{path}: {problem}")
    return meta


def check_metadata(checkpoint_dir: str) -> str | None:
    """None if the checkpoint is a tree of plain files and directories whose arrays' zarr.json are ones
    this strategy writes; else one line naming the file and what is wrong. Nothing is opened through
    tensorstore, no symlink is followed (so every path stays inside the checkpoint), nothing but a
    bounded regular file is read, and the walk is bounded in depth and entries. An OSError from the
    storage itself is raised, not reported: it says nothing about the checkpoint's bytes."""
    root = os.path.abspath(checkpoint_dir)
    if os.path.islink(root):
        return f"{root}: a symlink (not followed); a checkpoint is a directory of its own"
    if (irregular := untrusted.find_irregular(root)) is not None:
        return f"{root}: {irregular}"
    # Only <root>/<array>/zarr.json is ever read, by us or by tensorstore.
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "zarr.json")
        if os.path.isfile(path):
            try:
                _read_array_metadata(root, path)
            except CheckpointDataError as e:
                return str(e)
    return None


def _chunk_key(index) -> str:
    return "/".join(["c", *map(str, index)])


def _chunk_keys(region: list[tuple[int, int]], chunk: list[int]) -> list[str]:
    ranges = [range(a // c, math.ceil(b / c)) for (a, b), c in zip(region, chunk, strict=True)]
    return [_chunk_key(i) for i in itertools.product(*ranges)]


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype in _ML_DTYPES:
        # torch cannot export these to numpy; reinterpret the bits instead of converting values.
        return t.view(_SAME_SIZE_INT[t.element_size()][0]).numpy().view(_ML_DTYPES[t.dtype])
    return t.numpy()


def _from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if a.dtype.kind == "V":  # an ml_dtypes array
        return torch.from_numpy(a.view(_SAME_SIZE_INT[a.dtype.itemsize][1])).view(dtype)
    return torch.from_numpy(a)


def _together(what: str, fn) -> list:
    """Runs fn here, then all-gathers (result, error) so that a failure on any rank fails every rank at
    the same collective: no rank is left waiting in a barrier, and megatron, which writes metadata.json
    after the strategy returns, never marks a partial checkpoint complete. Returns every rank's result."""
    result, mine = None, None
    try:
        result = fn()
    except Exception as e:
        mine = e
    gathered = [(result, None if mine is None else repr(mine))]
    if dist.is_available() and dist.is_initialized():
        local, gathered = gathered[0], [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
    if mine is not None:
        raise mine
    bad = [f"rank {r}: {e}" for r, (_, e) in enumerate(gathered) if e]
    if bad:
        raise CheckpointingException(f"zarr save failed while {what} on " + "; ".join(bad))
    return [r for r, _ in gathered]


def _spec(t: ShardedTensor) -> tuple:
    if not isinstance(t, ShardedTensor):
        raise CheckpointingException(f"zarr strategy expects only ShardedTensors, got {type(t)}")
    if t.flattened_range is not None:
        raise NotImplementedError(f"zarr strategy does not support flattened_range ({t.key})")
    chunk = tuple(1 for _ in range(t.prepend_axis_num)) + tuple(max(s, 1) for s in t.local_shape)
    if any(o % c for o, c in zip(t.global_offset, chunk, strict=True)):
        raise NotImplementedError(f"{t.key}: offset {t.global_offset} is not on a chunk boundary {chunk}")
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _ITEM_SIZES:
        raise CheckpointingException(f"{t.key}: dtype {dtype} cannot be stored in a zarr checkpoint")
    if (problem := _chunk_problem(list(t.global_shape), list(chunk), _ITEM_SIZES[dtype])) is not None:
        raise CheckpointingException(f"{t.key}: {problem}; use --ckpt-format torch_dist")
    return tuple(t.global_shape), chunk, dtype


class ZarrSaveShardedStrategy(SaveShardedStrategy):
    """Saves ShardedTensors as zarr v3 arrays; `files_written_by_me()` lists what this rank wrote."""

    def __init__(self, backend: str = BACKEND, version: int = VERSION):
        super().__init__(backend, version)
        self._written: list[str] = []

    def files_written_by_me(self) -> list[str]:
        """Paths relative to the checkpoint dir written by this rank in the last save: its chunk files,
        plus every zarr.json on rank 0. Not common.pt/metadata.json/objects (megatron writes those)."""
        return list(self._written)

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        ckpt, self._written = Path(checkpoint_dir), []
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        tensors = list(nested_values(sharded_state_dict))

        def local_specs() -> dict:
            specs = {}
            for t in tensors:
                spec = _spec(t)
                if specs.setdefault(t.key, spec) != spec:
                    raise CheckpointingException(f"{t.key}: shards of one key differ in shape or dtype")
            return specs

        merged, names = {}, {}
        # Arrays are created from the union of all ranks' keys: a key may live on some ranks only.
        for rank_specs in _together("checking shards", local_specs):
            for key, spec in rank_specs.items():
                if merged.setdefault(key, spec) != spec:
                    raise CheckpointingException(f"{key}: ranks disagree on (shape, chunk, dtype), "
                                                 f"{merged[key]} vs {spec}; zarr needs a regular chunk grid")
                name = array_name(key)
                if names.setdefault(name, key) != key or name in _RESERVED or name.startswith("."):
                    raise CheckpointingException(f"key {key!r} cannot be stored as array dir {name!r}")
        # One creator, because concurrent create=True opens of one array race; the gather is the
        # barrier that keeps every rank from writing chunks before the arrays exist.
        _together("creating arrays", lambda: self._create_arrays(ckpt, merged) if rank == 0 else None)
        _together("writing chunks", lambda: self._write_chunks(ckpt, tensors))

    def _create_arrays(self, ckpt: Path, specs: dict) -> None:
        futures = []
        for key, (shape, chunk, dtype) in sorted(specs.items()):
            metadata = {"shape": list(shape), "data_type": dtype, "chunk_key_encoding": {"name": "default"},
                        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
                        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                   {"name": "crc32c"}],
                        "attributes": {KEY_ATTR: key}}
            # delete_existing: a retried save into the same dir must not keep stale chunks of an old array.
            spec = _ts_spec(ckpt / array_name(key), metadata=metadata)
            futures.append(ts.open(spec, create=True, delete_existing=True))
            self._written.append(f"{array_name(key)}/zarr.json")
        for f in futures:
            f.result()

    def _write_chunks(self, ckpt: Path, tensors: list[ShardedTensor]) -> None:
        arrays, pending = {}, []
        for t in tensors:
            if not is_main_replica(t.replica_id) or t.data.numel() == 0:
                continue
            if t.key not in arrays:
                # Without store_data_equal_to_fill_value an all-zero chunk would not be written at all,
                # and a missing chunk is indistinguishable from a lost one.
                spec = _ts_spec(ckpt / array_name(t.key), store_data_equal_to_fill_value=True)
                arrays[t.key] = ts.open(spec, open=True).result()
            _, chunk, _ = _spec(t)
            pending.append(arrays[t.key][t.global_slice()].write(_to_numpy(t.data)))
            index = [o // c for o, c in zip(t.global_offset, chunk, strict=True)]
            self._written.append(f"{array_name(t.key)}/{_chunk_key(index)}")
        for f in pending:
            f.result()


def _template_array_metadata(ckpt: Path, name: str, key: str) -> dict:
    """The vetted metadata of the array that holds a template's key."""
    try:
        meta = _read_array_metadata(str(ckpt), str(ckpt / name / "zarr.json"))
    except FileNotFoundError as e:  # a key this checkpoint does not have: another model's
        raise CheckpointingException(f"zarr array {name!r} (key {key!r}) is not in the checkpoint") from e
    if meta["attributes"][KEY_ATTR] != key:
        raise CheckpointingException(f"zarr array {name!r} does not hold key {key!r}")
    return meta


class ZarrLoadShardedStrategy(LoadShardedStrategy):
    """Reads ShardedTensors back from zarr v3 arrays; every chunk read is crc32c-verified."""

    def check_backend_compatibility(self, loaded_backend):
        if loaded_backend != BACKEND:
            raise CheckpointingException(f"zarr strategy cannot load a {loaded_backend!r} checkpoint")

    def check_version_compatibility(self, loaded_version):
        if loaded_version != VERSION:
            raise CheckpointingException(f"zarr strategy cannot load zarr format version {loaded_version}")

    def load(self, sharded_state_dict, checkpoint_dir):
        ckpt, metas, arrays, reads = Path(os.path.abspath(checkpoint_dir)), {}, {}, {}
        # GlobalTier.verify vets the metadata too; this covers every other way into a load.
        if (reason := check_metadata(str(ckpt))) is not None:
            raise ArrayMetadataError(reason)
        for t in nested_values(sharded_state_dict):
            if not isinstance(t, ShardedTensor):
                raise CheckpointingException(f"zarr strategy expects only ShardedTensors, got {type(t)}")
            name = array_name(t.key)
            if name not in metas:
                metas[name] = _template_array_metadata(ckpt, name, t.key)
            meta = metas[name]
            stored, expected = tuple(meta["shape"]), tuple(t.global_shape)
            if stored != expected and (not t.allow_shape_mismatch or len(stored) != len(expected)):
                raise CheckpointingException(f"{t.key}: stored shape {stored} != expected {t.global_shape}")
            if name not in arrays:
                try:
                    arrays[name] = ts.open(_ts_spec(ckpt / name), open=True).result()
                except ValueError as e:  # what tensorstore raises for metadata it cannot use
                    raise ArrayMetadataError(f"zarr array {name!r} (key {t.key!r}): tensorstore cannot "
                                             f"open it: {e}") from e
            # Prepended axes are read as length-1 slices and squeezed later; with allow_shape_mismatch
            # only the part inside the stored array is read and the rest stays zero.
            full = [1] * t.prepend_axis_num + list(t.local_shape)
            region = [(o, min(o + n, s)) for o, n, s in zip(t.global_offset, full, stored, strict=True)]
            if any(b <= a for a, b in region):
                reads[id(t)] = ([], None)
                continue
            chunks = _chunk_keys(region, meta["chunk_grid"]["configuration"]["chunk_shape"])
            # tensorstore reads an absent chunk as the fill value; our saves write every chunk, so a
            # missing file means a lost one.
            missing = [c for c in chunks if not (ckpt / name / c).is_file()]
            if missing:
                raise ChunkDataError(f"zarr array {name!r} (key {t.key!r}) lacks chunk(s) {missing}")
            reads[id(t)] = (chunks, arrays[name][tuple(slice(a, b) for a, b in region)].read())

        def finish(t: ShardedTensor) -> torch.Tensor:
            chunks, future = reads[id(t)]
            full = [1] * t.prepend_axis_num + list(t.local_shape)
            if future is None:
                return torch.zeros(t.local_shape, dtype=t.dtype)
            try:
                data = future.result()
            except (ValueError, RuntimeError, OSError) as e:
                raise ChunkDataError(
                    f"zarr array {array_name(t.key)!r} (key {t.key!r}), chunk(s) {chunks}: corrupt or "
                    f"unreadable (crc32c checksum verification by tensorstore failed?): {e}") from e
            src = _from_numpy(data, getattr(torch, metas[array_name(t.key)]["data_type"])).to(t.dtype)
            if list(src.shape) != full:  # only with allow_shape_mismatch: zero-pad what is not stored
                out = torch.zeros(full, dtype=t.dtype)
                out[tuple(slice(0, n) for n in src.shape)] = src
                src = out
            return src.reshape(t.local_shape)

        return dict_list_map_inplace(finish, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir):
        root, result = os.path.abspath(checkpoint_dir), {}
        if (reason := check_metadata(root)) is not None:
            raise ArrayMetadataError(reason)
        for d in sorted(Path(root).iterdir()):
            if not (d / "zarr.json").is_file():
                continue  # common.pt, metadata.json, sharded-object dirs
            meta = _read_array_metadata(root, str(d / "zarr.json"))
            key = meta["attributes"][KEY_ATTR]
            empty = torch.empty(meta["shape"], dtype=getattr(torch, meta["data_type"]), device="meta")
            result[key] = ShardedTensor.from_rank_offsets(key, empty).without_data()
        return result


def register() -> None:
    """Make ('zarr', 1) loadable and savable by default. Safe to call any number of times; nothing to do
    on a megatron-core without a strategy registry (0.19), which cannot read or write zarr at all."""
    if register_default_strategy is None:
        return
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, ZarrLoadShardedStrategy())
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, ZarrSaveShardedStrategy())


def declared_elements(checkpoint_dir: str) -> int:
    """The elements all arrays of a checkpoint declare in their zarr.json (checked as check_metadata
    checks them): what --use-checkpoint-args compares a model's size with before building it."""
    root = os.path.abspath(checkpoint_dir)
    total = 0
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "zarr.json")
        if os.path.isfile(path):
            total += math.prod(_read_array_metadata(root, path)["shape"])
    return total
