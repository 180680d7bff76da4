"""The GPU check's failure steps: SIGKILL of the whole run while an async save is in flight, then an exact
resume; an exception that restarts training in the same process (--inprocess-restart); a slowed rank that
the straggler detector reports (and, on CUDA, NVRx's kernel-timing path reporting too); a NaN loss that the
rerun state machine reruns in place and judges transient (exit 17)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from megatron_resil.tools.gpu_check.context import Check, Failed, Skipped, compare_losses, require_exit_0
from megatron_resil.tools.gpu_check.runs import REPO, EventTail, events, kill_tree, losses, named

_ACCEPTED = re.compile(r"^\[resil\] load: accepted persistent iteration (\d+)", re.M)
_POLL_S = 0.003


def _in_flight(log: list[dict]) -> tuple[int | None, list[int]]:
    """(an async save started after the newest published one, if any; the published iterations)."""
    published = sorted(e["iteration"] for e in named(log, "save_published"))
    started = [e["iteration"] for e in named(log, "save_started")
               if e.get("asynchronous") and e["iteration"] not in published]
    if published and started and max(started) > published[-1]:
        return max(started), published
    return None, published


def _determinism_note(check: Check) -> str:
    if check.reproducible is False:
        return ("; the save steps' uninterrupted runs did not repeat the train run's losses either: this "
                "device's training is not deterministic run to run, so a resume cannot be exact")
    return ""


def kill9_async_resume(check: Check) -> tuple[dict, str]:
    """SIGKILL the agent, the rank and its writer while an async save is in flight (one is published before
    it); the next launch must load the newest published checkpoint, clean the dead save's staging directory
    and continue with exactly the uninterrupted run's losses."""
    if not check.reference:
        raise Failed("no reference losses: the train step failed")
    p = check.profile
    save = check.fresh_dir("kill9")
    args = [*p.pretrain_args(), "--save", str(save), "--load", str(save),
            "--save-interval", str(p.kill_save_interval), "--async-save"]
    limit = check.timeout()
    proc, log = check.launcher.start("kill9_run", args)
    began, target, tail = time.monotonic(), None, EventTail(save)
    try:
        while target is None:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-300:]
                raise Failed(f"the run ended (exit code {proc.returncode}) before an async save was in "
                             f"flight after a published one; log tail: {tail}")
            if time.monotonic() - began > limit:
                raise Failed(f"no async save in flight after a published one within {limit:.0f} s")
            target, _ = _in_flight(tail.read())
            time.sleep(_POLL_S)
        time.sleep(p.kill_delay_s)
    finally:
        kill_tree(proc)
    killed_after = time.monotonic() - began
    _, published = _in_flight(events(save))
    if target in published:
        raise Failed(f"the async save of iteration {target} was published before the SIGKILL landed")
    staging = sorted(path.name for path in save.glob(f".tmp_iter_{target:07d}_*"))
    expected = published[-1]
    resumed = check.run("kill9_resume", args)
    require_exit_0(resumed)
    accepted = _ACCEPTED.findall(resumed.output)
    if accepted != [str(expected)]:
        raise Failed(f"the resume accepted {accepted or 'nothing'}, expected persistent iteration {expected}")
    cleanup = [line for line in resumed.output.splitlines() if line.startswith("[resil] cleanup:")]
    missed = [name for name in staging if not any(name in line for line in cleanup)]
    if missed:
        raise Failed(f"the dead save's staging directory {missed} was not reported cleaned: {cleanup}")
    compared, differ = compare_losses(losses(resumed.output), check.reference,
                                      [i for i in check.reference if i > expected])
    if not compared:
        raise Failed(f"no loss of the resumed run after iteration {expected} to compare")
    if differ:
        raise Failed(f"resumed losses differ from the uninterrupted run's: {'; '.join(differ[:3])}"
                     + _determinism_note(check), compared=len(compared), differing=len(differ))
    figures = {"killed_during_save_of_iteration": target, "killed_after_s": round(killed_after, 2),
               "staging_left": staging, "resumed_from": expected, "iterations_compared": len(compared)}
    return figures, (f"killed in the async save of {target}, resumed from {expected}: "
                     f"{len(compared)} logged iterations exact")


