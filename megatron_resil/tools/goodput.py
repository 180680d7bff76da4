"""Where a run's wall time went, and how often to save at scale: reads `<save>/events.jsonl`.

    python -m megatron_resil.tools.goodput <save-dir-or-events.jsonl> [--mtbf-hours H] [--nodes N]
        [--gpus-per-node 8] [--local-coverage 0.9] [--save-secs-local S] [--save-secs-global S]
        [--restart-secs S] [--out PNG]

1. Accounting, per attempt (attempts as in tools/timeline.py) and in total:
   - restart and load: for an attempt with a `restart_phases` record
     (megatron_resil/resilience/restart_phases.py),
     from the fault (the previous attempt's last event if the fault came later) to the end of the
     attempt's first iteration, split into phases: detection, teardown, spawn, imports, rendezvous,
     model, checkpoint choice, load, data, first iteration; reported per attempt, in total and as the
     median over the restarts, with each phase's share. Without one (older logs, an attempt that never
     trained): the gap since the previous attempt's last event plus the attempt's own set-up up to its
     last load decision before training;
   - saving: the blocking part of each save (`save_published` seconds of a synchronous save; an async
     save's `blocking_seconds`: preparing, staging and finalising it, or waiting for its worker; its
     write overlaps training and is not charged);
   - lost work: iterations trained again after a resume (timeline's "recomputed"), times the median
     iteration time (from consecutive `progress` events with no save between them); the first of them
     is the first iteration, already charged to the restart where its phases are known;
   - useful training: the rest. Goodput = useful / total wall time.
2. Planning, from the measured save costs C_local and C_global, the restart cost R (the median restart
   and load of attempts after the first; the first attempt's set-up if the log has no restart), and a
   failure rate: each node fails every --mtbf-hours on average, so a job of N nodes every M = MTBF/N.
   A failure is recovered from the local tier with probability p (--local-coverage: a lost node whose
   replicas survive) and from the global tier otherwise. With a local save every tau_l and a global
   one every tau_g, the fraction of time lost is, to first order (Young's argument, for two tiers):
       C_l/tau_l + C_g/tau_g + (p (tau_l/2 + R) + (1-p) (tau_g/2 + R)) / M
   minimised at tau_l = sqrt(2 C_l M / p) and tau_g = sqrt(2 C_g M / (1-p)); with no local tier, Young's
   tau = sqrt(2 C M). The optimum and the goodput it gives are reported for this run's size and for
   1k, 4k and 16k GPUs, keeping the per-rank save and restart costs (distributed checkpointing writes
   each rank's share in parallel; restart at scale is usually slower: give --restart-secs).
   The model is checked against a brute-force simulation in tests/test_goodput.py.
A PNG of projected goodput against the global save interval, per scale, goes to goodput.png beside the
event log (or --out). Exit codes: 0 done, 2 no usable event log at that path.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import dataclass

from megatron_resil.resilience.restart_phases import EVENT as RESTART_PHASES
from megatron_resil.resilience.restart_phases import PHASES
from megatron_resil.tools import timeline as tl

# Llama 3's pretraining saw 419 unexpected interruptions in 54 days on 16,384 GPUs (2,048 nodes of 8):
# one per 3.1 hours for the job, about 6,300 hours per node. An assumption until a cluster's own figure
# is given with --mtbf-hours.
DEFAULT_MTBF_HOURS_PER_NODE = 6300.0
SCALES_GPUS = (1024, 4096, 16384)
LOCAL_TIERS = ("local",)
GLOBAL_TIERS = ("persistent",)
PHASE_HEADERS = ("detect", "teardown", "spawn", "imports", "rendezvous", "model", "choice", "load", "data",
                 "1st iter")


@dataclass
class AttemptTime:
    number: int
    wall_s: float = 0.0  # the gap before it plus its own span
    restart_load_s: float = 0.0
    saving_s: float = 0.0
    lost_s: float = 0.0
    phases: dict[str, float | None] | None = None  # its restart_phases record's split, if it has one
    kind: str = ""  # that record's kind: start-up, in-job restart, new job step, ...

    @property
    def useful_s(self) -> float:
        return max(0.0, self.wall_s - self.restart_load_s - self.saving_s - self.lost_s)


@dataclass
class Measured:
    attempts: list[AttemptTime]
    iteration_s: float | None
    save_s: dict  # tier -> median blocking seconds
    restart_s: float | None
    restart_from: str
    world_size: int | None

    @property
    def total(self) -> AttemptTime:
        total = AttemptTime(0)
        for a in self.attempts:
            total.wall_s += a.wall_s
            total.restart_load_s += a.restart_load_s
            total.saving_s += a.saving_s
            total.lost_s += a.lost_s
        return total


def _blocking_save_s(event: dict) -> float:
    """A synchronous save blocks for all its `seconds`; an async one for its `blocking_seconds` (logs
    written before that field existed: 0)."""
    if event.get("asynchronous"):
        return float(event.get("blocking_seconds") or 0.0)
    return float(event.get("seconds") or 0.0)


def iteration_time(events: list[dict]) -> float | None:
    per_iteration, previous = [], None
    for event in events:
        if event["event"] in ("save_started", "save_published", "start", "loaded"):
            previous = None  # a save, or a new attempt, in between: not an iteration's time
        elif event["event"] == "progress" and isinstance(event.get("iteration"), int):
            if previous is not None and event["iteration"] > previous["iteration"]:
                span = event["iteration"] - previous["iteration"]
                per_iteration.append((event["unix"] - previous["unix"]) / span)
            previous = event
    return statistics.median(per_iteration) if per_iteration else None


def _training_starts(attempt: tl.Attempt) -> float:
    """When the attempt's set-up and load ended: its last load decision before it trained."""
    mark = attempt.events[0]["unix"]
    for event in attempt.events:
        if tl.milestone(event) is not None:
            break
        if event["event"] in ("load", "loaded", "replica"):
            mark = event["unix"]
    return mark


