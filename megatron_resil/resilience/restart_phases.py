"""Where a restart's time goes: each attempt's way from the fault to its first iteration, split into phases
measured with wall-clock timestamps (comparable across the processes of one host), and written by rank 0
as one `restart_phases` record when the attempt has taken its first iteration.

The boundaries, in order, and where each comes from:

    start           the fault: the latest fault the run recorded since the previous attempt began (a
                    `fault_injected` event, the drill's node loss, or a strike under <save>/.injected_faults/,
                    which ranks other than 0 leave), if it is later than the previous attempt's last event;
                    otherwise that last event (an external fault, kill -9 or SIGSTOP, leaves no record: the
                    last sign of life stands for it, and detection then includes up to a --log-interval of
                    training). Never before the previous attempt's last event, so no second is counted twice.
    decision        the launcher's decision to restart: its "will restart worker group" log line (ft_launcher
                    writes it with millisecond timestamps; read from the file this rank's stderr shares with
                    its launcher, when it is a file). A new job step (a requeue) or a plain rerun has no such
                    line: not measured.
    teardown        the old ranks stopped: the launcher's next "attempts to join the next round" line; for a
                    new job step, the creation of its launcher (the old step had ended by then).
    spawned         this process's creation (/proc/self/stat against /proc/uptime: 10 ms resolution).
    imported        pretrain() entered: interpreter start-up, arguments, torch and megatron-core imported.
    process_groups  the rank monitor reached, torch.distributed's rendezvous of all ranks, megatron-core's
                    process groups built.
    engine          model, DDP, optimizer and scheduler built (the start records and tokenizer before them).
    chosen          reading of the checkpoint to be loaded begins: candidates listed and verified by then
                    (checksums, replicas, rejections, quarantines, the agreement collectives).
    loaded          the checkpoint read and restored (no checkpoint: the same as chosen).
    data            datasets and data iterators built.
    first_iteration the attempt's first training iteration taken.

A phase runs from one boundary to the next; a boundary not measured merges its two phases into the earlier
one (its own is null), so the phases always add up to first_iteration - start. Marks are clamped to never
run backwards. An attempt that is the run's first has no fault: its start is its launcher's creation (or
its own), and detection and teardown are null. An in-process restart's attempt shares its process with the
previous one: the time up to pretrain() is all detection.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import time

from megatron_resil import events, phase_marks, rank_process

PHASES = ("detection", "teardown", "spawn", "imports", "rendezvous", "model", "checkpoint_choice", "load",
          "data", "first_iteration")
BOUNDARIES = ("start", "decision", "teardown", "spawned", "imported", "process_groups", "engine", "chosen",
              "loaded", "data", "first_iteration")
EVENT = "restart_phases"
FAULTS_DIR = ".injected_faults"  # fault_injection.py's strike records

_TAIL_BYTES = 4 << 20  # of the event log and the launcher's log: enough for an attempt's set-up
# ft_launcher's own log lines, in the two formats NVRx has used. Each names its launcher differently:
# NVRx 0.4, [%(asctime)s] [%(levelname)s] [ft_launcher<pid>@<host>] ..., by its pid; NVRx 0.7 (one launcher
# per node, enforced), "%(asctime)s [%(levelname)s] [<host>] [workload:.. infra:<SLURM_PROCID or ?>(..)]
# <file>:<line> ...", optionally after a "<rank>: " prefix, by host and Slurm task.
_LAUNCHER_LINE_PID = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\] \[\w+\] \[ft_launcher(\d+)@[^\]]*\] (.*)$", re.MULTILINE)
_LAUNCHER_LINE_HOST = re.compile(
    r"^(?:\S+: )?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \[\w+\] \[([^\]]*)\] "
    r"\[workload:\S* infra:([^(\]]*)\([^)]*\)\] \S+:\d+ (.*)$", re.MULTILINE)

_attempts_in_process = 0
_inprocess_attempt = 0  # the in-process restart's attempt (a warm reserve's first may be the second)
_attempt_details: dict = {}  # what the attempt itself says of its way (same-step recovery)
_recorded = True  # nothing to record before an attempt starts


def inprocess_attempt(number: int) -> None:
    """The in-process restart's attempt `number` is about to start in this process."""
    global _inprocess_attempt
    _inprocess_attempt = number


def attempt_detail(name: str, value) -> None:
    _attempt_details[name] = value


def attempt_started() -> None:
    """pretrain() entered: a new attempt's marks begin."""
    global _attempts_in_process, _recorded
    _attempts_in_process += 1
    _attempt_details.clear()
    phase_marks.new_attempt()
    _recorded = False
    phase_marks.mark("imported")


