"""What one rank holds after a load, as named tensors, and the comparison of two such records.

make.py's Megatron-LM side records it (as fingerprints: dtype, shape, SHA-256) for the state Megatron-LM's
`save_checkpoint` writes, and compares it with what Megatron-LM's `load_checkpoint` reads; the test loads
that checkpoint with pretrain.py's loader and compares what it holds with the record. Both lanes import
it (Python 3.11 and 3.12), so it uses only torch, NumPy and the standard library at import.

Run under torchrun it is the test's side: build the engine from pretrain.py flags, load `--load` with
megatron-resil's CheckpointManager, and compare with `--reference DIR/rank<N>.json` (exit 1 on a
difference).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys

import numpy as np
import torch

# The scheduler's counters and bounds; its decay style is a string and the same flags set it on both sides.
_SCHEDULER_NUMBERS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "num_steps", "start_wd",
                      "end_wd", "wd_incr_steps")


def engine_state(model: list, optimizer, scheduler, iteration: int, consumed_train_samples: int) -> dict:
    """Every tensor a resume depends on, by name: the model chunks' state (extra state left out: bytes of
    Transformer Engine, none here), each optimizer's parameters in order with their Adam state, the LR
    scheduler's numbers, the RNG states and the progress counters."""
    out: dict[str, torch.Tensor] = {}
    for i, chunk in enumerate(model):
        for name, value in chunk.state_dict().items():
            if torch.is_tensor(value) and not name.endswith("_extra_state"):
                out[f"model{i}.{name}"] = value.detach().clone()
    for k, sub in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = sub.optimizer
        for g, group in enumerate(inner.param_groups):
            for n, param in enumerate(group["params"]):
                out[f"optimizer{k}.group{g}.param{n}"] = param.detach().clone()
                for key, value in sorted(inner.state.get(param, {}).items()):
                    out[f"optimizer{k}.group{g}.param{n}.{key}"] = torch.as_tensor(value).detach().clone()
            out[f"optimizer{k}.group{g}.lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64)
    saved = scheduler.state_dict()
    for key in _SCHEDULER_NUMBERS:
        if saved.get(key) is not None:
            out[f"scheduler.{key}"] = torch.tensor(float(saved[key]), dtype=torch.float64)
    out["rng.random"] = torch.tensor(random.getstate()[1], dtype=torch.int64)
    out["rng.numpy"] = torch.from_numpy(np.random.get_state()[1].astype(np.int64))
    out["rng.torch"] = torch.get_rng_state()
    from megatron.core import tensor_parallel

    for name, value in sorted(tensor_parallel.get_cuda_rng_tracker().get_states().items()):
        out[f"rng.tracker.{name}"] = torch.as_tensor(value).clone()
    out["progress.iteration"] = torch.tensor(int(iteration))
    out["progress.consumed_train_samples"] = torch.tensor(int(consumed_train_samples))
    return out


def fingerprints(state: dict) -> dict[str, str]:
    """Each tensor as its dtype, shape and the SHA-256 of its bytes: what the committed record holds
    (exact, small, and read back without unpickling anything)."""
    out = {}
    for name, tensor in state.items():
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        out[name] = f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)} " \
                    f"{hashlib.sha256(flat.numpy().tobytes()).hexdigest()}"
    return out


def differences(expected: dict[str, str], got: dict[str, str]) -> list[str]:
    """Each way the fingerprints `got` differ from `expected`: a name missing on either side, or another
    dtype, shape or any byte of the values."""
    found = [f"{name}: missing" for name in sorted(set(expected) - set(got))]
    found += [f"{name}: not expected" for name in sorted(set(got) - set(expected))]
    for name in sorted(set(expected) & set(got)):
        kind, got_kind = expected[name].rsplit(" ", 1)[0], got[name].rsplit(" ", 1)[0]  # dtype and shape
        if kind != got_kind:
            found.append(f"{name}: {got_kind}, not {kind}")
        elif expected[name] != got[name]:
            found.append(f"{name}: values differ")
    return found


def main() -> int:
    """Load `--load` as pretrain.py does and compare with the record of what Megatron-LM saved."""
    import argparse
    import os

    outer = argparse.ArgumentParser(add_help=False)
    outer.add_argument("--reference", required=True, help="the directory of make.py's rank<N>.json records")
    ours, flags = outer.parse_known_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))))
    from megatron_resil import patches
    from megatron_resil.arguments import parse_args

    args = parse_args(flags)
    patches.install(args)  # before megatron-core is imported, as pretrain.py installs them
    from megatron_resil import parallel
    from megatron_resil.checkpointing.manager import CheckpointConfig, CheckpointManager
    from megatron_resil.resilience import rerun
    from megatron_resil.tokenizer import build_tokenizer
    from megatron_resil.training import build_engine

    parallel.initialize(args)
    rerun.initialize(rerun.RerunConfig.from_args(args))
    model, optimizer, scheduler = build_engine(args, build_tokenizer(args).vocab_size)
    progress = CheckpointManager(CheckpointConfig.from_args(args), model, optimizer, scheduler, args).load()
    got = fingerprints(engine_state(model, optimizer, scheduler, progress.iteration,
                                    progress.consumed_train_samples))
    rank = torch.distributed.get_rank()
    with open(os.path.join(ours.reference, f"rank{rank}.json")) as f:
        expected = json.load(f)
    found = differences(expected, got)
    print(f"[state] rank {rank}: {len(expected)} tensors, "
          + ("all equal" if not found else f"{len(found)} differ: " + "; ".join(found[:8])), flush=True)
    failed = parallel.any_rank(bool(found))
    parallel.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
