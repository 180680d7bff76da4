"""The GPU check's training and timing steps: an uninterrupted run (the reference every exact-resume check
compares with), synchronous and async saves to the persistent and to the local tier, each a run whose
losses must be the uninterrupted run's and whose saves are timed from its event log; then the ratios: our step
time against a bare megatron-core loop with the same (larger) model, the two alternated in rounds, and the
async-save stall ratio as benchmarks/bench_async.py defines it (the trainer's blocked time per async save /
a synchronous save's time, with the extra loop time beside it); and Transformer Engine trained, saved,
killed and resumed exactly where it is installed."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import time

from megatron_resil.tools.gpu_check.context import Check, Failed, Skipped, compare_losses, require_exit_0
from megatron_resil.tools.gpu_check.runs import (
    BARE_LOOP,
    EventTail,
    events,
    iteration_ms,
    kill_tree,
    losses,
    named,
)

# Save variants: (tier whose interval saves land in the timed window, asynchronous).
SAVE_VARIANTS = {
    "save_sync_persistent": ("persistent", False),
    "save_async_persistent": ("persistent", True),
    "save_sync_local": ("local", False),
    "save_async_local": ("local", True),
}
STEP_TIME_GOAL = 1.02
STALL_GOAL = 0.1
GPU_BOUND_MS = 150.0  # a step at least this long is bound by the device, not by kernel launches
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
    median = _steady_ms(run.output, 2 * check.profile.log_interval)
    final = check.reference[check.profile.train_iters]
    return ({"iterations": check.profile.train_iters, "iteration_ms_median": round(median, 3),
             "window_s": round(window, 3), "final_loss": final[0], "launch_s": round(run.seconds, 1)},
            f"{check.profile.train_iters} iterations, {median:.1f} ms each, final loss {final[0]}")


def _steady_ms(output: str, after: int) -> float:
    """The median of the log lines' per-iteration times after iteration `after` (the warm-up left out)."""
    times = [ms for it, ms in iteration_ms(output).items() if it > after]
    return statistics.median(times) if times else math.nan


def save_variant(check: Check, name: str) -> tuple[dict, str]:
    """Interval saves of one tier, synchronous or async, inside the timed window: at least three, each
    published, the training losses the train run's exactly (saving must not change training)."""
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
    if got != expected or len(got) < 3:
        raise Failed(f"{tier} saves published at iterations {got}, expected {expected} (at least three)")
    if any(bool(e.get("asynchronous")) != asynchronous for e in ours):
        raise Failed(f"a {tier} save was not {'asynchronous' if asynchronous else 'synchronous'}: {ours}")
    log = events(save)
    per_save = [e.get("blocking_seconds", e["seconds"]) for e in ours]
    began = sorted(e["unix"] for e in named(log, "save_started") if e["iteration"] in expected)
    figures = {"window_s": round(window, 3), "saves": len(ours),
               "save_s_median": round(statistics.median(e["seconds"] for e in ours), 3),
               "blocking_s_median": round(statistics.median(per_save), 3),
               "blocking_s_total": round(sum(per_save), 3), "launch_s": round(run.seconds, 1),
               "interval_s": round(statistics.median(b - a for a, b in zip(began, began[1:], strict=False)),
                                   3),
               "found_previous_writing": len(named(log, "save_busy"))}
    if asynchronous:  # the trainer's own time by part, and the worker's phases and wall time
        figures["blocking_parts_s_median"] = _medians([e.get("blocking_parts", {}) for e in ours])
        figures["worker_s_median"] = _medians([{k[len("worker_"):]: v for k, v in e.items()
                                                if k.startswith("worker_")} for e in ours])
        figures["interval_longer_than_write"] = \
            figures["interval_s"] > figures["worker_s_median"].get("seconds", 0.0)
    if tier == "persistent":
        figures["checkpoint_mib"] = round(_tree_bytes(save / f"iter_{expected[0]:07d}") / 2**20, 1)
    compared, differ = compare_losses(losses(run.output), check.reference, sorted(check.reference))
    figures["losses_as_train"] = not differ and bool(compared)
    check.reproducible = figures["losses_as_train"] and check.reproducible is not False
    check.windows[name] = {"window_s": window, "blocking_s_median": figures["blocking_s_median"],
                           "save_s_median": figures["save_s_median"],
                           "blocking_parts": figures.get("blocking_parts_s_median", {})}
    if not figures["losses_as_train"]:
        raise Failed(f"the run with {tier} saves did not train as the train run did: "
                     f"{'; '.join(differ[:3]) or 'no losses logged'}", **figures)
    return figures, (f"{len(ours)} {tier} saves in the loop, {figures['save_s_median']:.2f} s each"
                     + (f", {figures['checkpoint_mib']:.0f} MiB" if "checkpoint_mib" in figures else "")
                     + (f", {figures['blocking_s_median']:.2f} s blocking" if asynchronous else "")
                     + f"; {len(compared)} logged iterations as the train run's")