def _phases_record(attempt: tl.Attempt) -> dict | None:
    """The attempt's `restart_phases` record, if it has a usable one."""
    record = next((e for e in attempt.events if e["event"] == RESTART_PHASES), {})
    marks = record.get("marks")
    if not isinstance(record.get("phases"), dict) or not isinstance(marks, dict):
        return None
    usable = all(isinstance(marks.get(key), (int, float)) for key in ("start", "first_iteration"))
    return record if usable else None


def measure(events: list[dict], skipped: int = 0) -> Measured:
    line = tl.analyse(events, skipped)
    per_iteration = iteration_time(events)
    attempts, restarts, previous_end = [], [], None
    for attempt in line.attempts:
        begin, end = attempt.events[0]["unix"], attempt.events[-1]["unix"]
        gap = max(0.0, begin - previous_end) if previous_end is not None else 0.0
        timing = AttemptTime(attempt.number, wall_s=gap + (end - begin),
                             saving_s=sum(_blocking_save_s(e) for e in attempt.events
                                          if e["event"] == "save_published"))
        recomputed = attempt.recomputed
        if (record := _phases_record(attempt)) is not None:
            # From the fault to the first iteration, within this attempt's share of the wall time: the
            # time from the previous attempt's last event to a later fault was training, not restarting.
            floor = begin - gap
            first = min(max(record["marks"]["first_iteration"], floor), end)
            timing.restart_load_s = first - min(max(record["marks"]["start"], floor), first)
            timing.phases, timing.kind = record["phases"], str(record.get("kind", ""))
            recomputed = max(0, recomputed - 1)
        else:
            timing.restart_load_s = gap + max(0.0, _training_starts(attempt) - begin)
        timing.lost_s = recomputed * (per_iteration or 0.0)
        attempts.append(timing)
        if previous_end is not None:
            restarts.append(timing.restart_load_s)
        previous_end = end
    saves: dict[str, list[float]] = {}
    for event in events:
        if event["event"] == "save_published":
            saves.setdefault(event.get("tier", "persistent"), []).append(_blocking_save_s(event))
    if restarts:
        restart, source = statistics.median(restarts), f"median of {len(restarts)} measured restart(s)"
    elif attempts:
        restart, source = attempts[0].restart_load_s, "the first attempt's set-up (no restart in the log)"
    else:
        restart, source = None, "none"
    world = next((e.get("world_size") for e in events if e["event"] == "start"), None)
    return Measured(attempts, per_iteration, {tier: statistics.median(s) for tier, s in saves.items()},
                    restart, source, world)


