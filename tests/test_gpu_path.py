"""Decisions that matter only on a GPU, checked on CPU: the async-save worker is put on its rank's GPU
before anything in it touches CUDA; a checkpoint's RNG states written on one kind of device resume on the
other; a GPU run gets Megatron-LM's fusions where their kernels are installed. Each test pretends CUDA
where the decision reads it, records the calls the GPU path would make, or builds what a GPU run writes."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import queue

import pytest
import torch

from megatron_resil import model, patches
from megatron_resil.arguments import parse_args
from megatron_resil.checkpointing import async_save, state
from megatron_resil.checkpointing.global_tier import write_own_shards
from megatron_resil.checkpointing.staging import ArenaPickler
from tests import launch
from tests.test_safe_load import _metadata, replace_byte_item


def test_the_async_save_worker_is_handed_the_trainers_device(monkeypatch):
    """The trainer trains on cuda:<LOCAL_RANK> (set by parallel.initialize); its worker gets that index."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    started = {}

    class NotStarted:
        pid = None

        def __init__(self, target, args) -> None:
            started["target"], started["args"] = target, args

        def start(self) -> None:
            pass

        def is_alive(self) -> bool:
            return False

    writer = async_save.WriterProcess()
    monkeypatch.setattr(writer._ctx, "Process", NotStarted)
    writer.start()
    # The worker loop, entered once the trainer's patches are installed in the new interpreter.
    assert started["target"] is patches.call_installed
    assert started["args"][0] == "megatron_resil.checkpointing.async_save:_worker_loop"
    assert started["args"][3] == 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert async_save.trainer_device_index() is None


def _worker_recording_calls(device_index: int, staging: str, record: str) -> None:
    """In a forked child (the worker loop changes signal handling and the process name): the worker loop,
    with CUDA's set_device recorded, runs one global-tier write job whose preload is recorded too."""
    torch.cuda.set_device = lambda index: _CALLS.append(["set_device", index])
    requests, results = queue.Queue(), queue.Queue()
    # One bucket holding a tensor off the host (as a GPU rank's unstaged one), so the preload is due.
    write_args = ("plan", [(None, None, (None, [(None, torch.empty(1, device="meta"))]))], "results")
    job = io.BytesIO()  # as the trainer sends a job: pickled, staged tensors as references into the arena
    work_args = (0, staging, _record_write, _record_preload, write_args)
    ArenaPickler(job, None, 0).dump((write_own_shards, work_args))
    requests.put((1, job.getvalue()))
    requests.put(None)
    async_save._worker_loop(os.getppid(), device_index, requests, results)
    reports = [results.get_nowait() for _ in range(results.qsize())]
    with open(record, "w") as f:
        json.dump({"calls": _CALLS, "reports": [list(report[:2]) for report in reports]}, f, default=str)


_CALLS: list = []  # what the forked child's worker loop did, in order


def _record_write(*args) -> None:
    _CALLS.append(["write", args[1]])
    args[2].put("written")  # megatron-core's writer reports its results on the queue it is given


def _record_preload() -> str:
    _CALLS.append(["preload"])
    return "preloaded"


def test_the_async_save_worker_binds_its_device_before_megatron_cores_preload(tmp_path):
    """megatron-core's preload calls torch.cuda.synchronize(): unbound, every rank's worker would open a
    CUDA context on GPU 0."""
    record = tmp_path / "calls.json"
    child = multiprocessing.get_context("fork").Process(
        target=_worker_recording_calls, args=(5, str(tmp_path), str(record)))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    found = json.loads(record.read_text())
    assert found["calls"] == [["set_device", 5], ["preload"], ["write", "preloaded"]]
    assert found["reports"] == [[async_save._READY, None], [1, None]]  # ready, then the job without error


def _philox(seed: int, offset: int = 0) -> torch.Tensor:
    """A CUDA generator's state as torch.cuda.get_rng_state() returns it: seed and offset, 8 bytes each."""
    return torch.tensor(list(seed.to_bytes(8, "little") + offset.to_bytes(8, "little")), dtype=torch.uint8)


