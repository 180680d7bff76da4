"""The launch logic of scripts/: the requeue-or-stop decision, and the local launcher (the Slurm
script's logic on one machine) under a real preemption: SIGTERM to the launcher script, forwarded to
ft_launcher and the ranks, which save and exit; the job is requeued, resumes from the tracker and
finishes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_resil import exit_codes
from megatron_resil.tools import timeline
from megatron_resil.tools.requeue import decide
from tests import launch

RUN_LOCAL = str(launch.REPO / "scripts" / "run_local.sh")


def _ev(event: str, **fields) -> dict:
    return {"event": event, "unix": 1.0, **fields}


@pytest.mark.parametrize("events,launcher_code,verb,code", [
    ([_ev("start"), _ev("finished", iteration=10, exit_code=0)], 0, "stop", 0),
    ([_ev("start"), _ev("exit", exit_code=exit_codes.SIGNAL_SAVED)], 1, "requeue", 5),
    ([_ev("start"), _ev("exit", exit_code=exit_codes.SIGNAL_DEADLINE)], 1, "requeue", 6),
    ([_ev("start"), _ev("exit", exit_code=0, requeue=True)], 0, "requeue", 0),  # --exit-duration-in-mins
    ([_ev("start"), _ev("exit", exit_code=0, requeue=False)], 0, "stop", 0),  # --exit-interval
    ([_ev("start"), _ev("exit", exit_code=exit_codes.NO_CHECKPOINT)], 1, "stop", 3),
    ([_ev("start"), _ev("exit", exit_code=exit_codes.UNRECOVERABLE)], 1, "stop", 8),
    ([_ev("start"), _ev("exit", exit_code=exit_codes.RESERVES_USED_UP)], 1, "requeue", 10),
    ([_ev("start"), _ev("exit", exit_code=exit_codes.RERUN_RESUME)], 1, "requeue", 16),
    ([_ev("start"), _ev("exit", exit_code=exit_codes.RERUN_FAILED_VALIDATION)], 1, "stop", 17),
    ([_ev("start")], 1, "requeue", 1),  # killed without a word: a lost node, restarts exhausted
    # In-job restarts: the last attempt's end decides.
    ([_ev("start"), _ev("start"), _ev("exit", exit_code=5), _ev("start"), _ev("finished", exit_code=0)],
     0, "stop", 0),
    ([], 0, "stop", 0),
], ids=["finished", "signal", "signal-deadline", "duration", "interval", "no-checkpoint", "unrecoverable",
        "reserves-used-up", "rerun-16", "rerun-17", "killed", "restarted-then-finished", "no-event-log"])
def test_requeue_decision(events, launcher_code, verb, code):
    got_verb, got_code, reason = decide(events, launcher_code)
    assert (got_verb, got_code) == (verb, code), reason
    assert reason


def test_the_scripts_stop_on_exactly_the_codes_the_ranks_tell_ft_launcher_not_to_restart():
    """One table: a code the launch scripts do not requeue is one whose ranks also ask ft_launcher to end
    its in-job restarts (fault_tolerance.MonitoredRank.job_ending), and no other."""
    stops = {code for code in range(256)
             if decide([_ev("start"), _ev("exit", exit_code=code)], 1)[0] == "stop" and code != 0}
    assert stops == exit_codes.DO_NOT_RETRY


def test_requeue_tool_reads_only_this_step_and_skips_a_torn_line(tmp_path):
    log = tmp_path / "events.jsonl"
    lines = [json.dumps({"event": "finished", "exit_code": 0, "unix": 100.0, "iteration": 4}),
             json.dumps({"event": "start", "unix": 200.0}),
             json.dumps({"event": "exit", "exit_code": 5, "unix": 210.0}), '{"event": "sta']
    log.write_text("\n".join(lines))
    out = subprocess.run([sys.executable, "-m", "megatron_resil.tools.requeue", str(tmp_path),
                          "--since", "150", "--launcher-exit-code", "1"],
                         capture_output=True, text=True, env=launch.env())
    assert out.returncode == 0 and out.stdout.startswith("requeue 5: "), out.stdout + out.stderr


def _local(args: list[str], log: Path, **extra_env: str) -> subprocess.Popen:
    env = {**launch.env(), "RESIL_PYTHON": sys.executable, "MAX_REQUEUES": "2", "MAX_RESTARTS": "0",
           **extra_env}
    return subprocess.Popen(["bash", RUN_LOCAL, *args], env=env, cwd=launch.REPO, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def test_local_launcher_rejects_bad_arguments_before_launching(tmp_path):
    log = tmp_path / "launch.log"
    proc = _local([*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "4", "--save", str(tmp_path),
                   "--save-interval", "0"], log)
    assert proc.wait(timeout=120) == exit_codes.BAD_ARGUMENTS, log.read_text()
    assert "--save-interval" in log.read_text() and "attempt 1" not in log.read_text()


def test_the_standbys_former_module_name_still_runs_the_standby():
    """Users' scripts may start `python -m megatron_resil.standby`, its name before it moved to launch/."""
    result = subprocess.run([sys.executable, "-m", "megatron_resil.standby", "--help"], cwd=launch.REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m megatron_resil.launch.standby"), result.stdout


@pytest.mark.slow
def test_local_launcher_preemption_requeues_and_resumes_to_completion(tmp_path):
    root = tmp_path / "ckpt"
    log = tmp_path / "launch.log"
    args = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "8", "--save", str(root), "--load",
            str(root), "--save-interval", "4", "--exit-signal-handler",
            # Slow enough that the preemption lands mid-run.
            "--inject-fault", "slow", "--inject-fault-iteration", "1", "--inject-fault-slow-secs", "0.5"]
    proc = _local(args, log)
    try:
        deadline = time.monotonic() + 180
        while "iteration        2/" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)  # what Slurm's --signal=B:SIGTERM@grace does to the batch script
        assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert "SIGTERM: forwarding to the job step" in out
    assert "requeue 5: stopped by the exit signal after saving" in out, out[-4000:]
    saved = [line for line in out.splitlines() if "successfully saved checkpoint from iteration" in line]
    preempted_at = int(saved[0].split("iteration")[1].split()[0])
    assert "attempt 2 (requeue 1" in out
    assert f"successfully loaded checkpoint from {root} [ t 1/1, p 1/1 ] at iteration {preempted_at}" in out
    assert "stop 0: training finished at iteration 8" in out
    # The operator's picture of the night: two attempts, the preemption, the resume.
    assert timeline.main([str(root)]) == 0
    first, second = timeline.analyse(*timeline.read_events(str(root / "events.jsonl"))).attempts
    assert (first.reached, first.ending) == (preempted_at, "exit 5")
    assert (second.loaded, second.reached, second.ending) == (f"persistent@{preempted_at}", 8, "finished")
    for line in (root / "events.jsonl").read_text().splitlines():  # strict JSON: no bare NaN
        json.loads(line, parse_constant=_not_json)
    assert (root / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _new_events(root: Path, seen: int) -> tuple[list[dict], int]:
    try:
        lines = (root / "events.jsonl").read_text().splitlines()
    except OSError:
        return [], seen
    whole = [json.loads(line) for line in lines[seen:] if line.endswith("}")]
    return whole, seen + len(whole)


@pytest.mark.slow
@pytest.mark.compat  # NVRx's launcher, forked: its 0.7 too
def test_with_resil_standby_one_standby_forks_every_job_steps_launcher_and_ranks_and_ends_with_the_script(
        tmp_path):
    """RESIL_STANDBY=1: run_local.sh starts one standby for the run (docs/standby.md, "Across job steps").
    The job is preempted twice (SIGTERM to the script, each time once the step has trained): the ranks save
    and exit 5, and the job is requeued. Every job step's ranks, and the launchers of the second and third,
    are forked from that one standby, which imported once; the preemption reaches a forked launcher through
    its client. The standby ends after the script."""
    root = tmp_path / "ckpt"
    log = tmp_path / "launch.log"
    args = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "8", "--save", str(root), "--load",
            str(root), "--save-interval", "4", "--exit-signal-handler",
            # Slow enough that each preemption lands mid-run.
            "--inject-fault", "slow", "--inject-fault-iteration", "1", "--inject-fault-slow-secs", "0.5"]
    proc = _local(args, log, RESIL_STANDBY="1")
    try:
        seen, steps, preempted = 0, 0, 0
        deadline = time.monotonic() + 240
        while preempted < 2:  # each step's first iteration after its start: preempt it
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            new, seen = _new_events(root, seen)
            for event in new:
                steps += event["event"] == "restart_phases"
                if event["event"] == "progress" and steps > preempted:
                    os.kill(proc.pid, signal.SIGTERM)
                    preempted += 1
                    break
            time.sleep(0.05)
        assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    # One standby, which imported once.
    (ready,) = [line for line in out.splitlines() if line.startswith("[resil] standby '")]
    name = ready.split("'")[1]
    assert name == f"run-local-{proc.pid}", ready
    assert out.count("requeue 5: stopped by the exit signal after saving") == 2, out[-4000:]
    assert "attempt 3 (requeue 2" in out and "stop 0: training finished at iteration 8" in out, out[-4000:]
    assert "not used" not in out and "not started" not in out, out[-4000:]
    records = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]
    phases = [r for r in records if r["event"] == "restart_phases"]
    assert [(r["kind"], r["details"]["standby"], r["details"]["megatron_core_ahead"]) for r in phases] == [
        ("start-up", True, True), ("new job step", True, True), ("new job step", True, True)]
    # The later steps' launchers were forked from it too (NVRx's launcher then imports no torch).
    assert [r["details"]["launcher_forked"] for r in phases] == [False, True, True]
    assert [r["exit_code"] for r in records if r["event"] == "exit"] == [5, 5]
    # The standby ends after the script (it watches its parent): waited for as an event; the bound is only
    # a guard for a loaded host, where a standby took more than 5 s to go (CI, stop 43).
    deadline = time.monotonic() + 60
    while launch.processes_named(name):
        assert time.monotonic() < deadline, f"the standby {name} outlived run_local.sh"
        time.sleep(0.05)