@dataclass
class PhaseSplit:
    """The restarts' phases (attempts after the first that recorded them): per phase, the total and the
    median over those restarts (None where no restart measured it apart), and the share of the total."""
    restarts: int
    total: dict[str, float]
    median: dict[str, float | None]

    @property
    def seconds(self) -> float:
        return sum(self.total.values())

    def share(self, phase: str) -> float:
        return self.total[phase] / self.seconds if self.seconds > 0 else 0.0

    @property
    def largest(self) -> str:
        return max(PHASES, key=lambda phase: self.total[phase])


def phase_split(measured: Measured) -> PhaseSplit | None:
    rows = [a.phases for a in measured.attempts if a.number > 1 and a.phases is not None]
    if not rows:
        return None
    measured_apart = {p: [r[p] for r in rows if isinstance(r.get(p), (int, float))] for p in PHASES}
    return PhaseSplit(len(rows), {p: float(sum(v)) for p, v in measured_apart.items()},
                      {p: statistics.median(v) if v else None for p, v in measured_apart.items()})


def phase_report(measured: Measured) -> list[str]:
    attempts = [a for a in measured.attempts if a.phases is not None]
    if not attempts:
        return []

    def cells(values) -> str:
        return " ".join(f"{'-' if v is None else f'{v:.1f}':>{len(h)}}" for v, h in zip(values, PHASE_HEADERS,
                                                                                       strict=True))

    out = ["restart phases (seconds from the fault, or the last event after it, to the first iteration; "
           "-: not measured apart, in the phase before it)",
           f"{'attempt':>8} {'kind':<18} {' '.join(PHASE_HEADERS)} {'total':>7}"]
    for a in attempts:
        values = [a.phases.get(p) for p in PHASES]
        note = "  (not in the totals)" if a.number == 1 else ""
        total = sum(v for v in values if isinstance(v, (int, float)))
        out.append(f"{a.number:>8} {a.kind[:18]:<18} {cells(values)} {total:>7.1f}{note}")
    split = phase_split(measured)
    if split is None:
        return out
    out.append(f"{'total':>8} {f'{split.restarts} restart(s)':<18} {cells(split.total.values())} "
               f"{split.seconds:>7.1f}")
    out.append(f"{'median':>8} {'':<18} {cells(split.median.values())}")
    shares = " ".join(f"{f'{100 * split.share(p):.0f}%':>{len(h)}}" for p, h in zip(PHASES, PHASE_HEADERS,
                                                                                  strict=True))
    out.append(f"{'share':>8} {'':<18} {shares}")
    out.append(f"most of the restarts' time: {split.largest} ({100 * split.share(split.largest):.0f}% of "
               f"{_hours(split.seconds)})")
    return out


# ---- the plan ----------------------------------------------------------------------------------

@dataclass
class Plan:
    nodes: int
    mtbf_s: float  # of the whole job
    local_interval_s: float | None
    global_interval_s: float
    goodput: float  # projected, 0..1


def lost_fraction(local_interval_s: float | None, global_interval_s: float, save_local_s: float | None,
                  save_global_s: float, restart_s: float, mtbf_s: float, coverage: float) -> float:
    """First-order fraction of wall time not spent on useful training (see the module's docstring)."""
    if local_interval_s is None or save_local_s is None:
        return save_global_s / global_interval_s + (global_interval_s / 2 + restart_s) / mtbf_s
    return (save_local_s / local_interval_s + save_global_s / global_interval_s
            + (coverage * (local_interval_s / 2 + restart_s)
               + (1 - coverage) * (global_interval_s / 2 + restart_s)) / mtbf_s)


