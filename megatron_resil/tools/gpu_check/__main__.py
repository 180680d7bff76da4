"""The GPU check (issues 25, 38): one command that whoever holds the GPU machine runs in one go, within 9
minutes.

    bash scripts/gpu_check.sh OUT            # GPU machine: install gpu_wheels/, every step (NCCL, bf16)
    bash scripts/gpu_check.sh --dry-run OUT  # CPU machine, CI: every step CUDA is not needed for (gloo)

Steps, each a real pretrain.py launch under torchrun (world size 1) unless said otherwise: install (the
wheels, beside the machine's torch), train (the uninterrupted reference), synchronous and async saves to the
persistent and the local tier (each run's losses the train run's exactly), SIGKILL during an async save then
an exact resume, in-process restart, an all-reduce with a dead peer freed by the abort (NCCL; needs two
GPUs), the straggler detector (and NVRx's CUDA kernel timing), the rerun state machine on an injected NaN,
Transformer Engine (where installed: trained, saved, killed and resumed exactly), the standby, the step
time against a bare megatron-core loop (alternated in rounds), the async-save stall ratio. A step that
fails is recorded with its reason and the check goes on; each launch is bounded in time, and so is the
whole. OUT gets results.json, summary.txt and logs/. Exit code 0 when no step failed, 1 when one did, 2 for
bad arguments.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from functools import partial
from pathlib import Path

from megatron_resil.tools.gpu_check import fault_steps, install, report, train_steps
from megatron_resil.tools.gpu_check.context import Check, Failed, Skipped, StepResult
from megatron_resil.tools.gpu_check.profiles import DRY_RUN, GPU
from megatron_resil.tools.gpu_check.runs import REPO, Launcher, python_probe

# In the order they run: what the budget leaves out at the end is run again with --steps in a second call.
STEPS = {
    "train": train_steps.train,
    **{name: partial(train_steps.save_variant, name=name) for name in train_steps.SAVE_VARIANTS},
    "async_stall_ratio": train_steps.stall_ratio,
    "step_time_ratio": train_steps.step_time_ratio,
    "kill9_async_resume": fault_steps.kill9_async_resume,
    "inprocess_restart": fault_steps.inprocess_restart,
    "collective_abort": fault_steps.collective_abort,
    "straggler": fault_steps.straggler,
    "straggler_gpu": fault_steps.straggler_gpu,
    "rerun_nan": fault_steps.rerun_nan,
    "standby": train_steps.standby,
    "transformer_engine": train_steps.transformer_engine,
}
_KEPT = {"site", "retagged_wheels"}  # the install's, for every later launch


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"gpu_check: error: {message}\n")
        sys.exit(2)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="results folder (created): results.json, summary.txt, logs/")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: gloo, a tiny GPT, the steps that need no CUDA")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="folder of cp312 wheels (default: gpu_wheels/, see scripts/fetch_gpu_wheels.sh)")
    parser.add_argument("--install", action="store_true", help="in a dry run, install the wheels too")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where checkpoints and the installed wheels go (default: a new temporary one)")
    parser.add_argument("--steps", default=None,
                        help=f"comma-separated subset of: install, {', '.join(STEPS)}")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"the whole check at most (default {GPU.budget_s:.0f} s on GPU, "
                             f"{DRY_RUN.budget_s:.0f} s dry)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (checkpoints) afterwards")
    opts = parser.parse_args(argv)
    if opts.out.exists() and not opts.out.is_dir():
        parser.error(f"{opts.out} is not a folder: give a folder for the results")
    if opts.wheels is not None and not opts.wheels.is_dir():
        parser.error(f"--wheels {opts.wheels}: no such folder (scripts/fetch_gpu_wheels.sh makes one)")
    if opts.budget_s is not None and opts.budget_s <= 0:
        parser.error(f"--budget-s {opts.budget_s:g}: give a positive number of seconds")
    if opts.steps is not None:
        opts.steps = [s.strip() for s in opts.steps.split(",") if s.strip()]
        unknown = [s for s in opts.steps if s != "install" and s not in STEPS]
        if unknown or not opts.steps:
            parser.error(f"--steps {','.join(unknown) or '(empty)'}: unknown; choose from install, "
                         f"{', '.join(STEPS)}")
    return opts


def base_env(dry_run: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    if dry_run:
        env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    else:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS the same run to run: resumes compare exactly
    return env


def install_step(opts: argparse.Namespace, env: dict, before: dict,
                 workdir: Path) -> tuple[StepResult, dict, dict]:
    """(its result, the environment the runs get, what the probe found in it)."""
    began = time.monotonic()
    after = before

    def result(status: str, reason: str, **figures) -> tuple[StepResult, dict, dict]:
        return StepResult("install", status, reason, round(time.monotonic() - began, 1), figures), env, after

    if opts.dry_run and not opts.install:
        return result("skipped", "dry run: this machine's own installation (--install: the wheels)")
    wheels = opts.wheels or REPO / "gpu_wheels"
    if not any(wheels.glob("*.whl")):
        if before.get("megatron-core") and before.get("nvidia-resiliency-ext"):
            return result("skipped", f"no wheels in {wheels}; megatron-core {before['megatron-core']} and "
                          f"NVRx {before['nvidia-resiliency-ext']} are installed here already")
        return result("failed", f"no wheels in {wheels} and no megatron-core here: run "
                      "scripts/fetch_gpu_wheels.sh on the CPU machine and send gpu_wheels/ along")
    site = workdir / "site"
    try:
        installed, notes = install.install(wheels, site, timeout=180)
    except (RuntimeError, OSError) as err:
        return result("failed", str(err))
    env = {**env, "PYTHONPATH": os.pathsep.join((str(site), env["PYTHONPATH"]))}
    after = python_probe(env, install.PROBE)
    figures = {"wheels": installed, "notes": notes, "torch_before": before.get("torch"),
               "torch_after": after.get("torch"), "megatron-core": after.get("megatron-core"),
               "nvidia-resiliency-ext": after.get("nvidia-resiliency-ext")}
    if (after.get("torch"), after.get("torch_file")) != (before.get("torch"), before.get("torch_file")):
        return result("failed", f"torch changed: {before.get('torch')} at {before.get('torch_file')} before, "
                      f"{after.get('torch')} at {after.get('torch_file')} after", **figures)
    missing = [d for d in ("megatron-core", "nvidia-resiliency-ext", "isal", "google-crc32c")
               if not after.get(d)]
    if missing:
        return result("failed", "; ".join(f"{d}: {after.get(d + '_error')}" for d in missing), **figures)
    return result("passed", f"{len(installed)} wheels; torch {after['torch']} untouched; megatron-core "
                  f"{after['megatron-core']}, NVRx {after['nvidia-resiliency-ext']}", **figures)


def run_step(check: Check, name: str, step) -> StepResult:
    began = time.monotonic()
    figures: dict = {}
    try:
        figures, reason = step(check)
        status = "passed"
    except Skipped as skip:
        status, reason = "skipped", str(skip)
    except Failed as fail:
        status, reason, figures = "failed", str(fail), fail.figures
    except Exception as err:  # noqa: BLE001 - a bug in one step must not cost the others their GPU time
        status, reason = "failed", f"{type(err).__name__}: {err} (traceback in logs/{name}.traceback)"
        (check.launcher.log_dir / f"{name}.traceback").write_text(traceback.format_exc())
    result = StepResult(name, status, reason, round(time.monotonic() - began, 1), figures)
    print(f"[gpu_check] {name}: {status} ({result.seconds:.1f} s) {reason}", flush=True)
    return result


def _clear(workdir: Path) -> None:
    for child in workdir.iterdir():
        if child.name not in _KEPT:
            shutil.rmtree(child, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    began = time.monotonic()
    profile = DRY_RUN if opts.dry_run else GPU
    profile = replace(profile, budget_s=opts.budget_s or profile.budget_s)
    env = base_env(opts.dry_run)
    before = python_probe(env, install.PROBE)
    if "torch_error" in before or "error" in before:
        print(f"gpu_check: error: torch does not import with {sys.executable}: "
              f"{before.get('torch_error') or before.get('error')}", file=sys.stderr)
        return 2
    if not opts.dry_run and not before.get("cuda"):
        print(f"gpu_check: error: torch {before.get('torch')} sees no CUDA device here; on a CPU machine run "
              "with --dry-run", file=sys.stderr)
        return 2
    opts.out.mkdir(parents=True, exist_ok=True)
    workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    wanted = opts.steps or ["install", *STEPS]
    steps: list[StepResult] = []
    try:
        after = before
        if "install" in wanted:
            result, env, after = install_step(opts, env, before, workdir)
            print(f"[gpu_check] install: {result.status} ({result.seconds:.1f} s) {result.reason}",
                  flush=True)
            steps.append(result)
        missing = [name for name in ("megatron-core", "nvidia-resiliency-ext") if not after.get(name)]
        environment = {**after, "mode": profile.name, "cpus": os.cpu_count(),
                       "glibc": os.confstr("CS_GNU_LIBC_VERSION"), "load_average_at_start": os.getloadavg()}
        check = Check(profile, Launcher(env, opts.out / "logs"), workdir, deadline=began + profile.budget_s,
                      cuda=bool(after.get("cuda")), transformer_engine=bool(after.get("transformer-engine")))
        for name, step in STEPS.items():
            if name in wanted and missing:  # every launch would die at its imports
                steps.append(StepResult(name, "skipped", f"{' and '.join(missing)} not importable: see the "
                                        "install step", 0.0))
            elif name in wanted:
                steps.append(run_step(check, name, step))
                if not opts.keep:
                    _clear(workdir)
    finally:
        if not opts.keep and opts.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    text = report.write(opts.out, profile.name, environment, profile, steps, time.monotonic() - began)
    print(text, end="")
    return 0 if all(s.status != "failed" for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
