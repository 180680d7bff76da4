"""A checkpoint directory is untrusted: a pickle planted in any of its object files (DCP's .metadata,
common.pt, a byte item inside a .distcp file) is refused with one line naming the file and the class,
is never run (each test checks that the command the pickle carries left no trace), and the loader
falls back to the next checkpoint."""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path

import pytest

from tests import launch

V0_1 = launch.REPO / "tests" / "data" / "checkpoint_v0_1" / "iter_0000002"


class _Planted:
    """Unpickling this runs a shell command (what an attacker would plant)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _metadata(path: Path):
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own, trusted copy


def _plant_in_metadata(ckpt: Path, marker: Path) -> str:
    metadata = _metadata(ckpt)
    metadata.planner_data = _Planted(marker)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return ".metadata"


def _plant_in_common(ckpt: Path, marker: Path) -> str:
    """Plants in the common state wherever the checkpoint keeps it: common.pt (megatron-core 0.16 and
    Megatron-LM before it) or, with megatron-core 0.19, the "common_state" byte item inside the shards
    (a torch.save of a one-element list holding the dict). Returns the name a refusal gives it."""
    import torch

    from megatron_resil.checkpointing.safe_load import COMMON_STATE_KEY
    if (ckpt / "common.pt").exists():
        common = torch.load(ckpt / "common.pt", weights_only=False)  # the test's own, trusted copy
        common["planted"] = _Planted(marker)
        torch.save(common, ckpt / "common.pt")
        return "common.pt"
    stored = next(s for i, s in _metadata(ckpt).storage_data.items() if i.fqn == COMMON_STATE_KEY)
    with open(ckpt / stored.relative_path, "rb") as f:
        f.seek(stored.offset)
        (common,) = torch.load(io.BytesIO(f.read(stored.length)), weights_only=False)  # trusted, as above
    common["planted"] = _Planted(marker)
    replace_byte_item(ckpt, lambda fqn: fqn == COMMON_STATE_KEY, [common])
    return f"{stored.relative_path} (item {COMMON_STATE_KEY})"


def _plant_in_byte_item(ckpt: Path, marker: Path, fqn_prefix: str = "rng_state") -> str:
    """Replaces one byte item of a .distcp file with a planted torch.save. Returns the file's name."""
    _, stored = replace_byte_item(ckpt, lambda fqn: fqn.startswith(fqn_prefix), _Planted(marker))
    return stored.relative_path


def replace_byte_item(ckpt: Path, chosen, value, serialized=bytes):
    """Replaces the first item (a byte item, or a tensor's) whose fqn `chosen` accepts with
    `serialized`(torch.save(value)), shifts the items behind it, and rewrites .metadata to match (an
    attacker controls every byte). Returns its (MetadataIndex, old _StorageInfo)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    metadata = _metadata(ckpt)
    index, stored = next((i, s) for i, s in metadata.storage_data.items() if chosen(i.fqn))
    planted = io.BytesIO()
    torch.save(value, planted)
    file = ckpt / stored.relative_path
    data = file.read_bytes()
    new = serialized(planted.getvalue())
    file.write_bytes(data[:stored.offset] + new + data[stored.offset + stored.length:])
    shift = len(new) - stored.length
    for other, info in list(metadata.storage_data.items()):
        if info.relative_path == stored.relative_path and info.offset > stored.offset:
            metadata.storage_data[other] = _StorageInfo(info.relative_path, info.offset + shift, info.length,
                                                        info.transform_descriptors)
    metadata.storage_data[index] = _StorageInfo(stored.relative_path, stored.offset, len(new),
                                                stored.transform_descriptors)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return index, stored


@pytest.fixture
def checkpoint(tmp_path):
    ckpt = tmp_path / "iter_0000002"
    shutil.copytree(V0_1, ckpt)
    return ckpt


def test_an_untouched_checkpoint_passes_the_check(checkpoint):
    from megatron_resil.checkpointing import safe_load
    assert safe_load.check_checkpoint(str(checkpoint)) is None


@pytest.mark.parametrize("where", ["metadata", "common", "byte_item"])
def test_a_planted_pickle_is_refused_naming_the_file_and_class_and_never_runs(checkpoint, tmp_path, where):
    from megatron_resil.checkpointing import safe_load
    marker = tmp_path / "code_ran"
    plant = {"metadata": _plant_in_metadata, "common": _plant_in_common,
             "byte_item": _plant_in_byte_item}[where]
    named = plant(checkpoint, marker)

    reason = safe_load.check_checkpoint(str(checkpoint))
    assert reason is not None and named in reason and "system" in reason, reason
    assert "refused without running it" in reason
    assert not marker.exists()


def test_torchs_own_readers_refuse_it_too(checkpoint, tmp_path):
    """What megatron-core calls during a load: DCP's metadata reader and the default planner's
    load_bytes (weights_only=False upstream); both go through the allow-list once installed, as
    pretrain.py installs it at start-up."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from megatron_resil import patches
    from megatron_resil.checkpointing import safe_load
    patches.install()
    marker = tmp_path / "code_ran"
    plain = FileSystemReader(str(checkpoint)).read_metadata()
    _plant_in_metadata(checkpoint, marker)
    with pytest.raises(safe_load.UnsafeCheckpointError, match=r"\.metadata asks to unpickle posix\.system"):
        FileSystemReader(str(checkpoint)).read_metadata()

    planner = DefaultLoadPlanner()
    planner.set_up_planner({}, plain)
    planted = io.BytesIO()
    torch.save(_Planted(marker), planted)
    planted.seek(0)
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("x"), [], MetadataIndex("x"), [], [])
    with pytest.raises(safe_load.UnsafeCheckpointError, match="posix.system"):
        planner.load_bytes(item, planted)
    assert not marker.exists()


