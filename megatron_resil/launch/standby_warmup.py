"""A standby that imports megatron-core ahead, for one run's patches (issue 26).

A standby (standby.py) imports torch once per node; what was left of a restart's imports was each rank's
own: the arguments, our patch records and megatron-core itself, about 0.55 s of CPU a rank (several ranks
on few cores: more than a second of a restart). megatron-core can only be imported after the patch
records that must precede it, and which records a run installs depends on its arguments
(`--tensorboard-dir`, `--wandb-project`, the local tier, ...). So the standby waits for its first
pretrain.py rank, reads that rank's command line as pretrain.py would (in the rank's environment and
working directory, printing nothing), installs that run's records, imports megatron-core and our training
modules, and only then forks the rank. Every rank of the job, and every restart, has the same arguments,
so each is forked with all of it imported; a rank whose records would differ (another run sharing the
standby's name) is refused and imports for itself, with the one line standby.py prints for a refusal.

What is bound to a process is not done ahead: the fork hook that arms each rank's own forks
(`Patch.per_process`) is installed by each worker, and the `--exit-duration-in-mins` budget counts from
the start of the process the launcher started, not from this import (stop_conditions.py).

`python -m megatron_resil.launch.standby --torch-only` keeps the standby to torch, as before.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from megatron_resil.patches import torch_startup

PRETRAIN = "pretrain.py"


def is_our_launcher(script: str) -> bool:
    """Whether `script` is this checkout's ft_launcher (launch/ft_launcher.py), which a script's launcher
    may hand itself to the standby as (run_local.sh, from a run's second job step on)."""
    ours = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ft_launcher.py")  # (not imported)
    return os.path.realpath(script) == os.path.realpath(ours)


class Warmup:
    """The standby's one import of megatron-core: for which records, or why not."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.key: frozenset[str] | None = None  # the records installed ahead, once warm
        self.failed: str | None = None  # why the import ahead failed: refuse everyone after it

    def refusal(self, request: dict) -> str | None:
        """Whether the standby can serve `request`, importing ahead for it first if this is the first
        pretrain.py run it sees. None: serve it (fork); otherwise the reason, for the client's line."""
        if not self.enabled:
            return None
        if self.failed is not None:
            return f"its import of megatron-core ahead failed ({self.failed})"
        if is_our_launcher(request["argv"][0]):  # no rank: nothing to import ahead for it (docs/standby.md)
            return None
        is_pretrain = os.path.basename(request["argv"][0]) == PRETRAIN
        if not is_pretrain:
            return None if self.key is None else "it has megatron-core imported for pretrain.py runs"
        args, key = _parse(request)
        if args is None or args.check_args_only:  # refused arguments: the worker says so, as a rank would
            return None
        if self.key is None:
            started = time.monotonic()
            self.failed, datasets = _import_ahead(request, args)
            if self.failed is not None:
                print(f"[resil] standby: megatron-core not imported ahead: {self.failed}; the ranks import "
                      "it themselves", flush=True)
                return f"its import of megatron-core ahead failed ({self.failed})"
            self.key = key
            built = ", and its mock data's datasets built" if datasets else ""
            print(f"[resil] standby: megatron-core imported ahead in {time.monotonic() - started:.1f} s with "
                  f"the {len(key)} patch records of the first pretrain.py run{built}; ranks with the same "
                  "records are forked with it", flush=True)
            return None
        if key != self.key:
            differ = sorted(key ^ self.key)
            return (f"it imported megatron-core for another run's patch records ({', '.join(differ[:3])} "
                    f"differ{'s' if len(differ) == 1 else ''})")
        return None


@contextlib.contextmanager
def _as_the_rank(request: dict):
    """The rank's command line, environment and working directory, with nothing printed (fd level: a
    warning from C code too); all put back after."""
    saved_argv, saved_env, saved_cwd = list(sys.argv), dict(os.environ), os.getcwd()
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        sys.argv[:] = request["argv"]
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        with torch_startup.cuda_count_answered(_cuda_devices()):  # asked here, no fork could use CUDA
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in (*saved_fds, devnull):
            os.close(fd)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv[:] = saved_argv


_cuda_count: int | None = None


def _cuda_devices() -> int:
    global _cuda_count
    if _cuda_count is None:
        _cuda_count = torch_startup.cuda_device_count_in_a_child()
    return _cuda_count


def _parse(request: dict) -> tuple:
    """(the rank's arguments, the patch records its run installs ahead), or (None, None) for arguments
    pretrain.py refuses. Both as the rank: the records' conditions ask about CUDA too."""
    from megatron_resil import patches
    from megatron_resil.arguments import parse_args
    from megatron_resil.checkpointing import take_from_checkpoint

    try:
        with _as_the_rank(request):
            args = parse_args(saved_args=take_from_checkpoint)  # as pretrain.py parses
            return args, patches.wanted_ahead(args)
    except (SystemExit, Exception):  # noqa: BLE001 - refused arguments, or a bug: the worker, forked as
        return None, None  # it would be without a standby, says which (the standby must serve on)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _import_ahead(request: dict, args) -> tuple[str | None, bool]:
    """Install the run's records, import what pretrain.py imports next and build mock data's datasets:
    (None, or why it failed; whether the datasets were built)."""
    from megatron_resil import patches

    threads = _threads()
    try:
        with _as_the_rank(request):
            patches.install_ahead(args)
            import torch

            import megatron_resil.training  # noqa: F401 - megatron-core, NVRx, our modules

            datasets = _build_datasets_ahead(args)  # before the thread check: a fork needs none
            if torch.cuda.is_initialized() or torch_startup.forks_cannot_use_cuda():
                return "a rank forked after it could not use CUDA", False
            if _threads() > threads:  # a fork copies only the forking thread: locks held by others stay
                return f"the imports started {_threads() - threads} thread(s)", False
    except patches.UpstreamMismatch as stop:
        return stop.line, False
    except Exception as err:  # noqa: BLE001 - the standby serves on; the ranks import and report it
        return f"{type(err).__name__}: {err}", False
    return None, datasets


def _build_datasets_ahead(args) -> bool:
    """Mock data's datasets, built from the command line alone (its shuffle index: about 0.2 s of CPU a
    rank, nine ranks on two cores here): every fork then has them, and a rank with the same dataset
    arguments builds none (data.kept_for). Not with a tokenizer read from files, whose libraries may
    start threads, and never real data, whose index caches one rank of the job writes for all."""
    from megatron_resil import data
    from megatron_resil.tokenizer import build_tokenizer

    if not args.mock_data or args.tokenizer_type not in data.TOKENIZERS_FROM_ARGUMENTS:
        return False
    try:
        data.build_ahead(args, build_tokenizer(args))
    except Exception:  # noqa: BLE001 - not the standby's to report: each rank builds them, and says why not
        return False
    return True
