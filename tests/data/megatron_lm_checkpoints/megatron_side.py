"""Megatron-LM's side of make.py, run under torchrun by a Python with Megatron-LM's tree first on its path
(its megatron.core and megatron.training together) and this checkout after it.

1. Megatron-LM's arguments from the same flags as pretrain.py's (its parse_args and validate_args), set as
   its global args with its set_global_variables.
2. Three engines built as pretrain.py builds them (megatron_resil.training.build_engine: megatron-core's
   GPTModel with the local layer spec, DDP, get_megatron_optimizer, OptimizerParamScheduler); Megatron-LM's
   own model_provider builds the same modules with Transformer Engine or CUDA kernels, which this CPU
   host does not have.
3. The first loads our checkpoint (--ours) with megatron-resil's loader; Megatron-LM's
   `megatron.training.checkpointing.save_checkpoint` writes that state to --theirs (the committed test
   data), and each rank's record of it (engine_state.py) goes to --reference/rank<N>.json.
4. Megatron-LM's `load_checkpoint` reads our checkpoint into the second and its own save into the third;
   every tensor of each is compared with the record.
Rank 0 writes the verdicts to --verdict (JSON).

CPU accommodations, here only: megatron-resil's start-up patches (patches.install, as pretrain.py applies
them: torch.cuda stand-ins and the rest of REFERENCE.md's list) and two for Megatron-LM's argument
validation, which asks the GPU for its architecture (`get_device_arch_version`, answered 9: Hopper, the
branch Megatron-LM's GPU runs take) and requires CUDA_DEVICE_MAX_CONNECTIONS=1 under tensor parallelism
(set in the environment by make.py), and Megatron-LM's checkpointing module sees torch through the
host mapping megatron-resil gives megatron-core's modules that create device='cuda' tensors (its
read_metadata all-reduces the tracker's iteration in one). Its load_checkpoint runs under torch.no_grad(),
as tests/megatron_lm_layout.py runs its copy: with fp32 parameters on CPU the distributed optimizer's main
parameters are views of the model's, which its in-place copy may not touch with grad on ("a view of a
leaf Variable that requires grad is being used in an in-place operation").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_state import differences, engine_state, fingerprints  # noqa: E402

from megatron_resil import patches  # noqa: E402
from megatron_resil.arguments import parse_args  # noqa: E402


def megatron_lm_args(flags: list[str], load: str, save: str):
    """Megatron-LM's global args for these flags, as its initialize_megatron sets them."""
    from megatron.training import arguments
    from megatron.training.global_vars import set_global_variables

    if hasattr(arguments, "get_device_arch_version"):
        arguments.get_device_arch_version = lambda: 9  # it asks the GPU; see the module docstring
    argv = sys.argv
    sys.argv = [argv[0], *flags, "--load", load, "--save", save, "--save-interval", "1000"]
    try:
        margs = arguments.parse_args()
    finally:
        sys.argv = argv
    arguments.validate_args(margs)
    set_global_variables(margs)
    return margs


def _one_line(err: BaseException) -> str:
    failures = getattr(err, "failures", None)  # torch DCP's CheckpointException: the ranks' own errors
    if failures:
        wrapped = next(iter(failures.values()))
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"{type(err).__name__} (ranks {sorted(failures)}): {_one_line(inner)}"
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}, {frames[-1].name})" \
        if frames else ""
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}{where}"


def main() -> int:
    outer = argparse.ArgumentParser(add_help=False)
    for name in ("--ours", "--theirs", "--reference", "--verdict"):
        outer.add_argument(name, required=True)
    opts, flags = outer.parse_known_args()
    args = parse_args([*flags, "--load", opts.ours])
    patches.install(args)  # before megatron-core is imported, as pretrain.py installs them
    from megatron.core import package_info
    from megatron.training import checkpointing

    from megatron_resil import parallel
    from megatron_resil.checkpointing.manager import CheckpointConfig, CheckpointManager
    from megatron_resil.patches import megatron_core_cpu
    from megatron_resil.resilience import rerun
    from megatron_resil.tokenizer import build_tokenizer
    from megatron_resil.training import build_engine

    # Its load reads the tracker into a device='cuda' tensor (read_metadata): the same host mapping as
    # megatron-resil gives megatron-core's modules that do so.
    checkpointing.torch = megatron_core_cpu._TorchOnHost()
    parallel.initialize(args)
    rerun.initialize(rerun.RerunConfig.from_args(args))
    margs = megatron_lm_args(flags, opts.ours, opts.theirs)
    vocab_size = build_tokenizer(args).vocab_size
    # For megatron-resil's load of ours, Megatron-LM's load of ours, and its load of its own save.
    engines = [build_engine(args, vocab_size) for _ in range(3)]
    rank = torch.distributed.get_rank()
    verdict: dict = {"megatron_core": package_info.__version__, "torch": torch.__version__,
                     "python": sys.version.split()[0]}

    # What megatron-resil loads from our checkpoint, Megatron-LM saves: the test data.
    progress = CheckpointManager(CheckpointConfig.from_args(args), *engines[0], args).load()
    ours = fingerprints(engine_state(*engines[0], progress.iteration, progress.consumed_train_samples))
    for key in ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples"):
        setattr(margs, key, getattr(progress, key))  # what its training loop holds at a save
    checkpointing.save_checkpoint(progress.iteration, *engines[0], progress.floating_point_operations_so_far)
    os.makedirs(opts.reference, exist_ok=True)
    with open(os.path.join(opts.reference, f"rank{rank}.json"), "w") as f:
        json.dump(ours, f, indent=0, sort_keys=True)
    verdict["save_checkpoint"] = f"wrote iteration {progress.iteration}"

    # Megatron-LM's load_checkpoint of ours, then of its own save (which tells a layout problem from one
    # of this host): every tensor compared with megatron-resil's load of ours.
    for name, directory, engine in (("load_checkpoint of ours", opts.ours, engines[1]),
                                    ("load_checkpoint of its own save", opts.theirs, engines[2])):
        margs.load = directory
        verdict[name] = _load_and_compare(checkpointing, margs, engine, ours, rank)
    _write(opts.verdict, verdict, rank)
    parallel.shutdown()
    return 0


def _load_and_compare(checkpointing, margs, engine, ours: dict, rank: int) -> str:
    from megatron_resil import parallel

    try:
        with torch.no_grad():  # see the module docstring
            iteration, _ = checkpointing.load_checkpoint(*engine)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - the verdict; DCP's CheckpointException is a BaseException
        print(f"[megatron-lm] rank {rank}: load_checkpoint of {margs.load} failed:\n{traceback.format_exc()}",
              flush=True)
        return f"failed: {_one_line(err)}"
    theirs = fingerprints(engine_state(*engine, iteration, margs.consumed_train_samples))
    found = parallel.all_gather_object(differences(ours, theirs))
    said = f"read at iteration {iteration}, consumed samples {margs.consumed_train_samples}; "
    if not any(found):
        return said + ("every tensor equal to megatron-resil's load of ours (model, optimizer state, "
                       f"scheduler, RNG, progress: {len(ours)} tensors on rank 0)")
    return said + "differs: " + "; ".join(f"rank {r}: {d}" for r, diff in enumerate(found) for d in diff[:6])


def _write(path: str, verdict: dict, rank: int) -> None:
    if rank == 0:
        with open(path, "w") as f:
            json.dump(verdict, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