def _gpu_written_rng(seed: int = 1234, tp_rank: int = 0) -> dict:
    """A rank's rng_state as a GPU run saves it: megatron-core's model_parallel_cuda_manual_seed seeds the
    tracker's three CUDA streams (data-parallel: seed; model-parallel: seed + 2718 + tp rank; expert-parallel:
    seed + 1024), and the default CUDA generator with the seed."""
    import random

    import numpy as np
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.Generator().manual_seed(seed).get_state(),
            "cuda_rng_state": _philox(seed, offset=4096),
            "rng_tracker_states": {"data-parallel-rng": _philox(seed),
                                   "model-parallel-rng": _philox(seed + 2718 + tp_rank),
                                   "expert-parallel-rng": _philox(seed + 1024)}}


def _assert_untouched(saved: dict) -> None:
    rng, translated = state.rng_for_this_device(saved)
    assert translated == [] and rng.keys() == saved.keys() and all(rng[k] is saved[k] for k in saved)


def test_gpu_written_rng_states_are_reseeded_in_cpu_form_keeping_which_ranks_draw_alike():
    cpu_size = torch.get_rng_state().numel()
    rank0, again, rank1 = (state.rng_for_this_device(_gpu_written_rng(tp_rank=tp)) for tp in (0, 0, 1))
    (rng0, translated), (rng0_again, _), (rng1, _) = rank0, again, rank1
    assert translated == ["the tracker's data-parallel-rng, expert-parallel-rng, model-parallel-rng"]
    trackers0, trackers1 = rng0["rng_tracker_states"], rng1["rng_tracker_states"]
    assert all(s.numel() == cpu_size for s in trackers0.values())
    assert all(torch.equal(trackers0[name], rng0_again["rng_tracker_states"][name]) for name in trackers0)
    assert torch.equal(trackers0["data-parallel-rng"], trackers1["data-parallel-rng"])  # replicas: alike
    assert not torch.equal(trackers0["model-parallel-rng"], trackers1["model-parallel-rng"])  # per TP rank
    assert not torch.equal(trackers0["model-parallel-rng"], trackers0["data-parallel-rng"])
    cpu_written = {**rng0, "cuda_rng_state": torch.empty(0, dtype=torch.uint8)}
    _assert_untouched(cpu_written)  # CPU to CPU