def optimal_plan(nodes: int, mtbf_hours_per_node: float, save_local_s: float | None, save_global_s: float,
                 restart_s: float, coverage: float) -> Plan:
    mtbf_s = mtbf_hours_per_node * 3600.0 / max(1, nodes)
    if save_local_s is None or coverage <= 0:
        local, global_ = None, math.sqrt(2 * save_global_s * mtbf_s)
    else:
        local = math.sqrt(2 * save_local_s * mtbf_s / coverage)
        global_ = math.sqrt(2 * save_global_s * mtbf_s / (1 - coverage)) if coverage < 1 else math.inf
    lost = lost_fraction(local, global_, save_local_s if local else None, save_global_s, restart_s, mtbf_s,
                         coverage) if math.isfinite(global_) else \
        save_local_s / local + (local / 2 + restart_s) / mtbf_s
    return Plan(nodes, mtbf_s, local, global_, max(0.0, 1.0 - lost))


def _hours(seconds: float) -> str:
    return tl.duration(seconds)


def report(measured: Measured, source: str, args) -> str:
    out = [f"goodput of {source}"]
    out.append(f"{'attempt':>8} {'wall':>10} {'useful':>10} {'saving':>10} {'lost work':>10} "
               f"{'restart+load':>13}")
    for a in [*measured.attempts, measured.total]:
        name = str(a.number) if a.number else "total"
        out.append(f"{name:>8} {_hours(a.wall_s):>10} {_hours(a.useful_s):>10} {_hours(a.saving_s):>10} "
                   f"{_hours(a.lost_s):>10} {_hours(a.restart_load_s):>13}")
    total = measured.total
    share = (lambda s: f"{100 * s / total.wall_s:.1f}%") if total.wall_s > 0 else (lambda s: "-")
    out.append(f"goodput: {share(total.useful_s)} (saving {share(total.saving_s)}, lost work "
               f"{share(total.lost_s)}, restart and load {share(total.restart_load_s)})")
    out += phase_report(measured)
    it = f"{measured.iteration_s:.3f} s" if measured.iteration_s else "unknown"
    saves = ", ".join(f"{tier} {s:.2f} s" for tier, s in sorted(measured.save_s.items())) or "none measured"
    restart = _hours(measured.restart_s) if measured.restart_s is not None else "-"
    out.append(f"measured: iteration {it}; blocking save {saves}; restart and load {restart} "
               f"({measured.restart_from})")
    inputs = plan_inputs(measured, args)
    if inputs is None:
        out.append("plan: no save cost known (no synchronous persistent save in the log; "
                   "give --save-secs-global)")
        return "\n".join(out)
    local_s, global_s, restart_s = inputs
    out.append(f"plan inputs: save local {local_s if local_s is not None else '-'} s, global {global_s} s, "
               f"restart {restart_s:.1f} s, node MTBF {args.mtbf_hours:g} h "
               f"({'given' if args.mtbf_given else 'assumed: Llama 3 pretraining'}), local coverage "
               f"{args.local_coverage:g}")
    out.append(f"{'GPUs':>7} {'nodes':>6} {'job MTBF':>10} {'local every':>12} {'global every':>13} "
               f"{'goodput':>8}")
    for gpus, nodes in scales(measured, args):
        plan = optimal_plan(nodes, args.mtbf_hours, local_s, global_s, restart_s, args.local_coverage)
        local = _interval(plan.local_interval_s, measured.iteration_s)
        global_ = _interval(plan.global_interval_s, measured.iteration_s)
        out.append(f"{gpus:>7} {nodes:>6} {_hours(plan.mtbf_s):>10} {local:>12} {global_:>13} "
                   f"{100 * plan.goodput:>7.1f}%")
    return "\n".join(out)


def _interval(seconds: float | None, iteration_s: float | None) -> str:
    if seconds is None:
        return "-"
    if not math.isfinite(seconds):
        return "never"
    its = f" ({max(1, round(seconds / iteration_s))} it)" if iteration_s else ""
    return f"{_hours(seconds)}{its}"


