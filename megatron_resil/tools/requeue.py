"""What a launch script should do after a job step ended: requeue the job, or stop.

`python -m megatron_resil.tools.requeue <save-dir> --since UNIX_TIME --launcher-exit-code N` prints one
line, `requeue <code>: <reason>` or `stop <code>: <reason>`, where <code> is the run's exit code (the
launcher's if the run recorded none), and exits 0 (2 on bad input). The scripts in scripts/ act on the
first word and end with <code> when they stop.

The launcher's own exit code cannot say why the workers ended (ft_launcher and torchrun exit 1 for any
worker failure), so the decision reads the event log the run wrote beside its checkpoints, from
`--since` on: the last way the training processes ended, with its exit code (the table in
megatron_resil/exit_codes.py and docs/exit_codes.md), decides. A step that ended without a word from the run
(a node died, the launcher's restarts ran out, it was killed) is requeued: Slurm gives the next
attempt other nodes, and the scripts bound the number of requeues.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_resil import exit_codes
from megatron_resil.events import EVENT_LOG_NAME

# Exit codes that say "do not requeue": the same command would fail the same way.
_STOP = {
    exit_codes.BAD_ARGUMENTS: "bad arguments; fix the command line",
    exit_codes.NO_CHECKPOINT: "nothing loadable under --load; see the run's [resil] lines",
    exit_codes.RERUN_FAILED_VALIDATION: "the rerun state machine failed validation (Megatron's 17)",
    exit_codes.UNRECOVERABLE: "a fault reproduced from every checkpoint; see the run's [resil] lines",
}
_REQUEUE = {
    exit_codes.SIGNAL_SAVED: "stopped by the exit signal after saving",
    exit_codes.SIGNAL_DEADLINE: "stopped by the exit signal; the save missed its deadline, the previous "
                                "checkpoint is intact",
    exit_codes.SAVE_FAILED: "a save failed (I/O); the previous checkpoint is intact",
    exit_codes.LAUNCHER_GONE: "the launcher died and its ranks stopped without saving",
    exit_codes.RESERVES_USED_UP: "in-process restart lost a rank with no warm reserve left to take its place",
    exit_codes.RERUN_RESUME: "the rerun state machine asks to resume from the checkpoint (Megatron's 16)",
}


def read_events(path: str, since: float, before: bool = False) -> list[dict]:
    """The events from unix time `since` on (or, with `before`, those before it)."""
    events = []
    with open(path, errors="replace") as f:
        for line in f:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a torn last line of a killed writer
            if isinstance(entry, dict) and (entry.get("unix", 0) >= since) != before:
                events.append(entry)
    return events


_SIGNALLED = {exit_codes.SIGNAL_SAVED, exit_codes.SIGNAL_DEADLINE}


def _last_attempt(events: list[dict]) -> list[dict]:
    """The events of the last attempt (from its last `start`) in `events`."""
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    return events[starts[-1]:] if starts else events


def _signalled_without_progress(attempt: list[dict]) -> bool:
    """The attempt ended by the exit signal before it published an iteration beyond the one it loaded."""
    ends = [e for e in attempt if e.get("event") == "exit" and "exit_code" in e]
    if not ends or int(ends[-1]["exit_code"]) not in _SIGNALLED:
        return False
    loaded = max((int(e.get("iteration") or 0) for e in attempt if e.get("event") in ("load", "loaded")),
                 default=0)
    return not any(e.get("event") == "save_published" and int(e.get("iteration") or 0) > loaded
                   for e in attempt)


def decide(events: list[dict], launcher_exit_code: int,
           earlier: list[dict] | None = None) -> tuple[str, int, str]:
    """(verb, exit code, reason) from the step's events (oldest first), the launcher's exit code, and
    the events of the steps before it (`earlier`, for the requeue-loop guard)."""
    if (_signalled_without_progress(_last_attempt(events)) and earlier
            and _signalled_without_progress(_last_attempt(earlier))):
        code = int([e for e in events if e.get("event") == "exit"][-1]["exit_code"])
        return "stop", code, (
            "two attempts in a row were stopped by the exit signal before they saved a new iteration: "
            "requeueing would loop; under Slurm the warning signal comes too soon for the time limit "
            "(keep --signal=B:TERM@<seconds> well under --time)")
    ends = [e for e in events if e.get("event") in ("finished", "exit") and "exit_code" in e]
    if not ends:
        if launcher_exit_code == 0:
            return "stop", 0, "the launcher succeeded and the run recorded no exit (no --save?)"
        return "requeue", launcher_exit_code, (
            f"the training processes ended without an exit record (launcher exit code {launcher_exit_code}): "
            "killed, a lost node, or the launcher's in-job restarts exhausted")
    last = ends[-1]
    code = int(last["exit_code"])
    if last["event"] == "finished":
        return "stop", code, f"training finished at iteration {last.get('iteration')}"
    if code == exit_codes.FINISHED:
        if last.get("requeue"):
            return "requeue", code, f"stopped early to be continued: {last.get('message', '')}"
        return "stop", code, f"stopped as requested: {last.get('message', '')}"
    if code in _STOP:
        return "stop", code, _STOP[code]
    if code in _REQUEUE:
        return "requeue", code, _REQUEUE[code]
    return "requeue", code, "an exit code not in the table; requeueing (the scripts bound requeues)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_resil.tools.requeue",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("save", help="the run's --save directory (holds events.jsonl)")
    parser.add_argument("--since", type=float, required=True, help="unix time the job step started")
    parser.add_argument("--launcher-exit-code", type=int, required=True)
    args = parser.parse_args(argv)
    path = os.path.join(args.save, EVENT_LOG_NAME)
    events = read_events(path, args.since) if os.path.isfile(path) else []
    earlier = read_events(path, args.since, before=True) if os.path.isfile(path) else []
    verb, code, reason = decide(events, args.launcher_exit_code, earlier)
    print(f"{verb} {code}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
