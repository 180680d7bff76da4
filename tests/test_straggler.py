"""--log-straggler: a rank slowed by an injected fault is named with the lowest relative score, rank 0
is the best, the event log says so, and --straggler-stop-if-detected saves and stops for a requeue.
The scoring, the NVRx-style listing and the on/off switch are checked in-process on synthetic timings."""

from __future__ import annotations

import argparse
import json
import math
import re
import socket
import warnings
from types import SimpleNamespace

import pytest

from megatron_resil import events, exit_codes
from megatron_resil.arguments import parse_args
from megatron_resil.checkpointing import layout
from megatron_resil.launch.ports import free_loopback_port
from megatron_resil.resilience.straggler import (
    RankTiming,
    StragglerDetection,
    TimedRanks,
    format_scores,
    identify,
    score,
    scores_from_nvrx_report,
)
from megatron_resil.tools import requeue
from tests import launch

NODES = ["n0", "n1", "n2", "n3"]


def _timings(times_s, best_s) -> list[RankTiming]:
    return [RankTiming(node, t, b) for node, t, b in zip(NODES, times_s, best_s, strict=False)]


def test_scores_compare_each_rank_with_the_fastest_and_with_its_own_best():
    scores = score(_timings([0.10, 0.20, 0.11, math.nan], [0.10, 0.10, 0.11, math.inf]))
    assert scores.relative[0] == 1.0 and scores.relative[1] == pytest.approx(0.5)
    assert scores.relative[2] == pytest.approx(0.10 / 0.11)
    assert scores.individual[1] == pytest.approx(0.5)  # twice as slow as it used to be
    assert scores.individual[0] == scores.individual[2] == 1.0
    assert math.isnan(scores.relative[3])  # measured nothing: no score, never a straggler
    stragglers = identify(scores, relative_threshold=0.75, individual_threshold=0.75)
    assert [(s.rank, s.node) for s in stragglers] == [(1, "n1")]
    assert identify(scores, relative_threshold=0.0, individual_threshold=0.0) == []  # 0: checks off
    assert [s.rank for s in identify(scores, relative_threshold=0.95, individual_threshold=0.0)] == [1, 2]


def test_identification_agrees_with_nvrx_report():
    with warnings.catch_warnings():  # NVRx's pynvml deprecation warning
        warnings.simplefilter("ignore")
        try:  # NVRx 0.4
            from nvidia_resiliency_ext.straggler import Report
        except ModuleNotFoundError:  # NVRx 0.7 moved it under attribution/
            from nvidia_resiliency_ext.attribution.straggler import Report
    scores = score(_timings([0.10, 0.30, 0.12, 0.09], [0.10, 0.15, 0.08, 0.09]))
    report = Report(gpu_relative_perf_scores=scores.relative, section_relative_perf_scores={},
                    gpu_individual_perf_scores=scores.individual, section_individual_perf_scores={},
                    rank_to_node=scores.nodes, local_section_summaries={}, local_kernel_summaries={},
                    generate_report_elapsed_time=0.0, gather_on_rank0=True, rank=0)
    theirs = report.identify_stragglers(gpu_rel_threshold=0.75, gpu_indiv_threshold=0.75)
    ours = identify(scores_from_nvrx_report(report), relative_threshold=0.75, individual_threshold=0.75)
    expected = {s.rank for s in theirs["straggler_gpus_relative"] | theirs["straggler_gpus_individual"]}
    assert {s.rank for s in ours} == expected == {1, 2}
    assert all(s.measure == "GPU" for s in ours)


def test_listing_names_worst_and_best_ranks_like_nvrx():
    relative = {0: 1.0, 1: 0.5, 2: 0.9, 3: 0.8, 4: 0.95, 5: 0.7}
    nodes = {r: f"n{r // 2}" for r in relative}
    assert format_scores("Rank relative performance", relative, nodes, count=1).splitlines() == [
        "Rank relative performance:",
        " Worst performing 1/6 ranks:", "  Rank=1 Node=n0 Score=0.50",
        " Best performing 1/6 ranks:", "  Rank=0 Node=n0 Score=1.00"]
    everyone = format_scores("Rank relative performance", relative, nodes, count=3).splitlines()
    assert everyone[1:3] == ["  Rank=1 Node=n0 Score=0.50", "  Rank=5 Node=n2 Score=0.70"]
    assert len(everyone) == 7  # at most 2 x count ranks: all of them, worst first



def _detector_args(**overrides) -> argparse.Namespace:
    values = dict(straggler_report_interval=2, straggler_minmax_count=1, straggler_relative_threshold=0.75,
                  straggler_individual_threshold=0.75, straggler_stop_if_detected=False,
                  disable_straggler_on_startup=False, straggler_ctrlr_port=free_loopback_port())
    values.update(overrides)
    return argparse.Namespace(**values)


def _model_chunk():
    """What the detector hooks into: a model chunk's config, whose finalize_model_grads_func the pipeline
    schedule calls when this rank's forward and backward work is done."""
    return SimpleNamespace(config=SimpleNamespace(finalize_model_grads_func=lambda *args, **kwargs: None))


