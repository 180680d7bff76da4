"""The goodput planner: its accounting on real event logs of the drill (a node loss; injected NaNs with
restarts and a fallback), and its save-interval optimum against a brute-force simulation of failures."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest

from megatron_resil.resilience import restart_phases
from megatron_resil.tools import goodput, timeline
from tests import launch

LOGS = launch.REPO / "tests" / "data" / "event_logs"


@pytest.mark.parametrize(("log", "attempts"), [("drill_a_node_loss.jsonl", 2),
                                               ("drill_d_injected_nan.jsonl", 4)])
def test_accounting_splits_every_second_of_a_real_run(log, attempts):
    events, skipped = timeline.read_events(str(LOGS / log))
    measured = goodput.measure(events, skipped)
    total = measured.total
    assert len(measured.attempts) == attempts and skipped == 0
    assert math.isclose(total.wall_s, timeline.analyse(events, 0).wall_s, rel_tol=1e-9)
    assert math.isclose(total.useful_s + total.saving_s + total.lost_s + total.restart_load_s, total.wall_s,
                        rel_tol=1e-9)
    # Every restart cost something, and a restart after a node loss dominates this small run.
    assert all(a.restart_load_s > 1.0 for a in measured.attempts[1:])
    assert measured.iteration_s and 0.01 < measured.iteration_s < 1.0
    assert {"local", "persistent"} <= set(measured.save_s)
    if attempts == 4:  # the NaN run recomputed iterations after falling back
        assert total.lost_s > 0


def test_a_node_loss_restart_is_charged_its_measured_phases_from_the_loss_to_the_first_iteration(capsys):
    """The drill's restart after the node loss (every phase measured): charged from the node loss's own
    record to the first iteration, split into phases that add up to it, the largest named."""
    events, skipped = timeline.read_events(str(LOGS / "drill_a_restart_phases.jsonl"))
    measured = goodput.measure(events, skipped)
    start_up, restart = measured.attempts
    record = next(e for e in events if e["event"] == "restart_phases" and e["_attempt"] == 2)
    loss = next(e for e in events if e["event"] == "fault_injected")
    assert (start_up.kind, restart.kind) == ("start-up", "in-job restart")
    assert record["marks"]["start"] == loss["unix"] and record["start_source"].endswith("(node-loss)")
    assert all(isinstance(restart.phases[phase], float) for phase in goodput.PHASES)
    assert restart.restart_load_s == pytest.approx(record["seconds"], abs=1e-3)
    assert sum(restart.phases.values()) == pytest.approx(record["seconds"], abs=0.01)
    total = measured.total
    assert math.isclose(total.useful_s + total.saving_s + total.lost_s + total.restart_load_s, total.wall_s,
                        rel_tol=1e-9)
    split = goodput.phase_split(measured)
    assert split.restarts == 1 and split.total == restart.phases and split.median == restart.phases
    assert split.largest == max(restart.phases, key=restart.phases.get)

    assert goodput.main([str(LOGS / "drill_a_restart_phases.jsonl"), "--no-png"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.split()[:3] == ["2", "in-job", "restart"])
    assert [float(cell) for cell in row.split()[3:]] == pytest.approx(
        [*(restart.phases[phase] for phase in goodput.PHASES), record["seconds"]], abs=0.051)
    assert f"most of the restarts' time: {split.largest} ({100 * split.share(split.largest):.0f}% of " in out
    # An older log has no phases: no table, and its restarts are charged as before.
    assert goodput.main([str(LOGS / "drill_d_injected_nan.jsonl"), "--no-png"]) == 0
    assert "restart phases" not in capsys.readouterr().out


def test_training_between_the_last_event_and_a_later_fault_is_not_charged_to_the_restart():
    """Rank 1 is killed 0.5 s after rank 0's last record: those 0.5 s trained; the restart runs from the
    kill to the first iteration of the next attempt."""
    def event(at, name, **fields):
        return {"event": name, "unix": at, "time": "", "host": "h", "pid": 1, **fields}

    marks = dict(zip(restart_phases.BOUNDARIES, [5.5, 5.6, 5.8, 6.0, 9.0, 9.5, 10.5, 11.0, 12.0, 12.5, 13.0],
                     strict=True))
    log = [event(0.0, "start"), *[event(float(i), "progress", iteration=i) for i in range(1, 6)],
           event(10.0, "start"), event(12.0, "loaded", tier="persistent", iteration=5),
           event(13.0, "restart_phases", kind="in-job restart", marks=marks, seconds=7.5,
                 phases=restart_phases.phases_between(marks)),
           event(13.0, "progress", iteration=6), event(14.0, "finished", iteration=6, exit_code=0)]
    for seq, e in enumerate(log):
        e["_seq"] = seq
    first, second = goodput.measure(log).attempts
    assert second.wall_s == pytest.approx(9.0) and second.restart_load_s == pytest.approx(7.5)
    assert second.useful_s == pytest.approx(1.5)  # 0.5 s before the kill, 1 s after the first iteration
    assert sum(second.phases.values()) == pytest.approx(7.5)


def test_a_same_step_recovery_is_a_resume_at_its_iteration_and_loses_no_work():
    """A real same-step recovery (a rank killed in iteration 7, training on from 6 with the survivors'
    state): nothing was trained twice, so no lost work is charged; before, the attempt counted as a resume
    from iteration 0 and every iteration before the kill as recomputed."""
    events, skipped = timeline.read_events(str(LOGS / "same_step_dp4_kill.jsonl"))
    line = timeline.analyse(events, skipped)
    recovered = line.attempts[-1]
    assert recovered.loaded == "same-step@6 (from replicas)" and recovered.recomputed == 0
    assert line.attempts[-2].reached == 6 and recovered.reached == 10
    measured = goodput.measure(events, skipped)
    assert measured.total.lost_s == 0 and measured.attempts[-1].kind == "in-process restart"


def test_the_command_reports_and_draws(tmp_path):
    png = tmp_path / "goodput.png"
    result = subprocess.run([sys.executable, "-m", "megatron_resil.tools.goodput",
                             str(LOGS / "drill_d_injected_nan.jsonl"), "--mtbf-hours", "5000",
                             "--out", str(png)],
                            capture_output=True, text=True, env=launch.env(), cwd=launch.REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "goodput: " in result.stdout and "node MTBF 5000 h (given)" in result.stdout
    for gpus in ("1024", "4096", "16384"):
        assert any(line.split()[:1] == [gpus] for line in result.stdout.splitlines()), result.stdout
    assert png.stat().st_size > 10_000
    missing = subprocess.run([sys.executable, "-m", "megatron_resil.tools.goodput",
                              str(tmp_path / "nothing")],
                             capture_output=True, text=True, env=launch.env(), cwd=launch.REPO, timeout=120)
    assert missing.returncode == 2 and "no event log at" in missing.stderr


# ---- the optimum against a simulation -------------------------------------------------------------

def simulate(local_every: float, global_every: float, save_local: float, save_global: float, restart: float,
             mtbf: float, coverage: float, failures: int, seed: int) -> float:
    """Goodput of a run with saves every `local_every` / `global_every` seconds of training, failures at
    exponential intervals of wall time (mean `mtbf`, during work, saves or restarts alike), each recovered
    from the newest local save with probability `coverage`, else from the newest global one, after
    `restart` seconds. Runs until `failures` failures happened."""
    rng = random.Random(seed)
    wall = work = 0.0
    last_local = last_global = 0.0
    next_local, next_global = local_every, global_every
    next_failure = rng.expovariate(1 / mtbf)
    seen = 0
    while seen < failures:
        save_at = min(next_local, next_global)
        step = save_at - work  # work until the next save point
        if wall + step >= next_failure:
            work += next_failure - wall  # lost below
            wall = next_failure
        else:
            wall += step
            work = save_at
            is_global = next_global <= next_local
            cost = save_global if is_global else save_local
            if wall + cost < next_failure:
                wall += cost
                if is_global:
                    last_global, next_global = work, work + global_every
                    if next_local <= work:
                        next_local = work + local_every
                else:
                    last_local, next_local = work, work + local_every
                continue
            wall = next_failure
        seen += 1  # a failure: roll back, restart (a failure during the restart restarts again)
        work = max(last_local, last_global) if rng.random() < coverage else last_global
        wall += restart
        next_failure = wall + rng.expovariate(1 / mtbf)
        while next_failure < wall:
            next_failure = wall + rng.expovariate(1 / mtbf)
        next_local = (math.floor(work / local_every) + 1) * local_every
        next_global = (math.floor(work / global_every) + 1) * global_every
    return work / wall


def test_the_two_tier_optimum_is_the_simulations_best_and_its_goodput_is_what_the_simulation_finds():
    costs = dict(save_local=2.0, save_global=20.0, restart=60.0, mtbf=3600.0, coverage=0.9)
    plan = goodput.optimal_plan(1, costs["mtbf"] / 3600.0, costs["save_local"], costs["save_global"],
                                costs["restart"], costs["coverage"])
    assert plan.local_interval_s == pytest.approx(126.5, abs=0.1)
    assert plan.global_interval_s == pytest.approx(1200.0, abs=0.1)

    def sim(local_every, global_every):  # the same failures for every schedule (common random numbers)
        return simulate(local_every, global_every, failures=1500, seed=7, **costs)

    at_optimum = sim(plan.local_interval_s, plan.global_interval_s)
    grid = [(plan.local_interval_s * a, plan.global_interval_s * b)
            for a in (0.35, 0.6, 1.0, 1.7, 2.8) for b in (0.35, 0.6, 1.0, 1.7, 2.8)]
    best = max(sim(*point) for point in grid)
    assert at_optimum >= best - 0.003, (at_optimum, best)  # within 0.3 percentage points of the best
    assert abs(at_optimum - plan.goodput) < 0.01, (at_optimum, plan.goodput)  # the model's figure holds
    # And a schedule far from the optimum is measurably worse, in the model and in the simulation.
    far = sim(plan.local_interval_s * 6, plan.global_interval_s / 6)
    assert far < at_optimum - 0.01


def test_young_single_tier_optimum_matches_the_simulation():
    plan = goodput.optimal_plan(4, 4.0, None, 30.0, 90.0, 0.9)  # 4 nodes of 4 h: the job fails every hour
    assert plan.local_interval_s is None
    assert plan.global_interval_s == pytest.approx(math.sqrt(2 * 30 * 3600), rel=1e-9)

    def sim(every):
        return simulate(1e12, every, save_local=0.0, save_global=30.0, restart=90.0, mtbf=3600.0,
                        coverage=0.0, failures=1500, seed=11)

    at_optimum = sim(plan.global_interval_s)
    best = max(sim(plan.global_interval_s * f) for f in (0.3, 0.5, 0.7, 1.0, 1.4, 2.0, 3.3))
    assert at_optimum >= best - 0.003
    assert abs(at_optimum - plan.goodput) < 0.01


def test_an_async_save_is_charged_its_blocking_part_only():
    """A synchronous save blocks training for all its seconds; an async one for what the trainer spent
    on it (`blocking_seconds`), its background write overlapping training."""
    def event(at, name, **fields):
        return {"event": name, "unix": at, "time": "", "host": "h", "pid": 1, **fields}

    log = [event(0.0, "start", world_size=2, train_iters=20),
           *[event(1.0 + i, "progress", iteration=i) for i in range(1, 6)],
           event(6.0, "save_published", tier="persistent", iteration=5, seconds=3.0, asynchronous=True,
                 blocking_seconds=0.25,
                 blocking_parts={"prepare": 0.05, "stage": 0.2, "wait": 0, "finalize": 0}),
           event(9.0, "save_published", tier="persistent", iteration=8, seconds=2.0),
           event(10.0, "finished", iteration=8, exit_code=0)]
    for seq, e in enumerate(log):
        e["_seq"] = seq  # as timeline.read_events numbers them
    measured = goodput.measure(log)
    assert measured.total.saving_s == pytest.approx(2.25)
    assert measured.save_s["persistent"] == pytest.approx(1.125)  # the median of 0.25 and 2.0
