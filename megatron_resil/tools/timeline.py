"""The picture an operator opens after a bad night: a run's iterations against wall time, across every
attempt (restarts, requeues, in-job reloads), with saves, loads, quarantines, faults and exits marked,
and a short summary of what the failures cost. Reads `<save>/events.jsonl`; writes only the PNG.

    python -m megatron_resil.tools.timeline <save-dir-or-events.jsonl> [--out PNG] [--summary-only]

The PNG goes to `timeline.png` beside the event log unless --out says otherwise. Unparsable lines (a
torn last line) are skipped and counted. Exit codes: 0 done, 2 no event log at that path (or no
readable event in it).

What the summary counts:
- attempt: the events from one `start` event up to the next (a job, a requeue, a launcher restart);
  events before the first `start` form an attempt of their own. Restarts: attempts after the first.
- reached: iterations the run trained up to, from `progress`, `save_started`, `finished` and `exit`.
- resume: a `loaded` event (an attempt's load, or an in-job reload after a canary trip), a same-step
  recovery (a `recovery` record naming its iteration and receivers: the survivors' state, nothing read),
  or the start of an attempt that did neither (iteration 0).
- iterations recomputed at a resume from iteration L: min(R, H) - L (at least 0), R the highest
  iteration reached before the resume and H the highest reached after it, before the next resume:
  the iterations actually trained again.
- wall time lost: for each interruption, the time from the last event that reached a new highest
  iteration before a resume to the first event after it that went beyond that iteration. It holds the
  failure, the wait for and start-up of the next attempt, the load and the recomputation, and also the
  ordinary training time of the iterations in between (up to one --log-interval), which is not
  subtracted. A planned stop and requeue counts too. Charged to the attempt that got past it; an
  attempt that never did leaves its time to the next one; time after the last new iteration of the log
  is not counted.
- restart phases: each attempt's `restart_phases` record (megatron_resil/resilience/restart_phases.py), from
  the fault to its first iteration; the summary sums them over the restarts, and the picture draws them as
  stacked segments in a band along the bottom, one color per phase (tools/goodput.py tabulates them).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from megatron_resil.events import EVENT_LOG_NAME
from megatron_resil.resilience.restart_phases import BOUNDARIES, PHASES
from megatron_resil.resilience.restart_phases import EVENT as RESTART_PHASES

MILESTONES = {"progress", "save_started", "finished", "exit"}
# Events the summary reports on its own lines; any other name (decisions like cleanup, and events
# added later such as straggler) is listed under "other events".
SUMMARISED = MILESTONES | {"start", "loaded", "load", "save_published", "save", "fault_injected",
                           "quarantine", "canary", "restart", RESTART_PHASES}
MARKS = {  # event, or event:tier / event:verdict -> (legend entry, marker, color)
    "save_published:persistent": ("saved (persistent)", "o", "tab:blue"),
    "save_published:non-persistent": ("saved (non-persistent)", "o", "tab:cyan"),
    "save_published:local": ("saved (local)", "o", "tab:olive"), "save": ("save failed", "d", "tab:red"),
    "load:accepted": ("load accepted", "^", "tab:green"), "load:rejected": ("load rejected", "v", "tab:red"),
    "quarantine": ("quarantine", "X", "darkred"), "canary": ("canary trip", "*", "magenta"),
    "fault_injected": ("fault injected", "P", "black"), "signal": ("signal", "D", "tab:orange"),
    "exit": ("exit", "s", "tab:red"), "finished": ("finished", "*", "tab:green"),
    "hang": ("hang / straggler", "h", "tab:brown"), "straggler": ("hang / straggler", "h", "tab:brown"),
    "died": ("died (no end event)", "x", "black"),
}
VERTICAL_LINES = {"start": ("gray", "--", "attempt start"),  # event -> (color, style, legend entry)
                  "restart": ("tab:purple", ":", "launcher restart")}
NOT_MARKED = SUMMARISED | {"cleanup", "retention", "replica", "tracker"}  # lines, or no news at a glance


@dataclass
class Attempt:
    number: int
    events: list[dict]
    loaded: str = "from scratch"
    reached: int = 0
    ending: str = "no end event (killed or lost)"
    recomputed: int = 0
    lost_s: float = 0.0


@dataclass
class Timeline:
    events: list[dict]
    skipped_lines: int
    attempts: list[Attempt] = field(default_factory=list)
    lost_spans: list[tuple[float, float]] = field(default_factory=list)  # unix (from, to)

    @property
    def recomputed(self) -> int:
        return sum(a.recomputed for a in self.attempts)

    @property
    def lost_s(self) -> float:
        return sum(a.lost_s for a in self.attempts)

    @property
    def first_unix(self) -> float:  # hosts' clocks may differ a little: not necessarily the first line
        return min(e["unix"] for e in self.events)

    @property
    def wall_s(self) -> float:
        return max(e["unix"] for e in self.events) - self.first_unix

    def count(self, name: str, **match) -> int:
        return sum(1 for e in self.events
                   if e["event"] == name and all(e.get(k) == v for k, v in match.items()))


def read_events(path: str) -> tuple[list[dict], int]:
    """Events in file (append) order, each tagged with its position; and how many lines were unusable."""
    events, skipped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if not isinstance(event, dict) or not isinstance(event.get("event"), str) or \
                    not isinstance(event.get("unix"), (int, float)):
                skipped += 1
                continue
            event["_seq"] = len(events)
            events.append(event)
    return events, skipped


def milestone(event: dict) -> int | None:
    """The iteration this event shows the run had trained up to, if it shows one."""
    iteration = event.get("iteration")
    return iteration if event["event"] in MILESTONES and isinstance(iteration, int) else None


def split_attempts(events: list[dict]) -> list[Attempt]:
    attempts: list[Attempt] = []
    for event in events:
        if event["event"] == "start" or not attempts:
            attempts.append(Attempt(len(attempts) + 1, []))
        event["_attempt"] = attempts[-1].number
        attempts[-1].events.append(event)
    return attempts


def resumes(attempt: Attempt) -> list[tuple[int, int]]:
    """(position, iteration) of each point this attempt resumed training from."""
    loads = [(e["_seq"], e["iteration"]) for e in attempt.events
             if isinstance(e.get("iteration"), int) and (e["event"] == "loaded" or _same_step(e))]
    return loads or [(attempt.events[0]["_seq"], 0)]


def _same_step(event: dict) -> bool:
    """A same-step recovery's record (replica_recovery.py): training went on from the iteration it names."""
    return event["event"] == "recovery" and isinstance(event.get("receivers"), list)