def inprocess_restart(check: Check) -> tuple[dict, str]:
    if not check.reference:
        raise Failed("no reference losses: the train step failed")
    p = check.profile
    save = check.fresh_dir("inprocess")
    fault = p.inprocess_fault_iteration
    run = check.run("inprocess_restart", [
        *p.pretrain_args(), "--save", str(save), "--load", str(save), "--save-interval", str(p.save_interval),
        "--inprocess-restart", "--inject-fault", "exception", "--inject-fault-iteration", str(fault)])
    require_exit_0(run)
    restarts = [line for line in run.output.splitlines() if line.startswith("[resil] restart:")]
    if len(restarts) != 1:
        raise Failed(f"expected one in-process restart, the log has {len(restarts)}: {restarts[:3]}")
    log = events(save)
    starts = named(log, "start")
    if len(starts) != 2 or starts[0].get("pid") != starts[1].get("pid"):
        raise Failed(f"the second attempt did not start in the same process: {starts}")
    loaded = [e["iteration"] for e in named(log, "loaded")]
    expected = (fault - 1) // p.save_interval * p.save_interval
    if loaded != [expected]:
        raise Failed(f"the restarted attempt loaded {loaded}, expected iteration {expected}")
    after = run.output.split(restarts[0], 1)[1]
    compared, differ = compare_losses(losses(after), check.reference,
                                      [i for i in check.reference if i > expected])
    if not compared or differ:
        raise Failed("losses after the restart are not the uninterrupted run's: "
                     f"{'; '.join(differ[:3]) or 'none logged'}" + _determinism_note(check))
    return ({"fault_iteration": fault, "resumed_from": expected, "iterations_compared": len(compared),
             "launch_s": round(run.seconds, 1)},
            f"exception at {fault}, same process resumed from {expected}: {len(compared)} logged "
            "iterations exact")


def collective_abort(check: Check) -> tuple[dict, str]:
    """The collective-abort drill on NCCL (megatron_resil/tools/abort_drill.py): a rank inside an all-reduce
    with a dead peer is freed by the in-process layer's abort, then forms a new group with a replacement.
    Two processes, one GPU each: needs two GPUs (the machine we are lent has one; on CPU,
    tests/test_abort_drill.py runs the same drill on gloo)."""
    if not check.cuda:
        raise Skipped("needs CUDA")
    workdir = check.fresh_dir("abort_drill")
    try:
        done = subprocess.run([sys.executable, "-m", "megatron_resil.tools.abort_drill", "--backend", "nccl",
                               "--workdir", str(workdir)], env=check.launcher.env, cwd=REPO,
                              capture_output=True, text=True, timeout=check.timeout())
    except subprocess.TimeoutExpired as expired:
        raise Failed(f"the drill did not end within {expired.timeout:.0f} s") from None
    if done.returncode == 2:  # "--backend nccl needs two GPUs; this machine has 1"
        raise Skipped(done.stderr.strip().splitlines()[-1].removeprefix("abort_drill: error: "))
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    if done.returncode != 0 or not result or not result.get("ok"):
        raise Failed(f"exit code {done.returncode}: {(lines[-1] if lines else done.stderr[-400:])[:600]}")
    figures = {k: result[k] for k in ("hung_collective", "seconds_after_abort")}
    return figures, (f"the all-reduce with a dead peer {result['hung_collective']} "
                     f"{result['seconds_after_abort']} s after the abort; the new group's sum is right")