def test_cpu_written_rng_states_are_reseeded_in_cuda_form_on_a_pretend_gpu(monkeypatch):
    """On a GPU, the empty CUDA state a CPU run saves made torch.cuda.set_rng_state fail after the loader
    had accepted the checkpoint (exit 1, restarted into the same failure)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: _philox(0))
    monkeypatch.setattr(state, "_seeded_state", lambda seed, cuda: _philox(seed) if cuda else None)
    saved = _gpu_written_rng()
    cpu_written = {**saved, "cuda_rng_state": torch.empty(0, dtype=torch.uint8),
                   "rng_tracker_states": {name: torch.Generator().manual_seed(seed).get_state() for name, seed
                                          in (("data-parallel-rng", 1), ("model-parallel-rng", 2))}}
    rng, translated = state.rng_for_this_device(cpu_written)
    assert translated == ["the CUDA generator", "the tracker's data-parallel-rng, model-parallel-rng"]
    assert rng["cuda_rng_state"].numel() == 16 and not torch.equal(rng["cuda_rng_state"], _philox(0))
    assert all(s.numel() == 16 for s in rng["rng_tracker_states"].values())
    assert rng["torch_rng_state"] is saved["torch_rng_state"]
    _assert_untouched(saved)  # GPU to GPU


@pytest.mark.slow
def test_a_checkpoint_whose_rng_states_a_gpu_wrote_resumes_on_cpu(tmp_path):
    """Before, the CPU tracker refused the GPU's 16-byte states at the first attention dropout: exit 1
    after the checkpoint had been accepted. Now one line says what was reseeded, and training goes on."""
    save = tmp_path / "ckpt"
    args = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--save", str(save), "--load", str(save),
            "--save-interval", "2", "--lr-decay-iters", "10"]
    first = launch.run([*args, "--train-iters", "2"], nproc=1)
    assert first.returncode == 0, first.stdout[-3000:]
    ckpt = save / "iter_0000002"
    (item,) = [i for i in _metadata(ckpt).storage_data.items() if i[0].fqn.startswith("rng_state/")]
    data = (ckpt / item[1].relative_path).read_bytes()[item[1].offset:item[1].offset + item[1].length]
    value = holder = torch.load(io.BytesIO(data), weights_only=False)  # the test's own, trusted copy
    while isinstance(holder[0], list):  # [rng_state()], as many lists deep as megatron-core stored it
        holder = holder[0]
    saved = holder[0]
    holder[0] = {**_gpu_written_rng(), **{k: saved[k] for k in ("random_rng_state", "np_rng_state",
                                                                "torch_rng_state")}}
    replace_byte_item(ckpt, lambda fqn: fqn.startswith("rng_state/"), value)
    (ckpt / "resil_manifest.json").unlink()  # as Megatron-LM writes it: no manifest of ours
    resumed = launch.run([*args, "--train-iters", "4"], nproc=1)
    out = resumed.stdout
    assert resumed.returncode == 0, out[-4000:]
    rng_lines = [line for line in out.splitlines() if line.startswith("[resil] rng:")]
    assert len(rng_lines) == 1 and "tracker's data-parallel-rng" in rng_lines[0], out[-4000:]
    assert sorted(launch.losses(out)) == [3, 4]
    assert "Traceback" not in out


ALL_KERNELS = model.FusedKernels(gradient_accumulation=True, masked_softmax=True, transformer_engine=True)
FUSIONS = ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion",
           "masked_softmax_fusion", "persist_layer_norm", "apply_rope_fusion")


def _args(*extra: str):
    return parse_args([*launch.TINY_MODEL, "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
                       "--mock-data", *extra], world_size=1)


def _on_gpu(*extra: str) -> dict[str, bool]:
    """The fusions of a run with `extra` flags on a GPU with every kernel installed."""
    return model.fusions(_args(*extra), cuda=True, kernels=ALL_KERNELS)


def test_a_gpu_run_gets_megatron_lms_fusions_and_a_cpu_run_none():
    assert _on_gpu() == {
        **dict.fromkeys(FUSIONS, True), "apply_rope_fusion": False}  # rope fusion only with rope
    rope = _args("--position-embedding-type", "rope", "--swiglu")
    assert model.fusions(rope, cuda=True, kernels=ALL_KERNELS) == dict.fromkeys(FUSIONS, True)
    assert model.fusions(rope, cuda=False, kernels=ALL_KERNELS) == dict.fromkeys(FUSIONS, False)


def test_each_no_fusion_flag_turns_its_fusion_off_on_a_gpu():
    for flag, fusion in (("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"),
                         ("--no-bias-gelu-fusion", "bias_activation_fusion"),
                         ("--no-bias-dropout-fusion", "bias_dropout_fusion"),
                         ("--no-masked-softmax-fusion", "masked_softmax_fusion"),
                         ("--no-persist-layer-norm", "persist_layer_norm"),
                         ("--no-rope-fusion", "apply_rope_fusion")):
        chosen = _on_gpu("--position-embedding-type", "rope", flag)
        assert chosen == {**dict.fromkeys(FUSIONS, True), fusion: False}, flag
    assert not _on_gpu("--swiglu", "--no-bias-swiglu-fusion")["bias_activation_fusion"]
    assert _on_gpu("--swiglu", "--no-bias-gelu-fusion")["bias_activation_fusion"]  # swiglu's switch decides
    # As Megatron-LM: no gelu fusion without a bias (megatron-core refuses that combination).
    assert not _on_gpu("--disable-bias-linear")["bias_activation_fusion"]


def test_a_fusion_whose_kernel_is_missing_stays_off_instead_of_failing_at_first_use():
    rope = _args("--position-embedding-type", "rope")
    none = model.FusedKernels(gradient_accumulation=False, masked_softmax=False, transformer_engine=False)
    chosen = model.fusions(rope, cuda=True, kernels=none)
    assert chosen == {**dict.fromkeys(FUSIONS, True), "gradient_accumulation_fusion": False,
                      "masked_softmax_fusion": False, "apply_rope_fusion": False}


def test_megatron_core_accepts_the_gpu_fusions(monkeypatch):
    """The config a GPU run builds passes TransformerConfig's own checks (rope fusion, which needs
    Transformer Engine installed, aside)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(model.FusedKernels, "installed", classmethod(lambda cls: ALL_KERNELS))
    for extra in ((), ("--swiglu",), ("--swiglu", "--disable-bias-linear")):
        config = model.transformer_config(_args(*extra))
        assert config.bias_activation_fusion and config.bias_dropout_fusion and config.masked_softmax_fusion
        assert config.gradient_accumulation_fusion and not config.apply_rope_fusion
