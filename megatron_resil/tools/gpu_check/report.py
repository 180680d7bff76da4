"""What the GPU check leaves in its results folder: results.json (every step with its status, reason and
figures, the environment, the profile, the ratios) and summary.txt, the same on one screen."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from megatron_resil.tools.gpu_check.context import StepResult
from megatron_resil.tools.gpu_check.profiles import Profile


def ratios(steps: list[StepResult]) -> dict:
    by_name = {s.name: s for s in steps}
    found = {}
    step_time = by_name.get("step_time_ratio")
    if step_time is not None and step_time.status == "passed":
        f = step_time.figures
        found["step_time"] = {"value": f["ratio"], "goal": f"<= {f['goal']}", "met": f["met"]}
    stall = by_name.get("async_stall_ratio")
    if stall is not None and stall.status == "passed":
        for tier in ("persistent", "local"):
            f = stall.figures[tier]
            found[f"async_stall_{tier}"] = {"value": f["ratio"], "goal": f"<= {f['goal']}", "met": f["met"]}
    return found


def write(out: Path, mode: str, environment: dict, profile: Profile, steps: list[StepResult],
          wall_s: float) -> str:
    """Write results.json and summary.txt into `out`; returns the summary's text."""
    counts = {status: sum(s.status == status for s in steps) for status in ("passed", "failed", "skipped")}
    found_ratios = ratios(steps)
    results = {"mode": mode, "wall_s": round(wall_s, 1), "budget_s": profile.budget_s,
               "passed": counts["failed"] == 0, "counts": counts, "environment": environment,
               "profile": asdict(profile), "ratios": found_ratios, "steps": [asdict(s) for s in steps]}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = summary(mode, environment, steps, found_ratios, counts, wall_s, profile.budget_s)
    (out / "summary.txt").write_text(text)
    return text


def summary(mode: str, environment: dict, steps: list[StepResult], found_ratios: dict, counts: dict,
            wall_s: float, budget_s: float) -> str:
    device = environment.get("device") or "no GPU"
    versions = ", ".join(f"{label} {environment.get(key)}" for label, key in (
        ("Python", "python"), ("torch", "torch"), ("megatron-core", "megatron-core"),
        ("NVRx", "nvidia-resiliency-ext")))
    lines = [f"GPU check ({mode}) on {device}: {versions}",
             f"{wall_s:.0f} s of a {budget_s:.0f} s budget: {counts['passed']} passed, "
             f"{counts['failed']} failed, {counts['skipped']} skipped", ""]
    for s in steps:  # 120 columns: the whole reason is in results.json
        reason = s.reason if len(s.reason) <= 77 else s.reason[:74] + "..."
        lines.append(f"  {s.name:22s} {s.status:7s} {s.seconds:6.1f} s  {reason}")
    if found_ratios:
        lines.append("")
        for name, r in found_ratios.items():
            value = "n/a" if r["value"] is None else f"{r['value']:.3f}"
            lines.append(f"  {name:22s} {value:>8s}  goal {r['goal']:8s} {'met' if r['met'] else 'NOT met'}")
    if mode == "dry-run":
        lines.append("  (dry run on CPU: the ratios only show that the code runs; they are not measurements)")
    lines += ["", "details: results.json; every run's log: logs/"]
    return "\n".join(lines) + "\n"