def describe_attempt(attempt: Attempt) -> None:
    loaded = [e for e in attempt.events if e["event"] == "loaded" or _same_step(e)]
    if loaded:
        attempt.loaded = ", then ".join(
            f"{e.get('tier')}@{e.get('iteration')}" if e["event"] == "loaded"
            else f"same-step@{e.get('iteration')} (from replicas)" for e in loaded)
    elif not any(milestone(e) is not None or (e["event"] == "load" and "verdict" not in e)
                 for e in attempt.events):  # neither trained nor decided to start from scratch
        attempt.loaded = "nothing loaded"
    attempt.reached = max((m for e in attempt.events if (m := milestone(e)) is not None),
                          default=resumes(attempt)[-1][1])
    for event in reversed(attempt.events):
        if event["event"] == "finished":
            attempt.ending = "finished"
            break
        if event["event"] == "exit":
            attempt.ending = f"exit {event.get('exit_code', '?')}"
            break


def charge_recomputation(events: list[dict], attempts: list[Attempt]) -> None:
    points = sorted(((seq, iteration, a) for a in attempts for seq, iteration in resumes(a)),
                    key=lambda point: point[0])
    reached = [milestone(e) for e in events]
    highest = max((m for m in reached[:points[0][0]] if m is not None), default=0)
    bounds = [seq for seq, _, _ in points[1:]] + [len(events)]
    for (seq, loaded, attempt), end in zip(points, bounds, strict=True):  # one pass: logs can be long
        after = max((m for m in reached[seq:end] if m is not None), default=None)
        attempt.recomputed += max(0, min(highest, loaded if after is None else after) - loaded)
        highest = max(highest, after or 0)


