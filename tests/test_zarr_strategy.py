"""The zarr strategy against real files and real tensorstore: round trip through megatron's
dist_checkpointing, reading with plain tensorstore, corrupted chunks, malformed metadata, and two
gloo ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

# megatron-core 0.19 removed its pluggable sharded strategies: zarr cannot be read or written there, and
# --ckpt-format zarr is refused with one line (tests/test_arguments.py).
pytest.importorskip("megatron.core.dist_checkpointing.strategies.base",
                    reason="this megatron-core has no pluggable checkpoint strategies (zarr is refused)")
import tensorstore as ts
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.mapping import CheckpointingException

from megatron_resil.checkpointing.tier import CheckpointDataError
from megatron_resil.checkpointing.zarr_strategy import (
    ZarrSaveShardedStrategy,
    array_name,
    check_metadata,
    register,
)
from megatron_resil.launch.ports import free_loopback_port

REPO = Path(__file__).resolve().parents[1]



@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    # dist_checkpointing.save calls torch.distributed.get_rank(), so even one process needs a group.
    if dist.is_initialized():
        yield
        return
    port = free_loopback_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    register()
    yield
    dist.destroy_process_group()


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w2d": torch.randn(6, 4, generator=g),
            "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "ids": torch.arange(-5, 7, dtype=torch.int64).reshape(3, 4),
            "bias": torch.randn(7, generator=g),
            "zeros": torch.zeros(2, 2, dtype=torch.float16),
            "mask": torch.tensor([True, False, True]),
            "bytes": torch.arange(250, 256, dtype=torch.uint8)}


def _state(tensors: dict[str, torch.Tensor], obj=None) -> dict:
    state = {name: ShardedTensor.from_rank_offsets(f"model/{name}", t) for name, t in tensors.items()}
    state["extra"] = ShardedObject("model/extra_state", obj, (1,), (0,))
    state["iteration"] = 17
    return state


def _save(tmp_path: Path) -> tuple[Path, ZarrSaveShardedStrategy]:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    strategy = ZarrSaveShardedStrategy()
    dist_checkpointing.save(_state(_tensors(), {"rng": [1, 2, 3]}), str(ckpt), sharded_strategy=strategy)
    return ckpt, strategy


def _load(ckpt: Path) -> dict:
    template = _state({k: torch.full_like(v, 1) for k, v in _tensors().items()})
    return dist_checkpointing.load(template, str(ckpt))


def test_round_trip_through_dist_checkpointing(tmp_path):
    ckpt, strategy = _save(tmp_path)
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "zarr"
    register()  # again: must be harmless
    loaded = _load(ckpt)
    for name, expected in _tensors().items():
        assert loaded[name].dtype == expected.dtype, name
        assert torch.equal(loaded[name], expected), name
    assert loaded["extra"] == {"rng": [1, 2, 3]}
    assert loaded["iteration"] == 17

    written = set(strategy.files_written_by_me())
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    chunks = {f"{array_name('model/' + n)}/c/0" + "/0" * (t.dim() - 1) for n, t in _tensors().items()}
    metadata = {f"{array_name('model/' + n)}/zarr.json" for n in _tensors()}
    # The all-zero fp16 chunk is there too: a chunk equal to the fill value must still be written.
    assert written == chunks | metadata
    assert written <= on_disk

    plain = dist_checkpointing.load_plain_tensors(str(ckpt))  # (it merges in the common dict too)
    assert {k for k, v in plain.items() if isinstance(v, torch.Tensor)} == {f"model/{n}" for n in _tensors()}
    assert all(torch.equal(plain[f"model/{n}"], t) for n, t in _tensors().items())


def test_arrays_are_readable_with_plain_tensorstore(tmp_path):
    ckpt, _ = _save(tmp_path)
    for name, expected in _tensors().items():
        path = ckpt / array_name(f"model/{name}")
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
        arr = ts.open(spec, open=True).result()
        meta = json.loads((path / "zarr.json").read_text())
        assert meta["codecs"][-1] == {"name": "crc32c"}
        assert meta["attributes"]["megatron_key"] == f"model/{name}"
        data = arr.read().result()
        if expected.dtype == torch.bfloat16:
            assert str(arr.dtype.numpy_dtype) == "bfloat16"
            np.testing.assert_array_equal(data.astype(np.float32), expected.float().numpy())
        else:
            np.testing.assert_array_equal(data, expected.numpy())


def test_irregular_sharding_is_refused(tmp_path):
    # zarr needs one chunk shape per array; a shard off the chunk grid cannot be one chunk.
    odd = ShardedTensor("odd", torch.ones(3), torch.float32, (3,), (5,), (2,), None)
    with pytest.raises(NotImplementedError, match="chunk boundary"):
        ZarrSaveShardedStrategy().save({"odd": odd}, str(tmp_path))


def _damage(ckpt: Path, how: str) -> None:
    chunk = ckpt / array_name("model/w2d") / "c" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    if how == "flip":
        raw[5] ^= 0x01
    elif how == "truncate":
        raw = raw[: len(raw) // 2]
    elif how == "delete":
        chunk.unlink()
        return
    chunk.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_damaged_chunk_fails_the_load(tmp_path, how):
    ckpt, _ = _save(tmp_path)
    _damage(ckpt, how)
    with pytest.raises(CheckpointingException) as excinfo:
        _load(ckpt)
    message = str(excinfo.value)
    assert "model.w2d" in message and "c/0/0" in message
    if how == "flip":
        assert "crc32c" in message and "Digest mismatch" in message


def _check_within(ckpt: Path, seconds: float = 30) -> str | None:
    """check_metadata, failing the test instead of hanging it (a FIFO opened for reading blocks)."""
    outcome: list = []
    worker = threading.Thread(target=lambda: outcome.append(check_metadata(str(ckpt))), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"check_metadata({ckpt}) still running after {seconds} s"
    return outcome[0]


def _edit_metadata(ckpt: Path, edit) -> Path:
    path = ckpt / array_name("model/w2d") / "zarr.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))
    return path


def _chunk_shape(meta: dict, shape: list) -> None:
    meta["chunk_grid"]["configuration"]["chunk_shape"] = shape


MALFORMED = {  # as found in issue 22: exit 3 (a "model mismatch") or a SIGABRT in tensorstore
    "chunk-shape-0": (lambda m: _chunk_shape(m, [0, 4]), "not a list of positive integers"),
    "negative-shape": (lambda m: m.update(shape=[-6, 4]), "non-negative integers"),
    "dtype-float128": (lambda m: m.update(data_type="float128"), "data_type 'float128'"),
    "chunk-2**40": (lambda m: _chunk_shape(m, [2**40, 4]), "larger than shape [6, 4]"),
    "chunk-rank-differs": (lambda m: _chunk_shape(m, [6]), "does not have the rank"),
    "key-names-another-dir": (lambda m: m["attributes"].update(megatron_key="model/bias"), "megatron_key"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_metadata_is_refused_as_bad_data(tmp_path, case):
    ckpt, _ = _save(tmp_path)
    assert _check_within(ckpt) is None  # what our save writes passes
    edit, why = MALFORMED[case]
    path = _edit_metadata(ckpt, edit)
    reason = _check_within(ckpt)
    assert reason is not None and str(path) in reason and why in reason, reason
    assert "\n" not in reason
    # The load checks again before tensorstore sees the file: the loader's "bad data", so it falls back.
    with pytest.raises(CheckpointDataError, match="zarr.json"):
        _load(ckpt)


def test_metadata_tensorstore_refuses_is_bad_data_too(tmp_path):
    # A fill value is tensorstore's to judge: its refusal must still read as bad data, not as a mismatch.
    ckpt, _ = _save(tmp_path)
    _edit_metadata(ckpt, lambda m: m.update(fill_value="not a number"))
    with pytest.raises(CheckpointDataError, match="tensorstore cannot open"):
        _load(ckpt)


def test_fifo_metadata_is_refused_without_opening_it(tmp_path):
    ckpt, _ = _save(tmp_path)
    path = ckpt / array_name("model/w2d") / "zarr.json"
    path.unlink()
    os.mkfifo(path)
    reason = _check_within(ckpt)
    assert reason is not None and f"a FIFO, {path.relative_to(ckpt)}" in reason, reason
    with pytest.raises(CheckpointDataError, match="FIFO"):
        _load(ckpt)


def test_symlinked_metadata_is_refused_without_following_it(tmp_path):
    ckpt, _ = _save(tmp_path)
    path = ckpt / array_name("model/w2d") / "zarr.json"
    outside = tmp_path / "outside.json"
    outside.write_bytes(path.read_bytes())  # valid metadata: following the link would accept it
    path.unlink()
    path.symlink_to(outside)
    reason = _check_within(ckpt)
    assert reason is not None and f"a symlink, {path.relative_to(ckpt)}" in reason, reason


def test_oversized_and_non_json_metadata_are_refused(tmp_path):
    ckpt, _ = _save(tmp_path)
    path = ckpt / array_name("model/w2d") / "zarr.json"
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)  # deeper than json's recursion limit
    assert f"{path}: not valid JSON (RecursionError" in _check_within(ckpt)
    path.write_bytes(b"\xff{}")
    assert f"{path}: not valid JSON (UnicodeDecodeError" in _check_within(ckpt)
    path.write_bytes(b" " * (2 << 20))
    assert f"{path} has {2 << 20} bytes, more than" in _check_within(ckpt)


def test_relative_checkpoint_dir(tmp_path, monkeypatch):
    # tensorstore refuses a path with a ".." in it; --save and --load may have one.
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    (tmp_path / "ckpt").mkdir()
    dist_checkpointing.save(_state(_tensors()), "../ckpt", sharded_strategy=ZarrSaveShardedStrategy())
    assert check_metadata("../ckpt") is None
    loaded = _load(Path("../ckpt"))
    assert all(torch.equal(loaded[name], t) for name, t in _tensors().items())


_TWO_RANKS = """
import datetime, json, os, sys, traceback
import torch, torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron_resil.checkpointing.zarr_strategy import ZarrSaveShardedStrategy, register