def iteration_taken() -> None:
    """After each taken iteration; the attempt's first writes the record (rank 0)."""
    global _recorded
    if _recorded:
        return
    _recorded = True
    phase_marks.mark("first_iteration")
    if events.log_path() is None or not rank_process.is_rank0():
        return
    try:
        record = measure()
    except Exception as err:  # noqa: BLE001 - the phases are a report: never the reason a run fails
        events.warn(f"restart phases not recorded ({type(err).__name__}: {err})")
        return
    events.record(EVENT, **record)
    shown = ", ".join(f"{name} {secs:.1f} s" for name, secs in record["phases"].items() if secs is not None)
    events.print_rank_0(f"{record['kind']} took {record['seconds']:.1f} s to its first iteration: {shown}")


def measure() -> dict:
    """The record for this attempt, from its marks, the event log, /proc and the launcher's log."""
    marks = {name: None for name in BOUNDARIES} | phase_marks.attempt_marks()
    details: dict[str, float | str | None] = dict(_attempt_details)
    # The process's first attempt, and not a warm reserve's first under an in-process restart (whose time
    # since the fault is all in this process too)
    first_in_process = _attempts_in_process == 1 and _inprocess_attempt == 0
    if first_in_process:
        # the process the launcher started, not a fork of a standby
        marks["spawned"] = rank_process.started_unix(rank_process.launched_pid())
        details["interpreter"] = phase_marks.process_marks().get("interpreter")
        details["standby"] = rank_process.in_standby_worker()
        from megatron_resil import patches  # (imports nothing new: pretrain.py installed them)

        # whether that standby had megatron-core imported, with this run's patches (standby_warmup.py)
        details["megatron_core_ahead"] = patches.imported_ahead()
    under_launcher = "TORCHELASTIC_RUN_ID" in os.environ and first_in_process
    launcher = rank_process.launcher_pid() if under_launcher else None
    launcher_started = rank_process.started_unix(launcher) if launcher else None
    details["launcher_started"] = launcher_started
    if first_in_process:  # the launcher itself forked from this rank's standby (run_local.sh's later steps)
        found = rank_process.proc_stat(launcher) if launcher and rank_process.in_standby_worker() else None
        details["launcher_forked"] = found is not None and found.parent == os.getppid()
    previous = previous_attempt(events.log_path(), born=marks["spawned"] if first_in_process else None)
    if previous is None:
        kind = "start-up"
        source = "the launcher's creation" if launcher_started else "this process's creation"
        marks["start"] = launcher_started or marks["spawned"] or marks["imported"]
        marks["decision"] = marks["teardown"] = marks["start"]
    else:
        strikes = os.path.join(os.path.dirname(events.log_path()), FAULTS_DIR)
        fault, fault_source = latest_fault(previous, strikes, before=marks["spawned"] or marks["imported"])
        if fault is not None and fault > previous["end"] - 0.001:  # the log's times are rounded to 1 ms
            marks["start"], source = max(fault, previous["end"]), fault_source
        else:
            marks["start"], source = previous["end"], "the previous attempt's last event"
        if not first_in_process:
            kind = "in-process restart"
        elif launcher_started is not None and launcher_started > marks["start"]:
            kind = "new job step"  # a requeue, or a launcher that replaced a lost one
            marks["teardown"] = launcher_started
        else:
            kind = "in-job restart" if launcher else "new process"
            if launcher and marks["spawned"] is not None:
                found = launcher_decisions(_stderr_text(), launcher, after=previous["since"],
                                           before=marks["spawned"])
                marks["decision"], marks["teardown"] = found.get("decision"), found.get("teardown")
                details["launcher_rendezvous"] = found.get("rendezvous")
    if marks["chosen"] is None:
        marks["chosen"] = marks["loaded"]  # nothing was read: no load phase
    marks = _monotone(marks)
    phases = phases_between(marks)
    if previous is None:
        phases["detection"] = phases["teardown"] = None  # no fault before a start-up
    return {"kind": kind, "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "start_source": source, "seconds": round(marks["first_iteration"] - marks["start"], 3),
            "phases": phases, "marks": {k: _rounded(v) for k, v in marks.items()},
            "details": {k: _rounded(v) for k, v in details.items()}}


def _rounded(value):
    return round(value, 3) if isinstance(value, float) else value


def _monotone(marks: dict) -> dict:
    """Known marks clamped so none is before the one it follows (clocks of 1 ms and 10 ms resolution)."""
    out, floor = {}, None
    for name in BOUNDARIES:
        value = marks[name]
        if value is not None and floor is not None:
            value = max(value, floor)
        out[name] = value
        floor = value if value is not None else floor
    return out


def phases_between(marks: dict) -> dict[str, float | None]:
    """Seconds of each phase; a phase whose end was not measured is null and its time is in the phase
    before it (which then runs to the next measured boundary)."""
    phases: dict[str, float | None] = dict.fromkeys(PHASES)
    known = [i for i, name in enumerate(BOUNDARIES) if marks[name] is not None]
    for here, there in zip(known, known[1:], strict=False):
        phases[PHASES[here]] = round(marks[BOUNDARIES[there]] - marks[BOUNDARIES[here]], 3)
    return phases