def charge_lost_time(events: list[dict], attempts: list[Attempt]) -> list[tuple[float, float]]:
    """Charges each interruption's lost time to the attempt that got past it; returns the spans."""
    resume_seqs = sorted(seq for a in attempts for seq, _ in resumes(a))
    frontier, best = [], -1  # events that reached a new highest iteration
    for event in events:
        if (m := milestone(event)) is not None and m > best:
            frontier.append(event)
            best = m
    spans = []
    for last, back in zip(frontier, frontier[1:], strict=False):
        after_last = bisect.bisect_right(resume_seqs, last["_seq"])
        if after_last < len(resume_seqs) and resume_seqs[after_last] < back["_seq"]:  # resumed in between
            attempts[back["_attempt"] - 1].lost_s += back["unix"] - last["unix"]
            spans.append((last["unix"], back["unix"]))
    return spans


def analyse(events: list[dict], skipped_lines: int) -> Timeline:
    timeline = Timeline(events, skipped_lines, split_attempts(events))
    for attempt in timeline.attempts:
        describe_attempt(attempt)
    charge_recomputation(events, timeline.attempts)
    timeline.lost_spans = charge_lost_time(events, timeline.attempts)
    return timeline


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def summary(timeline: Timeline, source: str) -> str:
    t, attempts = timeline, timeline.attempts
    lines = [f"timeline of {source}: {len(t.events)} events"
             + (f", {t.skipped_lines} unreadable line(s) skipped" if t.skipped_lines else ""),
             f"attempts: {len(attempts)} ({len(attempts) - 1} restart(s)"
             + (f"; {t.count('restart')} launcher restart event(s)" if t.count("restart") else "") + ");"
             f" total wall time {duration(t.wall_s)}; highest iteration {max(a.reached for a in attempts)}"]
    for a in attempts:
        first = a.events[0]
        lines.append(f"  #{a.number} {first.get('time', first['unix'])}  loaded: {a.loaded};"
                     f" reached {a.reached}; ended: {a.ending}"
                     + (f"; recomputed {a.recomputed}, lost {duration(a.lost_s)}" if a.number > 1 else ""))
    tiers = Counter(str(e.get("tier")) for e in t.events if e["event"] == "save_published")
    faults = [f"{e.get('kind')}@{e.get('iteration')}" for e in t.events if e["event"] == "fault_injected"]
    others = Counter(e["event"] for e in t.events if e["event"] not in SUMMARISED)
    lines += restart_phase_lines(t)
    lines += [f"iterations recomputed: {t.recomputed}; wall time lost: {duration(t.lost_s)}",
              "saves published: " + (", ".join(f"{tier} {n}" for tier, n in sorted(tiers.items())) or "none")
              + f"; save failures: {t.count('save')}",
              f"load rejections: {t.count('load', verdict='rejected')}; quarantines: {t.count('quarantine')};"
              f" canary trips: {t.count('canary')}; faults injected: {', '.join(faults) or 'none'}",
              "other events: " + (", ".join(f"{name} {n}" for name, n in sorted(others.items())) or "none")]
    return "\n".join(lines)


def phase_segments(timeline: Timeline) -> list[tuple[str, float, float, int]]:
    """(phase, unix start, seconds, attempt) of every measured phase in the log's `restart_phases` records."""
    segments = []
    for attempt in timeline.attempts:
        record = next((e for e in attempt.events if e["event"] == RESTART_PHASES), None)
        marks, phases = (record or {}).get("marks"), (record or {}).get("phases")
        if not isinstance(marks, dict) or not isinstance(phases, dict):
            continue
        for phase, boundary in zip(PHASES, BOUNDARIES, strict=False):  # a phase starts at its boundary
            seconds, begin = phases.get(phase), marks.get(boundary)
            if isinstance(seconds, (int, float)) and isinstance(begin, (int, float)):
                segments.append((phase, float(begin), float(seconds), attempt.number))
    return segments