def main(rank, port, ckpt, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    layers = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    rep = torch.arange(10, dtype=torch.int64) * 3

    def state(split, layer, replicated):
        return {"split": ShardedTensor.from_rank_offsets("w/split", split, (0, rank, 2)),
                "layer": ShardedTensor.from_rank_offsets("layers/w", layer, (0, rank, 2), prepend_axis_num=1),
                "rep": ShardedTensor.from_rank_offsets("rep", replicated, replica_id=rank)}

    os.makedirs(ckpt, exist_ok=True)
    strategy = ZarrSaveShardedStrategy()
    dist_checkpointing.save(state(full[rank * 4:(rank + 1) * 4].clone(), layers[rank].clone(), rep.clone()),
                            ckpt, sharded_strategy=strategy)
    register()
    loaded = dist_checkpointing.load(state(torch.zeros(4, 6), torch.zeros(3, 4, dtype=torch.bfloat16),
                                           torch.zeros(10, dtype=torch.int64)), ckpt)
    ok = (torch.equal(loaded["split"], full[rank * 4:(rank + 1) * 4]) and torch.equal(loaded["rep"], rep)
          and loaded["layer"].dtype == torch.bfloat16 and torch.equal(loaded["layer"], layers[rank]))
    plain = dist_checkpointing.load_plain_tensors(ckpt)
    ok = ok and torch.equal(plain["w/split"], full) and torch.equal(plain["layers/w"], layers)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"ok": bool(ok), "written": strategy.files_written_by_me()}, f)
    dist.destroy_process_group()

