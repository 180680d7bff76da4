"""The GPU check's training and timing steps: an uninterrupted run (the reference every exact-resume check
compares with, and our step time), synchronous and async saves to the persistent and to the local tier, each
a run whose loop is timed from its event log; then the ratios: our step time against a bare megatron-core
loop with the same model, and the async-save stall ratio (extra loop time with --async-save / with
synchronous saves), as benchmarks/bench_async.py defines it."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys

from megatron_resil.tools.gpu_check.context import Check, Failed, Skipped, compare_losses, require_exit_0
from megatron_resil.tools.gpu_check.runs import BARE_LOOP, events, iteration_ms, losses, named

# Save variants: (tier whose interval saves land in the timed window, asynchronous).
SAVE_VARIANTS = {
    "save_sync_persistent": ("persistent", False),
    "save_async_persistent": ("persistent", True),
    "save_sync_local": ("local", False),
    "save_async_local": ("local", True),
}
STEP_TIME_GOAL = 1.02
STALL_GOAL = 0.1
TE_NOTE = ("Transformer Engine cannot travel to the GPU machine: transformer_engine_cu13 2.20.2 is a "
           "263.7 MiB wheel (64 MiB travel with a run) and transformer_engine_torch is source only, built "
           "against the machine's torch with nvcc")


def _window(check: Check, save_dir) -> tuple[float, list[dict]]:
    """Seconds from the first logged iteration to the last one (every interval save falls in between; the
    final save comes after), and the saves published inside it."""
    log = events(save_dir)
    progress = {e["iteration"]: e["unix"] for e in named(log, "progress")}
    first, last = check.profile.log_interval, check.profile.train_iters
    if first not in progress or last not in progress:
        raise Failed(f"the event log has no progress records for iterations {first} and {last}")
    saves = [e for e in named(log, "save_published") if e["iteration"] < last]
    return progress[last] - progress[first], saves


def _base_args(check: Check, save_dir) -> list[str]:
    never = str(10 * check.profile.train_iters)  # no persistent save inside the timed window
    return [*check.profile.pretrain_args(), "--save", str(save_dir), "--save-interval", never]


def train(check: Check) -> tuple[dict, str]:
    """The uninterrupted run: reference losses, and the loop time with no save in it."""
    save = check.fresh_dir("train")
    run = check.run("train", _base_args(check, save))
    require_exit_0(run)
    check.reference = losses(run.output)
    if check.profile.train_iters not in check.reference:
        raise Failed(f"no loss line for iteration {check.profile.train_iters}; log tail: {run.tail(300)}")
    window, _ = _window(check, save)
    check.windows["none"] = {"window_s": window}
    # The first two log intervals hold the warm-up (allocator, kernels' autotuning): left out.
    times = iteration_ms(run.output)
    check.train_iteration_ms = [ms for it, ms in sorted(times.items()) if it > 2 * check.profile.log_interval]
    median = statistics.median(check.train_iteration_ms) if check.train_iteration_ms else math.nan
    final = check.reference[check.profile.train_iters]
    return ({"iterations": check.profile.train_iters, "iteration_ms_median": round(median, 3),
             "window_s": round(window, 3), "final_loss": final[0], "launch_s": round(run.seconds, 1)},
            f"{check.profile.train_iters} iterations, {median:.1f} ms each, final loss {final[0]}")


def save_variant(check: Check, name: str) -> tuple[dict, str]:
    tier, asynchronous = SAVE_VARIANTS[name]
    p = check.profile
    save = check.fresh_dir(name)
    args = _base_args(check, save)
    if tier == "persistent":
        args[args.index("--save-interval") + 1] = str(p.save_interval)
    else:
        args += ["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval",
                 str(p.save_interval), "--non-persistent-local-ckpt-dir", str(save / "local")]
    if asynchronous:
        args.append("--async-save")
    run = check.run(name, args)
    require_exit_0(run)
    window, saves = _window(check, save)
    expected = list(range(p.save_interval, p.train_iters, p.save_interval))
    ours = [e for e in saves if (e.get("tier") == "local") == (tier == "local")]
    got = sorted(e["iteration"] for e in ours)
    if got != expected:
        raise Failed(f"{tier} saves published at iterations {got}, expected {expected}")
    if any(bool(e.get("asynchronous")) != asynchronous for e in ours):
        raise Failed(f"a {tier} save was not {'asynchronous' if asynchronous else 'synchronous'}: {ours}")
    blocking = [e.get("blocking_seconds", e["seconds"]) for e in ours]
    figures = {"window_s": round(window, 3), "saves": len(ours),
               "save_s_median": round(statistics.median(e["seconds"] for e in ours), 3),
               "blocking_s_total": round(sum(blocking), 3), "launch_s": round(run.seconds, 1)}
    if asynchronous:  # the trainer's own time, by part: prepare, stage, wait (for the worker), finalize
        parts = {part for e in ours for part in e.get("blocking_parts", {})}
        figures["blocking_parts_s_median"] = {
            part: round(statistics.median(e.get("blocking_parts", {}).get(part, 0.0) for e in ours), 3)
            for part in sorted(parts)}
        figures["worker_cpu_s_median"] = statistics.median(e.get("worker_cpu_seconds", math.nan)
                                                           for e in ours)
    if tier == "persistent":
        figures["checkpoint_mib"] = round(_tree_bytes(save / f"iter_{expected[0]:07d}") / 2**20, 1)
    compared, differ = compare_losses(losses(run.output), check.reference, sorted(check.reference))
    figures["losses_as_train"] = not differ and bool(compared)  # saving must not change training
    check.reproducible = figures["losses_as_train"] and check.reproducible is not False
    check.windows[name] = {"window_s": window, "blocking_s": sum(blocking)}
    return figures, (f"{len(ours)} {tier} saves in the loop, {figures['save_s_median']:.2f} s each"
                     + (f", {figures['checkpoint_mib']:.0f} MiB" if "checkpoint_mib" in figures else "")
                     + ("" if figures["losses_as_train"] else "; losses differ from the train run's"))


def _tree_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def stall_ratio(check: Check) -> tuple[dict, str]:
    """async extra / sync extra per tier, extra = loop window with saves - without (same profile, one
    repeat each, run one after another with nothing else on the host)."""
    if "none" not in check.windows:
        raise Failed("no window without saves: the train step failed")
    base = check.windows["none"]["window_s"]
    figures, parts = {"load_average": [round(x, 2) for x in os.getloadavg()]}, []
    for tier in ("persistent", "local"):
        sync, asynchronous = f"save_sync_{tier}", f"save_async_{tier}"
        if sync not in check.windows or asynchronous not in check.windows:
            raise Failed(f"the {tier} tier's save steps did not both pass")
        sync_extra = check.windows[sync]["window_s"] - base
        async_extra = check.windows[asynchronous]["window_s"] - base
        ratio = async_extra / sync_extra if sync_extra > 0 else None
        figures[tier] = {"sync_extra_s": round(sync_extra, 3), "async_extra_s": round(async_extra, 3),
                         "ratio": None if ratio is None else round(ratio, 3), "goal": STALL_GOAL,
                         "met": ratio is not None and ratio <= STALL_GOAL}
        parts.append(f"{tier} {'n/a' if ratio is None else f'{ratio:.2f}'}")
    return figures, "async extra / sync extra: " + ", ".join(parts) + f" (goal <= {STALL_GOAL})"


def step_time_ratio(check: Check) -> tuple[dict, str]:
    """pretrain.py's steady-state iteration time / the bare loop's, same model, same flags."""
    if not check.train_iteration_ms:
        raise Failed("no iteration times from the train step")
    p = check.profile
    out = check.fresh_dir("bare_loop") / "bare.json"
    block = p.log_interval if p.log_interval > 1 else 2
    run = check.run("bare_loop", ["--warmup", str(p.bare_warmup), "--steps", str(p.bare_steps), "--block",
                                  str(block), "--json", str(out), "--", *p.pretrain_args()], script=BARE_LOOP)
    require_exit_0(run)
    bare = json.loads(out.read_text())
    ours = statistics.median(check.train_iteration_ms)
    ratio = ours / bare["step_ms_median"]
    figures = {"ours_ms": round(ours, 3), "bare_ms": round(bare["step_ms_median"], 3),
               "ratio": round(ratio, 4), "goal": STEP_TIME_GOAL, "met": ratio <= STEP_TIME_GOAL,
               "bare_block_ms": bare["block_ms"], "parameters": bare["parameters"]}
    return figures, (f"{ours:.2f} ms / {bare['step_ms_median']:.2f} ms = {ratio:.3f} "
                     f"(goal <= {STEP_TIME_GOAL})")


def standby(check: Check) -> tuple[dict, str]:
    """The train run again, its rank forked from a launcher's standby that imported megatron-core ahead
    (docs/standby.md): the standby asks about CUDA devices in a child of its own, so the forked rank can
    initialize CUDA; its losses are the train run's."""
    if not check.cuda:
        raise Skipped("needs CUDA")  # on CPU: tests/test_standby_warmup.py
    save = check.fresh_dir("standby")
    run = check.run("standby", _base_args(check, save),
                    wrapper=(sys.executable, "-m", "megatron_resil.launch.standby", "--"))
    require_exit_0(run)
    if "[resil] standby: megatron-core imported ahead" not in run.output:
        raise Failed(f"the standby did not import megatron-core ahead; log tail: {run.tail(600)}")
    (record,) = named(events(save), "restart_phases") or [{}]
    details = record.get("details", {})
    if not (details.get("standby") and details.get("megatron_core_ahead")):
        raise Failed(f"the rank was not forked with megatron-core imported: {details}")
    compared, differ = compare_losses(losses(run.output), check.reference, sorted(check.reference))
    if check.reference and (not compared or differ):
        raise Failed(f"losses differ from the train run's: {'; '.join(differ[:3]) or 'none logged'}")
    imports = record.get("phases", {}).get("imports")
    return ({"imports_s": imports, "iterations_compared": len(compared), "launch_s": round(run.seconds, 1)},
            f"forked with megatron-core imported ahead, on CUDA; imports phase {imports} s; "
            f"{len(compared)} logged iterations as the train run's")


def transformer_engine(check: Check) -> tuple[dict, str]:
    if not check.cuda:
        raise Skipped("needs CUDA")
    if not check.transformer_engine:
        raise Skipped(f"Transformer Engine is not installed here. {TE_NOTE}")
    iters = 4 * check.profile.log_interval
    run = check.run("transformer_engine", [*check.profile.pretrain_args(iters), "--transformer-impl",
                                           "transformer_engine"])
    require_exit_0(run)
    found = losses(run.output)
    if iters not in found or not math.isfinite(float(found[iters][0])):
        raise Failed(f"no finite loss at iteration {iters}; log tail: {run.tail(300)}")
    times = [ms for it, ms in iteration_ms(run.output).items() if it > 2 * check.profile.log_interval]
    median = statistics.median(times) if times else math.nan
    return ({"iterations": iters, "iteration_ms_median": round(median, 3), "final_loss": found[iters][0]},
            f"{iters} iterations with --transformer-impl transformer_engine, {median:.1f} ms each")