def restart_phase_lines(timeline: Timeline) -> list[str]:
    totals: Counter = Counter()
    restarts = set()
    for phase, _, seconds, number in phase_segments(timeline):
        if number > 1:  # the first attempt's is its start-up
            totals[phase] += seconds
            restarts.add(number)
    if not restarts:
        return []
    whole = sum(totals.values()) or 1.0
    parts = ", ".join(f"{phase} {duration(secs)} ({100 * secs / whole:.0f}%)"
                      for phase, secs in totals.most_common())
    return [f"restart phases over {len(restarts)} restart(s), fault to first iteration: {parts}"]


def mark_of(event: dict) -> tuple[str, str, str] | None:
    """(legend entry, marker, color) of an event's mark; None for events drawn otherwise or not at all."""
    name = event["event"]
    if name in ("save_published", "load"):
        qualifier = event.get("tier") if name == "save_published" else event.get("verdict")
        return MARKS.get(f"{name}:{qualifier}", (f"{name} ({qualifier})", "o", "gray"))
    return MARKS.get(name) or (None if name in NOT_MARKED else (f"other: {name}", "|", "gray"))


def label(event: dict) -> str:
    name = event["event"]
    if name == "exit":
        return f"exit {event.get('exit_code', '?')}"
    if name == "fault_injected":
        return f"{event.get('kind')} before {event.get('iteration')}"
    return str(event.get("tier", "")) if name == "load" and event.get("verdict") == "accepted" else ""


class _Canvas:
    """One axes; marks gathered by kind and drawn once per kind (a long run has thousands of saves);
    a legend with one entry per kind, attempts first."""

    def __init__(self, timeline: Timeline) -> None:
        from matplotlib.figure import Figure  # no pyplot: no display and no global state needed

        self.t0, wall = timeline.first_unix, timeline.wall_s
        self.scale, self.unit = (1.0, "s") if wall < 120 else (60.0, "min") if wall < 7200 else (3600.0, "h")
        self.fig = Figure(figsize=(13, 6.5), layout="constrained")
        self.ax = self.fig.add_subplot()
        self.marks: dict[tuple[str, str, str], tuple[list[float], list[int]]] = {}

    def x(self, unix: float) -> float:
        return (unix - self.t0) / self.scale

    def mark(self, style: tuple[str, str, str], unix: float, iteration: int, text: str = "") -> None:
        xs, ys = self.marks.setdefault(style, ([], []))
        xs.append(self.x(unix))
        ys.append(iteration)
        if text:
            self.ax.annotate(text, (xs[-1], iteration), xytext=(4, 4), textcoords="offset points", fontsize=7)

    def finish(self) -> None:
        for (name, marker, color), (xs, ys) in self.marks.items():
            size = 60 if len(xs) <= 100 else 15  # thousands of saves must not hide the line
            above = 3 if name.startswith("saved") else 4  # an exit at a save's iteration stays visible
            self.ax.scatter(xs, ys, marker=marker, color=color, s=size, zorder=above, label=name)
        handles, names = self.ax.get_legend_handles_labels()
        pairs = sorted(zip(names, handles, strict=True), key=lambda pair: not pair[0].startswith("progress"))
        entries = dict(pairs)  # one entry per name, progress lines first
        self.ax.legend(entries.values(), entries.keys(), loc="upper left", bbox_to_anchor=(1.01, 1.0),
                       fontsize=8)


def draw_attempt(canvas: _Canvas, attempt: Attempt, many: bool) -> None:
    """The attempt's iteration over time from each resume point on (flat through saves, down at an
    in-job reload), and a mark for each thing that happened."""
    color = f"C{(attempt.number - 1) % 10}"
    name = "progress, one color per attempt" if many else f"progress, attempt {attempt.number}"
    starts = dict(resumes(attempt))
    xs: list[float] = []
    ys: list[int] = []
    current = None  # no line before the first resume; marks there sit at the iteration it resumes from
    for e in attempt.events:
        if e["_seq"] in starts:
            if xs:
                canvas.ax.plot(xs, ys, color=color, lw=1.8, label=name)
            xs, ys, current = [], [], starts[e["_seq"]]
        current = m if (m := milestone(e)) is not None else current
        at = next(iter(starts.values())) if current is None else current
        if current is not None:
            xs.append(canvas.x(e["unix"]))
            ys.append(current)
        if e["event"] in VERTICAL_LINES and e["_seq"] > 0:
            color_, style, entry = VERTICAL_LINES[e["event"]]
            canvas.ax.axvline(canvas.x(e["unix"]), color=color_, ls=style, lw=1, label=entry)
        elif (style := mark_of(e)) is not None:
            own = e.get("iteration") if e["event"] != "fault_injected" else None  # strikes before it
            canvas.mark(style, e["unix"], own if isinstance(own, int) else at, label(e))
    canvas.ax.plot(xs, ys, color=color, lw=1.8, label=name)
    if attempt.ending.startswith("no end"):
        canvas.mark(MARKS["died"], attempt.events[-1]["unix"], at)


