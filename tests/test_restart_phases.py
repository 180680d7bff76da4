"""Where a restart's time goes: a rank killed under ft_launcher, the restarted ranks' way from the fault to
their first iteration split into phases that are all measured, every boundary between the fault and the
moment this test saw that iteration by its own clocks; and the pieces that measure them (a process's
creation time, ft_launcher's own log lines, merged phases) on their own."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from megatron_resil import rank_process
from megatron_resil.resilience import restart_phases
from megatron_resil.tools import goodput, timeline
from tests import launch


def test_a_process_creation_time_lies_between_its_spawn_and_its_first_line():
    before = time.time()
    code = "import time; print(time.time(), flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        first_line = float(child.stdout.readline())
        created = rank_process.started_unix(child.pid)
    finally:
        child.kill()
        child.wait()
    assert created is not None and before - 0.02 <= created <= first_line + 0.02  # /proc counts 10 ms ticks
    assert rank_process.started_unix(2 ** 22 + 1) is None  # no such process


def _launcher_log(pid: int, at: float, message: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) + f",{int(at * 1000) % 1000:03d}"
    return f"[{stamp}] [INFO] [ft_launcher{pid}@node1] {message}"


RESTART = "[default] Worker group {}. {}/2 attempts left; will restart worker group"
JOIN = "The node 'n_42_0' attempts to join the next round of the rendezvous 'x'."
JOINED = "The node 'n_42_0' has joined round {} of the rendezvous 'x' as rank 0 in a world of size 1."


def test_the_launchers_decision_teardown_and_rendezvous_come_from_its_own_log_lines():
    t0 = math.floor(time.time()) - 100.0
    lines = [_launcher_log(42, t0 + 1.0, RESTART.format("FAILED", 2)), _launcher_log(42, t0 + 1.3, JOIN),
             _launcher_log(42, t0 + 1.6, JOINED.format(1)),
             "[rank0]: a worker's line, then another launcher's (another node in a shared Slurm log):",
             _launcher_log(43, t0 + 5.0, RESTART.format("FAILED", 1)),
             _launcher_log(42, t0 + 5.2, RESTART.format("UNHEALTHY", 1)),
             _launcher_log(42, t0 + 5.25, "Stopping workers... Timeout = 30 sec."),
             _launcher_log(42, t0 + 5.5, JOIN), _launcher_log(42, t0 + 5.9, JOINED.format(2)),
             _launcher_log(42, t0 + 9.0, "[default] worker group successfully finished.")]
    text = "\n".join(lines)
    found = restart_phases.launcher_decisions(text, 42, after=t0 + 2.0, before=t0 + 6.0)
    assert found == {"decision": pytest.approx(t0 + 5.2), "teardown": pytest.approx(t0 + 5.5),
                     "rendezvous": pytest.approx(t0 + 5.9)}
    first = restart_phases.launcher_decisions(text, 42, after=t0, before=t0 + 2.0)
    assert first["decision"] == pytest.approx(t0 + 1.0)
    assert restart_phases.launcher_decisions(text, 42, after=t0 + 6.0, before=t0 + 9.5) == {}  # none then
    assert restart_phases.launcher_decisions("", 42, after=t0, before=t0 + 9.5) == {}  # stderr not a file


def _launcher_log_07(host: str, task: str, at: float, message: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) + f",{int(at * 1000) % 1000:03d}"
    return f"{stamp} [INFO] [{host}] [workload:?(?) infra:{task}(0)] launcher.py:718 {message}"


def test_nvrx_07_lines_are_told_apart_by_host_and_slurm_task():
    """NVRx 0.7's format names no pid: two launchers' lines in one Slurm output differ by their task."""
    t0 = math.floor(time.time()) - 100.0
    joined = "The node 'n_42_0' has joined the rendezvous 'x' as rank 0 in a world of size 2."
    lines = [_launcher_log_07("node", "1", t0 + 1.0, RESTART.format("FAILED", 2)),
             _launcher_log_07("node", "0", t0 + 1.1, RESTART.format("FAILED", 2)),
             "0: " + _launcher_log_07("node", "0", t0 + 1.4, JOIN),  # a file handler's rank prefix
             _launcher_log_07("node", "1", t0 + 1.2, JOIN),
             _launcher_log_07("other", "0", t0 + 1.5, joined),
             _launcher_log_07("node", "0", t0 + 1.7, joined)]
    found = restart_phases.launcher_decisions("\n".join(lines), 42, after=t0, before=t0 + 3.0, host="node",
                                              slurm_task="0")
    assert found == {"decision": pytest.approx(t0 + 1.1), "teardown": pytest.approx(t0 + 1.4),
                     "rendezvous": pytest.approx(t0 + 1.7)}


def test_an_inprocess_restarts_own_line_is_not_the_last_sign_of_life_before_it():
    """A real same-step run (tests/data/event_logs): rank 2 killed in iteration 7; the in-process restart's
    line came 2.2 s after rank 0's last progress record. The previous attempt ends at that record, so the
    restart's detection is those 2.2 s; taken from the restart line, it was 0."""
    log = launch.REPO / "tests" / "data" / "event_logs" / "same_step_dp4_kill.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    last_start = max(i for i, r in enumerate(records) if r["event"] == "start")
    (restart,) = [r for r in records[:last_start] if r["event"] == "restart" and r.get("kind") == "inprocess"]
    last_progress = [r for r in records[:last_start] if r["event"] == "progress"][-1]
    previous = restart_phases.previous_attempt(str(log))
    assert previous["end"] == last_progress["unix"] < restart["unix"] - 2
    assert restart not in previous["events"]