def test_a_launcher_told_to_hand_itself_over_with_no_standby_says_so_and_runs(tmp_path):
    """MEGATRON_RESIL_LAUNCHER_FROM_STANDBY=1 (run_local.sh's later steps) where no standby answers: one
    line, and the launcher runs in its own process (here: NVRx's help)."""
    env = {**launch.env(), "MEGATRON_RESIL_LAUNCHER_FROM_STANDBY": "1",
           "MEGATRON_RESIL_STANDBY": f"resil-test-none-{os.getpid()}"}
    result = subprocess.run([sys.executable, "-m", "megatron_resil.launch.ft_launcher", "--help"], env=env,
                            cwd=launch.REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stderr
    assert f"[resil] standby: MEGATRON_RESIL_STANDBY=resil-test-none-{os.getpid()} not used: no standby " \
        "answers" in said and "; the launcher imports torch itself" in said, said
    assert "usage:" in result.stdout


def test_the_standby_serves_this_checkouts_launcher_and_no_other_script_once_megatron_core_is_in():
    from megatron_resil.launch import ft_launcher, standby_warmup

    assert standby_warmup.is_our_launcher(ft_launcher.__file__)
    assert not standby_warmup.is_our_launcher(str(launch.REPO / "scripts" / "node_loss_drill.py"))
    warm = standby_warmup.Warmup()
    warm.key = frozenset({"a record"})  # as after the first pretrain.py run's import ahead
    assert warm.refusal({"argv": [ft_launcher.__file__, "--nproc-per-node", "2"]}) is None
    assert warm.refusal({"argv": ["other.py"]}) == "it has megatron-core imported for pretrain.py runs"


def test_the_standby_of_a_script_takes_the_ranks_per_node_it_is_told():
    """`--ranks-per-node N` with `-- COMMAND`: the import-time environment of the ranks a script's launchers
    start (OMP_NUM_THREADS=1 for more than one rank per node, as torchrun and ft_launcher set it), where
    COMMAND does not name their --nproc-per-node; the command's own flag, where it does."""
    from megatron_resil.launch import standby

    script = ["bash", "scripts/run_local.sh", "--inprocess-restart"]
    env = standby.ranks_environment(script, {}, nproc="4")
    assert env == {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "error"}
    assert standby.ranks_environment(script, {}, nproc="1") == {"TORCH_CPP_LOG_LEVEL": "error"}
    assert standby.ranks_environment(["ft_launcher", "--nproc-per-node", "1"], {}, nproc="4") == {}
    result = subprocess.run([sys.executable, "-m", "megatron_resil.launch.standby", "--name", "x",
                             "--ranks-per-node", "4"], cwd=launch.REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "--ranks-per-node goes with `-- COMMAND`" in result.stderr, result


def _not_json(constant: str) -> None:
    raise AssertionError(f"{constant} is not JSON")


def _attempt(loaded: int, published: list[int], code: int) -> list[dict]:
    return [_ev("start"), _ev("loaded", iteration=loaded),
            *[_ev("save_published", iteration=i) for i in published], _ev("exit", exit_code=code)]


@pytest.mark.parametrize("earlier,this,verb", [
    (_attempt(0, [], 5), _attempt(0, [], 5), "stop"),  # signalled at once, twice: a --signal lead >= --time
    # the last one did nothing: once may be bad luck
    (_attempt(0, [10], 5), _attempt(10, [10], 5), "requeue"),
    (_attempt(0, [], 5), _attempt(0, [10], 5), "requeue"),  # progress in this one
    ([], _attempt(0, [], 5), "requeue"),
    (_attempt(0, [], 9), _attempt(0, [], 5), "requeue"),  # the earlier one was not a signal
], ids=["twice-no-progress", "earlier-progressed", "this-progressed", "first", "earlier-not-signalled"])
def test_requeue_loop_guard_stops_a_job_signalled_twice_before_saving_anything_new(earlier, this, verb):
    got_verb, code, reason = decide(this, 1, earlier)
    assert (got_verb, code) == (verb, 5), reason
    if verb == "stop":
        assert "--signal" in reason and "--time" in reason