def _medians(records: list[dict]) -> dict:
    keys = sorted({key for record in records for key in record})
    return {key: round(statistics.median(record.get(key, 0.0) for record in records), 3) for key in keys}


def _tree_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def stall_ratio(check: Check) -> tuple[dict, str]:
    """Per tier, as bench_async.py: the trainer's blocked time per async save / a synchronous save's time
    (medians of at least three saves each), and beside it the extra loop time, async / sync (extra = loop
    window with saves - without; one run each, one after another with nothing else on the host)."""
    if "none" not in check.windows:
        raise Failed("no window without saves: the train step failed")
    base = check.windows["none"]["window_s"]
    figures, parts = {"load_average": [round(x, 2) for x in os.getloadavg()]}, []
    for tier in ("persistent", "local"):
        sync, asynchronous = f"save_sync_{tier}", f"save_async_{tier}"
        if sync not in check.windows or asynchronous not in check.windows:
            raise Failed(f"the {tier} tier's save steps did not both pass")
        sync_s = check.windows[sync]["save_s_median"]
        blocked = check.windows[asynchronous]["blocking_s_median"]
        ratio = blocked / sync_s if sync_s > 0 else None
        sync_extra = check.windows[sync]["window_s"] - base
        async_extra = check.windows[asynchronous]["window_s"] - base
        figures[tier] = {"blocked_s": blocked, "sync_save_s": sync_s,
                         "ratio": None if ratio is None else round(ratio, 3), "goal": STALL_GOAL,
                         "met": ratio is not None and ratio <= STALL_GOAL,
                         "blocking_parts_s": check.windows[asynchronous]["blocking_parts"],
                         "sync_extra_s": round(sync_extra, 3), "async_extra_s": round(async_extra, 3),
                         "extra_loop_ratio": round(async_extra / sync_extra, 3) if sync_extra > 0 else None}
        parts.append(f"{tier} {'n/a' if ratio is None else f'{ratio:.2f}'}")
    return figures, ("trainer blocked per async save / sync save: " + ", ".join(parts)
                     + f" (goal <= {STALL_GOAL})")


def step_time_ratio(check: Check) -> tuple[dict, str]:
    """pretrain.py's steady-state iteration time / the bare megatron-core loop's, same model and flags,
    launched in turns (`step_rounds` of each, the order swapped every round); the median of the rounds'
    ratios. The model is large enough that a step is bound by the device (>= 150 ms on a GPU)."""
    p = check.profile
    block = p.log_interval if p.log_interval > 1 else 2
    rounds = []
    for number in range(p.step_rounds):
        got = {}
        for which in (("ours", "bare") if number % 2 == 0 else ("bare", "ours")):
            got[which] = _ours_ms(check, number) if which == "ours" else _bare_ms(check, number, block)
        rounds.append({**got, "ratio": round(got["ours"] / got["bare"], 4)})
    ratios = [r["ratio"] for r in rounds]
    ratio = statistics.median(ratios)
    ours = statistics.median(r["ours"] for r in rounds)
    bare = statistics.median(r["bare"] for r in rounds)
    bound = not check.cuda or ours >= GPU_BOUND_MS
    figures = {"rounds": rounds, "ratio": round(ratio, 4), "spread": [min(ratios), max(ratios)],
               "ours_ms": round(ours, 3), "bare_ms": round(bare, 3), "goal": STEP_TIME_GOAL,
               "met": ratio <= STEP_TIME_GOAL, "device_bound": bound}
    return figures, (f"median of {len(rounds)} rounds {ratio:.3f} ({min(ratios):.3f}-{max(ratios):.3f}); "
                     f"{ours:.1f} ms / {bare:.1f} ms a step (goal <= {STEP_TIME_GOAL})"
                     + ("" if bound else f"; under {GPU_BOUND_MS:.0f} ms: not bound by the device"))