def plan_inputs(measured: Measured, args) -> tuple[float | None, float, float] | None:
    global_s = args.save_secs_global if args.save_secs_global is not None else \
        next((measured.save_s[t] for t in GLOBAL_TIERS if t in measured.save_s), None)
    if global_s is None:
        return None
    local_s = args.save_secs_local if args.save_secs_local is not None else \
        next((measured.save_s[t] for t in LOCAL_TIERS if t in measured.save_s), None)
    restart_s = args.restart_secs if args.restart_secs is not None else (measured.restart_s or 0.0)
    return local_s, global_s, restart_s


def scales(measured: Measured, args) -> list[tuple[int, int]]:
    this_run = args.nodes or max(1, math.ceil((measured.world_size or 1) / args.gpus_per_node))
    rows = [(this_run * args.gpus_per_node, this_run)]
    rows += [(gpus, gpus // args.gpus_per_node) for gpus in SCALES_GPUS]
    return rows


def draw(measured: Measured, args, out_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    local_s, global_s, restart_s = plan_inputs(measured, args)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for gpus, nodes in scales(measured, args):
        plan = optimal_plan(nodes, args.mtbf_hours, local_s, global_s, restart_s, args.local_coverage)
        if not math.isfinite(plan.global_interval_s):
            continue
        xs = [plan.global_interval_s * 2 ** (k / 8) for k in range(-24, 25)]
        ys = [100 * max(0.0, 1 - lost_fraction(plan.local_interval_s, x, local_s, global_s, restart_s,
                                               plan.mtbf_s, args.local_coverage)) for x in xs]
        line, = ax.plot([x / 60 for x in xs], ys, label=f"{gpus} GPUs (job MTBF {_hours(plan.mtbf_s)})")
        ax.plot([plan.global_interval_s / 60], [100 * plan.goodput], "o", color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("global save interval (minutes), local interval at its optimum")
    ax.set_ylabel("projected goodput (%)")
    ax.set_title("goodput against the global save interval (dots: the optimum)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_resil.tools.goodput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="a --save directory or its events.jsonl")
    parser.add_argument("--mtbf-hours", type=float, default=None,
                        help="mean time between failures of one node (default "
                             f"{DEFAULT_MTBF_HOURS_PER_NODE:g}, from Llama 3's pretraining)")
    parser.add_argument("--nodes", type=int, default=None, help="nodes of this run (default: from the log)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--local-coverage", type=float, default=0.9,
                        help="fraction of failures the local tier recovers from (default 0.9)")
    parser.add_argument("--save-secs-local", type=float, default=None)
    parser.add_argument("--save-secs-global", type=float, default=None)
    parser.add_argument("--restart-secs", type=float, default=None)
    parser.add_argument("--out", default=None, help="the PNG (default: goodput.png beside the event log)")
    parser.add_argument("--no-png", action="store_true")
    args = parser.parse_args(argv)
    if not 0 <= args.local_coverage <= 1:
        parser.error("--local-coverage: give a fraction between 0 and 1")
    if args.gpus_per_node < 1 or (args.nodes is not None and args.nodes < 1):
        parser.error("--nodes and --gpus-per-node: give positive numbers")
    args.mtbf_given = args.mtbf_hours is not None
    if args.mtbf_hours is None:
        args.mtbf_hours = DEFAULT_MTBF_HOURS_PER_NODE
    elif args.mtbf_hours <= 0:
        parser.error("--mtbf-hours: give a positive number of hours")
    path, directory = tl.locate(args.target)
    if not os.path.isfile(path):
        print(f"goodput: no event log at {path}; give a --save directory of a run or its "
              f"{tl.EVENT_LOG_NAME}", file=sys.stderr)
        return 2
    events, skipped = tl.read_events(path)
    if not events:
        print(f"goodput: no readable event in {path}", file=sys.stderr)
        return 2
    measured = measure(events, skipped)
    print(report(measured, path, args))
    if not args.no_png and plan_inputs(measured, args) is not None:
        out = args.out or os.path.join(directory, "goodput.png")
        try:
            draw(measured, args, out)
            print(f"picture: {out}")
        except Exception as err:  # noqa: BLE001 - the figures above stand without the picture
            print(f"picture not drawn ({type(err).__name__}: {err})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