def straggler(check: Check) -> tuple[dict, str]:
    """A 'slow' fault from one iteration on: our own-work timing must call rank 0 a straggler (its individual
    score drops). The run's output is kept for straggler_gpu."""
    p = check.profile
    interval = max(2, p.log_interval)
    run = check.run("straggler", [
        *p.pretrain_args(p.straggler_iters), "--log-straggler", "--straggler-report-interval", str(interval),
        "--inject-fault", "slow", "--inject-fault-iteration", str(p.straggler_slow_from),
        "--inject-fault-slow-secs", str(p.straggler_slow_s), "--inject-fault-repeat"])
    check.straggler_output = run.output
    require_exit_0(run)
    reports = re.findall(r"straggler report at iteration (\d+)", run.output)
    decisions = re.findall(r"^\[resil\] straggler: rank 0 on .*?individual ([\d.]+).*? at iteration (\d+)",
                           run.output, re.M)
    if not reports:
        raise Failed("no straggler report in the log")
    if not decisions:
        raise Failed(f"the slowed rank was not reported as a straggler ({len(reports)} reports)")
    score, iteration = decisions[0]
    return ({"reports": len(reports), "first_detection_iteration": int(iteration),
             "individual_score": float(score)},
            f"slowed from iteration {p.straggler_slow_from}, reported at {iteration} (individual score "
            f"{score})")


def straggler_gpu(check: Check) -> tuple[dict, str]:
    """NVRx's CUPTI Detector in the same run: initialised, and its GPU kernel scores in the reports."""
    if not check.cuda:
        raise Skipped("needs CUDA")
    output = check.straggler_output
    if not output:
        raise Failed("the straggler step did not run")
    unavailable = re.search(r"NVRx Detector unavailable \(([^)]*)\)", output)
    if unavailable:
        raise Failed(f"NVRx Detector unavailable: {unavailable.group(1)}")
    if "NVRx GPU kernel scores too" not in output or "GPU relative performance" not in output:
        raise Failed("no NVRx GPU kernel scores in the straggler reports")
    return {"gpu_reports": output.count("GPU relative performance")}, "NVRx GPU kernel scores reported"


def rerun_nan(check: Check) -> tuple[dict, str]:
    """A NaN injected into one loss (once): rerun in place on the same device, not reproduced, so a transient
    fault, and the rank exits 17; with the checkpoint of the iteration before it where megatron-core asks for
    one (0.16 does, 0.19 does not)."""
    p = check.profile
    save = check.fresh_dir("rerun")
    nan_at = p.rerun_nan_iteration
    run = check.run("rerun_nan", [
        *p.pretrain_args(p.rerun_iters), "--save", str(save), "--load", str(save),
        "--save-interval", "100000", "--inject-fault", "nan-loss", "--inject-fault-iteration", str(nan_at)])
    if run.returncode is None:
        raise Failed(f"killed at its time limit; log tail: {run.tail(300)}")
    log = events(save)
    exits = [e.get("exit_code") for e in named(log, "exit")]
    lines = [line for line in run.output.splitlines()
             if line.startswith(f"[resil] rerun: iteration {nan_at}:")]
    if exits != [17] or run.rank_exit_code() != 17 or len(lines) != 1 or "not reproduced" not in lines[0]:
        raise Failed(f"expected a 'not reproduced' verdict and exit code 17, got rank exit "
                     f"{run.rank_exit_code()}, events {exits}; rerun lines: {lines[:2]}; "
                     f"log tail: {run.tail(300)}")
    saving = f"saving the checkpoint of iteration {nan_at - 1}" in lines[0]
    published = sorted(e["iteration"] for e in named(log, "save_published"))
    if published != ([nan_at - 1] if saving else []):
        raise Failed(f"the rerun line {'promises' if saving else 'promises no'} checkpoint of iteration "
                     f"{nan_at - 1}; published: {published}")
    return ({"nan_iteration": nan_at, "saved_iteration": nan_at - 1 if saving else None, "exit_code": 17},
            f"NaN at iteration {nan_at} rerun in place: transient, "
            + (f"saved {nan_at - 1}, " if saving else "no checkpoint asked for, ") + "exit 17")