def _iterations(detector, chunk, first: int, last: int) -> list:
    results = []
    for iteration in range(first, last + 1):
        detector.iteration_started()
        chunk.config.finalize_model_grads_func([chunk])  # as the schedule calls it after the backward pass
        results.append(detector.report(iteration))
    return results


def test_off_at_startup_until_switched_on_through_the_control_port(capsys, monkeypatch):
    monkeypatch.setattr(events, "_event_log_path", None)
    args = _detector_args(disable_straggler_on_startup=True)
    chunk = _model_chunk()
    detector = TimedRanks(args, [chunk])
    assert "straggler detection OFF" in capsys.readouterr().out
    _iterations(detector, chunk, 1, 2)
    assert detector.samples == [] and "straggler report" not in capsys.readouterr().out

    with socket.create_connection(("127.0.0.1", args.straggler_ctrlr_port)) as conn:
        conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert b"Will turn straggler detection ON at the next report" in conn.recv(1024)
    _iterations(detector, chunk, 3, 4)  # switched at the report of iteration 4, nothing to report yet
    assert "Toggling straggler detection ON" in capsys.readouterr().out
    assert _iterations(detector, chunk, 5, 6) == [None, None]  # one rank: never a straggler
    out = capsys.readouterr().out
    assert "straggler report at iteration 6 | MnRtt/Rnk:" in out
    assert "Rank relative performance:\n  Rank=0 Node=" in out and "Straggler report processing time:" in out


def test_without_log_straggler_nothing_is_timed_or_gathered():
    chunk = _model_chunk()
    finalize = chunk.config.finalize_model_grads_func
    detection = StragglerDetection.from_args(argparse.Namespace(log_straggler=False), [chunk])
    assert type(detection) is StragglerDetection and chunk.config.finalize_model_grads_func is finalize
    assert detection.report(100) is None


def test_bad_straggler_flags_end_in_one_line_naming_the_flag(capsys):
    base = [*launch.TINY_MODEL, "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
            "--mock-data", "--log-interval", "7"]
    assert parse_args([*base, "--log-straggler"], world_size=2).straggler_report_interval == 7
    for extra, flag in ((["--straggler-stop-if-detected", "--save", "x"], "--straggler-stop-if-detected"),
                        (["--log-straggler", "--straggler-stop-if-detected"], "--save"),
                        (["--straggler-relative-threshold", "1.5"], "--straggler-relative-threshold"),
                        (["--straggler-ctrlr-port", "0"], "--straggler-ctrlr-port")):
        with pytest.raises(SystemExit) as exited:
            parse_args([*base, *extra], world_size=2)
        assert exited.value.code == 2
        assert flag in capsys.readouterr().err


@pytest.mark.slow
def test_slow_rank_is_named_and_the_run_saves_and_stops_for_a_requeue(tmp_path):
    save = tmp_path / "ckpt"
    run = launch.run([*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "8", "--save", str(save),
                      # Reports are medians over 3 iterations: the first iteration's warm-up (seconds
                      # on a loaded machine, on every rank) cannot outweigh the slowness.
                      "--log-straggler", "--straggler-report-interval", "3", "--straggler-stop-if-detected",
                      "--inject-fault", "slow", "--inject-fault-iteration", "1", "--inject-fault-ranks", "1",
                      "--inject-fault-slow-secs", "0.5"])
    assert run.returncode == exit_codes.FINISHED, run.stdout[-3000:]
    out = run.stdout
    relative = re.search(r"Rank relative performance:\n((?:  Rank=.*\n)+)", out).group(1).splitlines()
    ranked = [(int(rank), float(value)) for rank, value in
              (re.search(r"Rank=(\d+) .*Score=(\S+)", line).groups() for line in relative)]
    assert ranked[0][0] == 1 and ranked[0][1] < 0.75, "the slow rank is listed first, the worst"
    assert ranked[-1] == (0, 1.0), "rank 0 is the best"
    assert re.search(r"straggler report at iteration 3 \| MnRtt/Rnk: \S+ms/0 \| MxRtt/Rnk: \S+ms/1 \|", out)
    assert "STRAGGLER DETECTION WARNING: Some ranks have worse relative performance. Affected ranks: [1]" \
        in out
    assert "[resil] straggler: rank 1 on " in out
    assert "saving and stopping (--straggler-stop-if-detected)" in out

    # Stopped at the first report: saved there, the tracker names it, the event log says requeue.
    assert layout.published_iterations(str(save)) == [3]
    log = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines()]
    flagged = [e for e in log if e["event"] == "straggler" and "rank" in e]
    assert [(e["rank"], e["iteration"]) for e in flagged] == [(1, 3)] and flagged[0]["relative_score"] < 0.75
    exit_event = next(e for e in log if e["event"] == "exit")
    assert exit_event["requeue"] is True and exit_event["exit_code"] == exit_codes.FINISHED
    verb, code, reason = requeue.decide(log, launcher_exit_code=0)
    assert (verb, code) == ("requeue", 0) and "straggler" in reason