def _tail_lines(path: str) -> list[str]:
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - _TAIL_BYTES))
        data = f.read()
    lines = data.decode("utf-8", errors="replace").split("\n")
    return lines[1:] if size > _TAIL_BYTES else lines  # the first may be cut


def previous_attempt(log_path: str, born: float | None = None) -> dict | None:
    """{since, end, events} of the attempt before the current one (whose `start` is the log's last), or
    None if the current one is the log's first: its first and last record's times, and its records
    (those in the tail read, for a long one). `born`: when this process was created; the records after it
    are this attempt's own, though before its `start` (under in-process restart, the set-up lines)."""
    records = []
    for line in _tail_lines(log_path):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("unix"), (int, float)):
            records.append(record)
    starts = [i for i, r in enumerate(records) if r.get("event") == "start"]
    if not starts or starts[-1] == 0:
        return None
    before = records[starts[-2] if len(starts) > 1 else 0:starts[-1]]
    # An in-process restart's own line is written as it begins, after the fault: not the previous attempt's
    # last sign of life (taken for it, a restart's detection was 0 s, and its time counted as training).
    before = [r for r in before if not (r.get("event") == "restart" and r.get("kind") == "inprocess")]
    if born is not None:
        before = [r for r in before if r["unix"] < born]
    if not before:
        return None
    return {"since": before[0]["unix"], "end": before[-1]["unix"], "events": before}


def latest_fault(previous: dict, faults_dir: str, before: float | None) -> tuple[float | None, str]:
    """The latest fault recorded in the previous attempt (its events, and the strike records any rank
    left under `faults_dir` since its first record and before `before`), and what recorded it."""
    found: list[tuple[float, str]] = [(e["unix"], f"a fault_injected event ({e.get('kind')})")
                                      for e in previous["events"] if e.get("event") == "fault_injected"]
    try:
        names = os.listdir(faults_dir)
    except OSError:
        names = []
    for name in names:
        try:
            with open(os.path.join(faults_dir, name)) as f:
                when = float(f.read().strip())
        except (OSError, ValueError):
            continue
        if previous["since"] < when and (before is None or when <= before):
            found.append((when, f"a strike record ({name})"))
    return max(found) if found else (None, "")


def _stderr_text() -> str:
    """The end of the file this process's stderr goes to (under ft_launcher: the launcher's own output),
    or "" when it is not a file (a pipe, a terminal)."""
    try:
        if not stat.S_ISREG(os.fstat(2).st_mode):
            return ""
        return "\n".join(_tail_lines("/proc/self/fd/2"))
    except OSError:
        return ""


def _launcher_lines(text: str, launcher_pid: int, host: str, slurm_task: str):
    """(timestamp, milliseconds, message) of each of this launcher's lines, in either format."""
    for match in _LAUNCHER_LINE_PID.finditer(text):
        if int(match.group(3)) == launcher_pid:
            yield match.group(1), match.group(2), match.group(4)
    for match in _LAUNCHER_LINE_HOST.finditer(text):
        if match.group(3) == host and match.group(4) == slurm_task:
            yield match.group(1), match.group(2), match.group(5)


def launcher_decisions(text: str, launcher_pid: int, after: float, before: float, host: str | None = None,
                       slurm_task: str | None = None) -> dict[str, float]:
    """From this rank's ft_launcher's own log lines in `text` (it writes them with millisecond local
    timestamps; NVRx 0.4 names the launcher by `launcher_pid`, NVRx 0.7 by `host` and `slurm_task`, by
    default this host and SLURM_PROCID): `decision`, its last "will restart worker group" in
    (after, before]; `teardown`, the first "attempts to join the next round" after it; `rendezvous`, the
    first "has joined" (round N of, 0.4; the rendezvous, 0.7) after that. Empty where the lines are not
    there (FT_LAUNCHER_LOGLEVEL above INFO, another launcher)."""
    host = socket.gethostname() if host is None else host
    task = os.environ.get("SLURM_PROCID", "?") if slurm_task is None else slurm_task
    lines = []
    for stamp, millis, message in _launcher_lines(text, launcher_pid, host, task):
        when = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
        if after < when <= before + 0.02:  # `before`, a process's creation, is known to 10 ms
            lines.append((when, message))
    found: dict[str, float] = {}
    decisions = [when for when, message in lines if "will restart worker group" in message]
    if not decisions:
        return found
    found["decision"] = decisions[-1]
    for key, needle in (("teardown", "attempts to join the next round"), ("rendezvous", "has joined ")):
        floor = max(found.values())
        later = [when for when, message in lines if needle in message and when >= floor]
        if not later:
            break
        found[key] = later[0]
    return found