def test_a_boundary_not_measured_merges_its_phases_into_the_one_before():
    marks = dict(zip(restart_phases.BOUNDARIES, [100.0, None, None, 103.0, 106.0, 106.5, 107.0, 107.25, 108.0,
                                                 108.5, 109.0], strict=True))
    phases = restart_phases.phases_between(marks)
    assert phases["detection"] == 3.0 and phases["teardown"] is None and phases["spawn"] is None
    assert phases["imports"] == 3.0 and phases["first_iteration"] == 0.5
    assert list(phases) == list(restart_phases.PHASES)


def _watch(proc: subprocess.Popen, event_log, wanted: dict) -> dict[str, tuple[float, float]]:
    """Until `proc` ends: when (time.time(), time.monotonic()) this test first saw, in the event log, a
    record matching each of `wanted` (name -> predicate on a record)."""
    seen: dict[str, tuple[float, float]] = {}
    while True:
        ended = proc.poll() is not None
        records = [json.loads(line) for line in event_log.read_text().splitlines() if line.endswith("}")] \
            if event_log.exists() else []
        # After the read: a record written between a clock read first and the file's read would be "seen"
        # before it was made (CI, stop 51: 28 ms before, on a busy host).
        now = (time.time(), time.monotonic())
        for name, matches in wanted.items():
            if name not in seen and any(matches(r) for r in records):
                seen[name] = now
        if ended or len(seen) == len(wanted):
            return seen
        time.sleep(0.02)


@pytest.mark.slow
def test_a_killed_rank_restart_is_split_into_phases_within_what_this_test_saw_of_it(tmp_path):
    """Rank 0 kills itself before iteration 3 under ft_launcher (its launcher log in a file, as Slurm and
    the drill keep it); the launcher restarts both ranks, which resume from iteration 2."""
    save, log = tmp_path / "ckpt", tmp_path / "launcher.log"
    args = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "4", "--save", str(save),
            "--load", str(save), "--save-interval", "2", "--inject-fault", "kill", "--inject-fault-iteration",
            "3", "--inject-fault-ranks", "0"]
    proc = launch.start_ft(args, log, max_restarts=1)
    # This test's own clocks: when it saw the fault's record, and iteration 3's after the restart.
    seen = _watch(proc, save / "events.jsonl", {
        "fault": lambda r: r["event"] == "fault_injected",
        "third": lambda r: r["event"] == "progress" and r.get("iteration") == 3})
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    events = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines()]
    start_up, restart = [e for e in events if e["event"] == restart_phases.EVENT]
    assert start_up["kind"] == "start-up" and restart["kind"] == "in-job restart"
    # Forked from the tests' standby (tests/conftest.py), the phases count from the launcher's process.
    assert restart["details"]["standby"] is (launch.standby_pid() is not None)

    phases = restart["phases"]
    assert set(phases) == set(restart_phases.PHASES)
    assert all(isinstance(secs, float) and secs >= 0 for secs in phases.values()), phases  # all measured
    marks = restart["marks"]
    assert marks["start"] < marks["decision"] < marks["spawned"]  # the launcher's own lines, not clamped
    # Against the run's other records: from the fault's own event to iteration 3's progress record.
    fault = next(e for e in events if e["event"] == "fault_injected")
    third = next(e for e in events if e["event"] == "progress" and e["iteration"] == 3)
    assert restart["start_source"] == "a fault_injected event (kill)"
    assert marks["start"] == pytest.approx(fault["unix"], abs=0.002)
    assert third["unix"] - fault["unix"] == pytest.approx(restart["seconds"], abs=0.5)
    # Against this test's clocks: every boundary lies between the fault and the moment this test saw
    # iteration 3 (a boundary from a wrong clock, a misread launcher line or /proc, falls outside), and the
    # restart lasted no longer than this test's monotonic clock saw it last, from the fault's record to
    # iteration 3's (plus the fault record's way into the file, measured when it was seen).
    (fault_seen, fault_seen_mono), (third_seen, third_seen_mono) = seen["fault"], seen["third"]
    assert fault["unix"] <= fault_seen and third["unix"] <= third_seen
    assert all(fault["unix"] - 0.002 <= marks[b] <= third_seen for b in restart_phases.BOUNDARIES), marks
    assert restart["seconds"] <= (third_seen_mono - fault_seen_mono) + (fault_seen - fault["unix"]) + 0.05
    said = f"in-job restart took {restart['seconds']:.1f} s to its first iteration: detection"
    assert said in log.read_text()

    loaded = timeline.read_events(str(save / "events.jsonl"))
    measured = goodput.measure(*loaded)
    assert measured.attempts[1].restart_load_s == pytest.approx(restart["seconds"], abs=0.002)
    t = measured.total
    assert t.useful_s + t.saving_s + t.lost_s + t.restart_load_s == pytest.approx(t.wall_s)
    split = goodput.phase_split(measured)
    assert split.restarts == 1 and split.seconds == pytest.approx(restart["seconds"], abs=0.006)