def _ours_ms(check: Check, number: int) -> float:
    run = check.run(f"step_time_pretrain_{number + 1}", check.profile.step_args())
    require_exit_0(run)
    ms = _steady_ms(run.output, check.profile.step_warmup)
    if not math.isfinite(ms):
        raise Failed(f"no iteration times in {run.name}'s log; tail: {run.tail(300)}")
    return ms


def _bare_ms(check: Check, number: int, block: int) -> float:
    p = check.profile
    out = check.fresh_dir(f"bare_loop_{number + 1}") / "bare.json"
    run = check.run(f"step_time_bare_{number + 1}", [
        "--warmup", str(p.step_warmup), "--steps", str(p.step_iters), "--block", str(block),
        "--json", str(out), "--", *p.step_args()], script=BARE_LOOP)
    require_exit_0(run)
    return json.loads(out.read_text())["step_ms_median"]


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
    """Transformer Engine, the GPU default users run, where it is installed: trained with async saves, the
    whole run killed with SIGKILL after its second save is published and training has gone on, then resumed.
    The resume must load that checkpoint (TE's `_extra_state` of every layer through the load's allow-list)
    and repeat the killed run's losses exactly."""
    if not check.cuda:
        raise Skipped("needs CUDA")
    if not check.transformer_engine:
        raise Skipped(f"Transformer Engine is not installed here. {TE_NOTE}")
    p = check.profile
    save = check.fresh_dir("transformer_engine")
    interval = p.te_iters // 3
    args = [*p.pretrain_args(p.te_iters), "--transformer-impl", "transformer_engine", "--save", str(save),
            "--load", str(save), "--save-interval", str(interval), "--async-save"]
    limit = check.timeout()
    proc, log = check.launcher.start("transformer_engine_run", args)
    tail, began = EventTail(save), time.monotonic()
    try:
        while True:  # the second save published, and training a log interval past it
            seen = tail.read()
            published = [e["iteration"] for e in named(seen, "save_published")]
            reached = max((e["iteration"] for e in named(seen, "progress")), default=0)
            if 2 * interval in published and reached >= 2 * interval + p.log_interval:
                break
            if proc.poll() is not None:
                raise Failed(f"the run ended (exit code {proc.returncode}) before its second save and the "
                             f"iterations after it; log tail: {log.read_text(errors='replace')[-300:]}")
            if time.monotonic() - began > limit:
                raise Failed(f"no second save and progress past it within {limit:.0f} s")
            time.sleep(0.01)
    finally:
        kill_tree(proc)
    killed = losses(log.read_text(errors="replace"))
    expected = max(e["iteration"] for e in named(events(save), "save_published"))
    extra_states = _extra_state_items(save / f"iter_{expected:07d}")
    resumed = check.run("transformer_engine_resume", args)
    require_exit_0(resumed)
    accepted = re.findall(r"^\[resil\] load: accepted persistent iteration (\d+)", resumed.output, re.M)
    if accepted != [str(expected)]:
        raise Failed(f"the resume accepted {accepted or 'nothing'}, expected persistent iteration "
                     f"{expected}; log tail: {resumed.tail(300)}")
    compared, differ = compare_losses(losses(resumed.output), killed, [i for i in killed if i > expected])
    if not compared or differ:
        raise Failed("the resumed losses are not the killed run's: "
                     f"{'; '.join(differ[:3]) or 'none to compare'}", compared=len(compared))
    if not extra_states:
        raise Failed(f"iteration {expected} holds no _extra_state: Transformer Engine's was not saved")
    median = _steady_ms(resumed.output, expected + p.log_interval)
    return ({"iterations": p.te_iters, "resumed_from": expected, "iterations_compared": len(compared),
             "extra_state_items": extra_states, "iteration_ms_median": round(median, 3)},
            f"--transformer-impl transformer_engine: killed after the save of {expected}, resumed: "
            f"{len(compared)} logged iterations exact, {extra_states} _extra_state items loaded")


def _extra_state_items(path) -> int:
    """How many of a torch_dist checkpoint's items are layers' `_extra_state` (from DCP's .metadata: the
    check's own checkpoint, read here in the check's process)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    return sum("_extra_state" in key for key in metadata.state_dict_metadata)
