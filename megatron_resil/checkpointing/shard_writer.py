"""torch_dist shards checksummed as they are written, not read back afterwards.

megatron-core 0.16's torch_dist writer forks one process per shard file and collects what each wrote
through two queues; our manifest then read every shard back to checksum it (12% of a save, and a
second pass over every byte). This strategy is megatron-core's own up to the last step: the same
planning, the same buckets (files) and records, the same results handed to its finalisation, which
writes DCP's `.metadata`. Only the writing of the planned buckets is ours, in the process that runs
the save (the trainer for a synchronous save, the async worker otherwise): each record is written by
torch's own `_write_item` (a torch.save record at the offset `.metadata` gives) through a stream that
extends the manifest's checksum over the bytes as they go to the file. So the files are byte for
byte the torch_dist format megatron-core and Megatron-LM read, and no byte is read back. The checksum
covers what was handed to the kernel, as the read-back covered what the page cache returned; both
are taken before the fsync and catch what happens to the file afterwards.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint import filesystem as dcp_filesystem

from megatron_resil.checkpointing.manifest import CHECKSUM, checksum_files, extend_checksum
from megatron_resil.checkpointing.staging import HostStaging


class ChecksummingStream:
    """The file as torch.save and DCP see it (write, tell, flush), with a running checksum."""

    def __init__(self, file) -> None:
        self._file = file
        self.checksum = 0
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self._file.write(view)
        # A short write would leave the checksum covering bytes not in the file; buffered files
        # write everything or raise, so this only guards against a raw file slipping in.
        if written is not None and written != len(view):
            raise OSError(f"short write to {self._file.name}: {written} of {len(view)} bytes")
        self.checksum = extend_checksum(self.checksum, view)
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()

    def writable(self) -> bool:
        return True


# Checksums of the shards written in this process, by absolute path, until the save collects them.
_written: dict[str, dict] = {}
_written_lock = threading.Lock()


def _write_records(transforms: list, bucket, file) -> tuple[list, ChecksummingStream]:
    _path, storage_key, (bytes_data, tensor_data) = bucket
    stream = ChecksummingStream(file)
    # torch's private record writer and megatron-core's private save hook below are dependencies the
    # patches check at start-up (patches/torch_dcp.py, patches/megatron_core.py).
    results = [dcp_filesystem._write_item(*transforms, stream, data, item, storage_key,
                                          serialization_format=dcp_filesystem.SerializationFormat.TORCH_SAVE)
               for item, data in [*bytes_data, *tensor_data]]
    file.flush()
    return results, stream


def _fsync_and_record(file, stream: ChecksummingStream) -> None:
    with file:
        os.fsync(file.fileno())
        on_disk = os.fstat(file.fileno()).st_size
    if stream.size != on_disk:  # the stream saw every byte, or its checksum would be wrong
        raise OSError(f"{file.name}: wrote {stream.size} bytes but the file holds {on_disk}")
    with _written_lock:
        _written[os.path.abspath(file.name)] = {"size": stream.size, CHECKSUM: stream.checksum}


def write_buckets(transforms: list, rank: int, buckets: list, results_queue) -> None:
    """megatron-core's save function, as its finalisation expects it: every bucket (file) written and
    fsynced, then {bucket index: [WriteResult]} (or the exception) put on the results queue.

    One thread writes the files one after another: torch.save holds the GIL between its writes, and
    two threads serialising at once took three times the CPU of one (BENCHMARKS.md, "Save
    throughput"). Each file's fsync, which holds no GIL, runs in a helper beside the next file's writing.
    """
    outcome: dict | Exception = {}
    try:
        # Leaving the executor waits for every fsync submitted (each closes its file), also on an
        # error, so every file is closed before anything is reported.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-fsync") as syncer:
            syncs = []
            for index, bucket in enumerate(buckets):
                file = open(bucket[0], "wb")
                try:
                    outcome[index], stream = _write_records(transforms, bucket, file)
                except BaseException:
                    file.close()
                    raise
                syncs.append(syncer.submit(_fsync_and_record, file, stream))
        for sync in syncs:
            sync.result()
    except Exception as err:  # reported through the queue, as megatron-core's writer does
        outcome = err
    results_queue.put(outcome)


class ChecksummedTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's torch_dist save strategy whose shards are written by `write_buckets`. For an async
    save it also stages what this rank writes (its main replicas, after the data-parallel spread is
    decided) in host buffers, and leaves its write results to travel back from the worker with its own
    reply instead of through a queue process."""

    host: HostStaging | None = None  # set around an async save (staged_in)
    results_queue = None  # where the last async save's finalisation reads this rank's write results

    def async_save(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
        # megatron-core 0.19 also passes the async strategy ("mcore" or "nvrx"); 0.16 does not.
        if self.host is not None:
            mine = [sh for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)
                    and sh.data is not None and is_main_replica(sh.replica_id)]
            for sh, staged in zip(mine, self.host.stage([sh.data.detach() for sh in mine]), strict=True):
                sh.data = staged
        return super().async_save(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret, *async_strategy):
        # megatron-core 0.19 also passes the async strategy ("mcore" or "nvrx"); 0.16 does not.
        request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret, *async_strategy)
        self.results_queue = None
        if request.async_fn is None:  # nothing to write on this rank
            return request
        transforms = [writer.transforms] if hasattr(writer, "transforms") else []
        args = list(request.async_fn_args)
        if self.host is not None:  # the worker writes: it reports in its own process (write_own_shards)
            self.results_queue, args[2] = writer.results_queue, None
        return request._replace(async_fn=partial(write_buckets, transforms), async_fn_args=args)


def _base(strategy) -> ChecksummedTorchDistSaveStrategy:
    return getattr(strategy, "base_strategy", strategy)  # under FullyParallelSaveStrategyWrapper or not


@contextlib.contextmanager
def staged_in(strategy, host: HostStaging) -> Iterator[None]:
    """Within, an async save through `strategy` stages this rank's tensors in `host`."""
    base = _base(strategy)
    base.host = host
    try:
        yield
    finally:
        base.host = None


def results_queue_of(strategy):
    """The queue the last async save through `strategy` reads this rank's write results from (None: this
    rank wrote nothing)."""
    return _base(strategy).results_queue


def own_shard_checksums(staging: str, rank: int) -> dict:
    """{relpath: {"size", CHECKSUM}} of this rank's shards (`__<rank>_<n>.distcp`), as their writer
    computed them; a shard this process did not write (megatron-core's own writer wrote it) is read."""
    prefix = f"__{rank}_"
    own = sorted(name for name in os.listdir(staging) if name.startswith(prefix) and name.endswith(".distcp"))
    found, unread = {}, []
    with _written_lock:
        for name in own:
            entry = _written.pop(os.path.abspath(os.path.join(staging, name)), None)
            if entry is None:
                unread.append(name)
            else:
                found[name] = entry
    found.update(checksum_files(staging, unread))
    return found