def draw_phases(canvas: _Canvas, segments: list[tuple[str, float, float, int]]) -> None:
    """Each restart's phases as stacked segments in a band along the bottom of the axes, a color a phase."""
    from matplotlib import colormaps

    if not segments:
        return
    canvas.ax.set_ymargin(0.1)  # iteration 0 and its marks clear of the band (at most 5% of the height)
    colors = colormaps["tab20"]
    for index, phase in enumerate(PHASES):
        spans = [(canvas.x(begin), seconds / canvas.scale) for name, begin, seconds, _ in segments
                 if name == phase and seconds > 0]
        if spans:
            canvas.ax.broken_barh(spans, (0.0, 0.05), transform=canvas.ax.get_xaxis_transform(), zorder=1.5,
                                  facecolors=colors(2 * index + 1), edgecolor=colors(2 * index),
                                  linewidth=0.5, label=f"restart phase: {phase}")


def draw(timeline: Timeline, title: str):
    """The figure: each attempt's progress, the marks, and the wall time lost shaded."""
    canvas = _Canvas(timeline)
    ax = canvas.ax
    for lost_from, lost_to in timeline.lost_spans:
        ax.axvspan(canvas.x(lost_from), canvas.x(lost_to), color="tab:red", alpha=0.08,
                   label="wall time lost")
    for attempt in timeline.attempts:
        draw_attempt(canvas, attempt, many=len(timeline.attempts) > 10)
    draw_phases(canvas, phase_segments(timeline))
    first = datetime.fromtimestamp(timeline.first_unix).astimezone().isoformat(sep=" ", timespec="seconds")
    ax.set_xlabel(f"wall time since the first event ({canvas.unit}; first event {first})")
    ax.set_ylabel("iteration")
    ax.grid(alpha=0.3)
    n = len(timeline.attempts)
    ax.set_title(f"{title}\n{n} attempt(s), {n - 1} restart(s), {timeline.recomputed} iterations recomputed, "
                 f"{duration(timeline.lost_s)} lost of {duration(timeline.wall_s)}, "
                 f"{timeline.count('save_published')} saves", fontsize=10)
    canvas.finish()
    return canvas.fig


def locate(target: str) -> tuple[str, str]:
    """(event log, run directory) for a --save directory or an events.jsonl path."""
    if os.path.isdir(target):
        return os.path.join(target, EVENT_LOG_NAME), target
    return target, os.path.dirname(target) or "."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_resil.tools.timeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="the run's --save directory, or its events.jsonl")
    parser.add_argument("--out", default=None, help="PNG to write (default: timeline.png beside the log)")
    parser.add_argument("--summary-only", action="store_true", help="print the summary, draw nothing")
    args = parser.parse_args(argv)
    log_path, run_dir = locate(args.target)
    if not os.path.isfile(log_path):
        print(f"timeline: no event log at {log_path}; give the run's --save directory or its "
              f"{EVENT_LOG_NAME}", file=sys.stderr)
        return 2
    events, skipped = read_events(log_path)
    if not events:
        print(f"timeline: {log_path} holds no readable event ({skipped} unreadable line(s))", file=sys.stderr)
        return 2
    timeline = analyse(events, skipped)
    print(summary(timeline, log_path))
    if not args.summary_only:
        out = args.out or os.path.join(run_dir, "timeline.png")
        try:
            draw(timeline, os.path.abspath(run_dir)).savefig(out, dpi=110)
        except OSError as err:
            print(f"timeline: cannot write {out} ({err.strerror}); choose another path with --out",
                  file=sys.stderr)
            return 2
        print(f"timeline picture: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