# Fork after the imports (several seconds each on a small machine) but before anything starts threads,
# so two ranks cost one import.
pid = os.fork()
rank, code = (1 if pid == 0 else 0), 0
try:
    main(rank, *sys.argv[1:])
except BaseException:
    traceback.print_exc()
    code = 1
sys.stdout.flush(); sys.stderr.flush()
if pid == 0:
    os._exit(code)
sys.exit(code or os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_two_ranks_write_their_own_chunks(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    ckpt, out = tmp_path / "ckpt", tmp_path / "result"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    port = free_loopback_port()
    proc = subprocess.Popen([sys.executable, str(script), str(port), str(ckpt), str(out)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output = proc.communicate(timeout=90)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session holds both ranks
        raise
    assert proc.returncode == 0, output
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert all(r["ok"] for r in results)
    mine = [set(r["written"]) for r in results]
    assert mine[0] == {"w.split/zarr.json", "layers.w/zarr.json", "rep/zarr.json",
                       "w.split/c/0/0", "layers.w/c/0/0/0", "rep/c/0"}
    assert mine[1] == {"w.split/c/1/0", "layers.w/c/1/0/0"}
    # Exactly those files exist under the arrays: the replicated tensor had one writer.
    on_disk = {p.relative_to(ckpt).as_posix() for d in ("w.split", "layers.w", "rep")
               for p in (ckpt / d).rglob("*") if p.is_file()}
    assert on_disk == mine[0] | mine[1]