def checkpoints_of_iterations_1_to_4(save: Path) -> list[str]:
    """Trains 4 iterations saving each one under `save`; returns the arguments that resume there."""
    args = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--save", str(save), "--load", str(save),
            "--save-interval", "1"]
    first = launch.run([*args, "--train-iters", "4"])
    assert first.returncode == 0, first.stdout[-3000:]
    return args


@pytest.mark.slow
def test_the_loader_rejects_each_planted_checkpoint_and_resumes_from_a_clean_one(tmp_path):
    save = tmp_path / "ckpt"
    marker = tmp_path / "code_ran"
    args = checkpoints_of_iterations_1_to_4(save)
    # No manifest: accepted with a warning before, so the checksums are no obstacle (an attacker
    # could as well rewrite them).
    named = {}
    for iteration, plant in ((4, _plant_in_metadata), (3, _plant_in_common), (2, _plant_in_byte_item)):
        ckpt = save / f"iter_{iteration:07d}"
        (ckpt / "resil_manifest.json").unlink()
        named[iteration] = plant(ckpt, marker)

    resumed = launch.run([*args, "--train-iters", "5"])
    out = resumed.stdout
    assert resumed.returncode == 0, out[-3000:]
    assert not marker.exists()
    named[2] += " (item rng_state"  # the byte item _plant_in_byte_item replaces
    for iteration, file in named.items():
        rejected = f"load: rejected persistent iteration {iteration}"
        line = next((x for x in out.splitlines() if rejected in x), "")
        assert file in line and "asks to unpickle posix.system" in line, out[-4000:]
    assert "successfully loaded checkpoint from" in out and "at iteration 1" in out
    assert "Traceback" not in out


def _saved_as(module_name: str, class_name: str, value) -> bytes:
    """torch.save bytes of an object whose class the file names as module_name.class_name."""
    import importlib

    import torch

    module = importlib.import_module(module_name)
    cls = type(class_name, (), {"__module__": module_name, "__reduce__": lambda self: (type(self), (value,)),
                                "__init__": lambda self, *args: None})
    missing = object()
    original = getattr(module, class_name, missing)
    setattr(module, class_name, cls)  # for the pickler's lookup by name, while it writes
    try:
        buffer = io.BytesIO()
        torch.save({"scope": cls()}, buffer)
    finally:
        if original is missing:
            delattr(module, class_name)
        else:
            setattr(module, class_name, original)
    return buffer.getvalue()


def test_a_megatron_core_class_this_release_lacks_is_a_placeholder_one_it_has_is_still_refused():
    """A newer Megatron-LM's saved arguments may hold a megatron-core enum an older megatron-core lacks: it
    reads as a placeholder that keeps the saved value and runs nothing. A class this megatron-core has but
    a checkpoint never holds, or any other module's, is refused as before."""
    from megatron_resil.checkpointing import safe_load

    loaded = safe_load.load_weights_only(
        io.BytesIO(_saved_as("megatron.core.transformer.enums", "NoSuchScope", 3)), "common.pt")
    scope = loaded["scope"]
    assert isinstance(scope, safe_load.AbsentUpstreamValue) and scope.args == (3,)
    assert scope.upstream == "megatron.core.transformer.enums.NoSuchScope"

    from megatron.core.transformer import transformer_config  # present here, and no checkpoint class

    data = _saved_as("megatron.core.transformer.transformer_config", "MLATransformerConfig", 3)
    assert hasattr(transformer_config, "MLATransformerConfig")
    with pytest.raises(safe_load.UnsafeCheckpointError, match="MLATransformerConfig"):
        safe_load.load_weights_only(io.BytesIO(data), "common.pt")
    with pytest.raises(safe_load.UnsafeCheckpointError, match="collections.NoSuchThing"):
        safe_load.load_weights_only(io.BytesIO(_saved_as("collections", "NoSuchThing", 3)), "common.pt")
