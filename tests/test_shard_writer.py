"""The torch_dist shard writer (checkpointing/shard_writer.py) on real files, in one process (gloo, world 1).

What it must keep: megatron-core's format (the same files, loadable by megatron-core's own reader), and
checksums that equal a read-back of what is on disk. What it must never do: raise out of the write
function (megatron-core expects the outcome on its results queue) or leave a file open."""

from __future__ import annotations

import os
import queue
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

from megatron_resil import patches
from megatron_resil.checkpointing import dcp_writer, shard_writer
from megatron_resil.checkpointing.manifest import CHECKSUM, extend_checksum, file_checksum


@pytest.fixture
def one_rank(tmp_path: Path):
    patches.install()  # megatron-core's save calls CUDA entry points; our writer relies on its hooks
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _state() -> dict:
    torch.manual_seed(0)
    flat = torch.randn(3 * 1024)
    tensors = {
        "weight": torch.randn(64, 48),
        "half": torch.randn(32, 32).to(torch.bfloat16),
        "view": flat[1024:2048].view(32, 32),  # a view of a larger storage (cloned for torch.save)
        "moment": torch.randn(4096),
    }
    return {name: ShardedTensor.from_rank_offsets(name, tensor, replica_id=0)
            for name, tensor in tensors.items()}


def _save(directory: Path, strategy) -> None:
    directory.mkdir()
    with dcp_writer.without_torch_record_crc(), dcp_writer.results_in_this_process():
        dist_checkpointing.save(_state(), str(directory), sharded_strategy=strategy)


def test_shards_are_megatron_core_format_and_checksummed_as_written(one_rank, tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "core"  # names of one length: .metadata records them
    _save(ours, shard_writer.ChecksummedTorchDistSaveStrategy("torch_dist", 1))
    _save(theirs, get_default_save_sharded_strategy("torch_dist"))

    # The same files of the same sizes as megatron-core's own writer, and its reader loads them.
    sizes = {p.name: p.stat().st_size for p in ours.iterdir()}
    assert sizes == {p.name: p.stat().st_size for p in theirs.iterdir()}
    loaded = dist_checkpointing.load(_state(), str(ours))
    for name, expected in _state().items():
        assert torch.equal(loaded[name], expected.data), name

    # Every shard's checksum was taken while writing and equals a read-back of the file on disk.
    shards = sorted(name for name in sizes if name.endswith(".distcp"))
    assert shards
    recorded = shard_writer.own_shard_checksums(str(ours), 0)
    assert sorted(recorded) == shards
    for name in shards:
        assert recorded[name] == {"size": sizes[name], CHECKSUM: file_checksum(str(ours / name))}
    assert not shard_writer._written  # collected once, nothing left behind for another save

    # Shards this process did not write (megatron-core's writer wrote them) are read instead.
    read = shard_writer.own_shard_checksums(str(theirs), 0)
    assert read == {name: {"size": sizes[name], CHECKSUM: file_checksum(str(theirs / name))}
                    for name in shards}


def test_a_failed_write_is_reported_on_the_queue_and_closes_its_files(tmp_path: Path) -> None:
    written = tmp_path / "first.distcp"
    missing = tmp_path / "gone" / "second.distcp"  # its directory does not exist: open() fails
    buckets = [(str(written), "first", ([], [])), (str(missing), "second", ([], []))]
    results: queue.Queue = queue.Queue()
    shard_writer.write_buckets([], 0, buckets, results)  # must not raise
    outcome = results.get_nowait()
    assert isinstance(outcome, FileNotFoundError) and "second.distcp" in str(outcome)
    assert written.exists()  # the first file was written (empty) and closed before the report
    assert shard_writer._written.pop(os.path.abspath(written)) == {"size": 0, CHECKSUM: 0}


def test_the_fast_checksum_is_zlibs_crc32_in_any_chunking() -> None:
    data = os.urandom((3 << 20) + 17)
    crc = 0
    for start in range(0, len(data), 1 << 20):
        crc = extend_checksum(crc, memoryview(data)[start:start + (1 << 20)])
    assert CHECKSUM == "crc32"
    assert crc == zlib.crc32(data)
