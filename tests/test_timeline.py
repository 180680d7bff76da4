"""The run timeline: an event log of several attempts becomes a summary of what the failures cost and
a picture an operator can read at a glance; a torn or odd log never stops it."""

from __future__ import annotations

import json
import struct

import pytest

from megatron_resil.tools import timeline

T0 = 1_800_000_000.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _event(at: float, event: str, **fields) -> dict:
    """An event `at` seconds into the run, as events.record writes it."""
    return {"unix": T0 + at, "time": f"t+{at:g}s", "event": event, "host": "node1", "pid": 1, **fields}


def _progress(at: float, iteration: int) -> dict:
    return _event(at, "progress", iteration=iteration, loss=5.0, grad_norm=1.0)


def _saved(at: float, tier: str, iteration: int, seconds: float) -> list[dict]:
    """A synchronous save: started at `at`, published `seconds` later."""
    return [_event(at, "save_started", tier=tier, iteration=iteration, asynchronous=False),
            _event(at + seconds, "save_published", tier=tier, iteration=iteration, path=f"{tier}/{iteration}",
                   seconds=seconds)]


def _write_log(path, events: list[dict], torn_tail: str = "") -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + torn_tail)


def _killed_then_resumed_from_an_older_checkpoint() -> list[dict]:
    """Attempt 1 trains to 50 and is killed; attempt 2 rejects (and quarantines) the newest local
    checkpoint, resumes from persistent 20, gets past 50 at t=146 s and finishes at 70."""
    first = [_event(0, "start", world_size=2, train_iters=70, load="ckpt"),
             _event(1, "load", message="no checkpoint under --load ckpt; starting from scratch"),
             _progress(10, 10), _progress(20, 20), *_saved(20.5, "persistent", 20, 1.5),
             _progress(32, 30), *_saved(32.1, "local", 30, 0.9),
             _progress(43, 40), *_saved(43.1, "local", 40, 0.9),
             _progress(54, 50),
             _event(54.5, "fault_injected", kind="kill", iteration=51, rank=0)]
    second = [_event(100, "start", world_size=2, train_iters=70, load="ckpt"),
              _event(101, "cleanup", message="removed ckpt/.tmp_iter_0000060_x: leftover of a save"),
              _event(105, "load", message="rejected local iteration 40: rank 1's shard has no verified copy",
                     verdict="rejected", tier="local", iteration=40, reason="no verified copy"),
              _event(105.5, "quarantine", message="local iteration 40 set aside", tier="local", iteration=40),
              _event(106, "load", message="accepted persistent iteration 20", verdict="accepted",
                     tier="persistent", iteration=20, path="ckpt/iter_0000020"),
              _event(106.2, "loaded", tier="persistent", iteration=20, path="ckpt/iter_0000020"),
              _progress(116, 30), _progress(126, 40),
              _event(130, "straggler", rank=1, message="rank 1 is 3x slower"),  # events this tool predates
              _event(131, "ft", message="heartbeat timeout raised to 300 s"),
              _progress(136, 50), _progress(146, 60), *_saved(146.2, "persistent", 60, 1.8),
              _progress(158, 70), *_saved(158.2, "persistent", 70, 1.8),
              _event(161, "finished", iteration=70, exit_code=0)]
    return first + second


def test_killed_run_resumed_from_an_older_checkpoint_costs_30_iterations_and_92_seconds(tmp_path, capsys):
    log = tmp_path / "events.jsonl"
    torn = '{"event": "progress", "unix": 18'  # the writer was killed mid-line
    _write_log(log, _killed_then_resumed_from_an_older_checkpoint(), torn_tail=torn)

    assert timeline.main([str(tmp_path)]) == 0

    tl = timeline.analyse(*timeline.read_events(str(log)))
    assert tl.skipped_lines == 1
    first, second = tl.attempts
    assert (first.loaded, first.reached) == ("from scratch", 50)
    assert first.ending == "no end event (killed or lost)"
    assert (second.loaded, second.reached, second.ending) == ("persistent@20", 70, "finished")
    assert second.recomputed == 30 == tl.recomputed  # 21..50 trained twice
    assert second.lost_s == pytest.approx(146 - 54) == tl.lost_s  # last new iteration 50 -> first past it
    assert tl.wall_s == pytest.approx(161)
    out = capsys.readouterr().out
    assert "attempts: 2 (1 restart(s)); total wall time 2.7 min; highest iteration 70" in out
    assert "1 unreadable line(s) skipped" in out
    assert "iterations recomputed: 30; wall time lost: 92.0 s" in out
    assert "saves published: local 2, persistent 3; save failures: 0" in out
    assert "load rejections: 1; quarantines: 1; canary trips: 0; faults injected: kill@51" in out
    assert "other events: cleanup 1, ft 1, straggler 1" in out
    _assert_png(tmp_path / "timeline.png")


def test_the_picture_has_a_line_per_attempt_marks_and_the_lost_time_shaded(tmp_path):
    log = tmp_path / "events.jsonl"
    _write_log(log, _killed_then_resumed_from_an_older_checkpoint())
    fig = timeline.draw(timeline.analyse(*timeline.read_events(str(log))), "run")
    ax = fig.axes[0]
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels[:2] == ["progress, attempt 1", "progress, attempt 2"]
    for mark in ("saved (persistent)", "saved (local)", "load rejected", "load accepted", "quarantine",
                 "fault injected", "died (no end event)", "finished", "hang / straggler", "other: ft",
                 "wall time lost", "attempt start"):
        assert mark in labels
    attempt_two = ax.lines[[line.get_label() for line in ax.lines].index("progress, attempt 2")]
    assert list(attempt_two.get_ydata())[:2] == [20, 30]  # drawn from its resume point on


def test_a_restarts_phases_are_stacked_segments_in_the_picture_and_summed_in_the_summary(tmp_path):
    """Attempt 2 recorded its way from the kill at 54.5 s to its first iteration at 116 s; the launcher's
    decision was not in its log, so detection runs to the next measured boundary."""
    from megatron_resil.resilience import restart_phases

    events = _killed_then_resumed_from_an_older_checkpoint()
    offsets = [54.5, None, None, 92.0, 97.0, 99.5, 102.0, 105.8, 106.2, 107.0, 116.0]
    marks = {name: None if at is None else T0 + at
             for name, at in zip(restart_phases.BOUNDARIES, offsets, strict=True)}
    record = _event(116.0, "restart_phases", kind="in-job restart", marks=marks, seconds=116.0 - 54.5,
                    phases=restart_phases.phases_between(marks))
    events.insert(next(i for i, e in enumerate(events) if e["event"] == "progress" and e["unix"] == T0 + 116),
                  record)
    _write_log(tmp_path / "events.jsonl", events)
    tl = timeline.analyse(*timeline.read_events(str(tmp_path / "events.jsonl")))
    segments = timeline.phase_segments(tl)
    assert [(phase, begin - T0) for phase, begin, _, _ in segments][:3] == [
        ("detection", 54.5), ("imports", 92.0), ("rendezvous", 97.0)]
    assert sum(seconds for _, _, seconds, _ in segments) == pytest.approx(116.0 - 54.5)
    assert ("restart phases over 1 restart(s), fault to first iteration: detection 37.5 s (61%), "
            "first_iteration 9.0 s (15%), imports 5.0 s (8%)") in timeline.summary(tl, "run")
    ax = timeline.draw(tl, "run").axes[0]
    labels = ax.get_legend_handles_labels()[1]
    drawn = [label for label in labels if label.startswith("restart phase: ")]
    assert drawn == [f"restart phase: {phase}" for phase in restart_phases.PHASES
                     if phase not in ("teardown", "spawn")]  # merged into detection: not drawn apart
    assert "other: restart_phases" not in labels


def test_two_failures_in_a_row_are_one_interruption_and_a_canary_reload_recomputes(tmp_path):
    """Attempt 2 resumes from 20 and dies at 40, short of 50: its time is lost too, charged to attempt
    3, which resumes from local 40, trips the canary at 45, falls back to 20 in the same job and gets
    past 50 at t=400 s."""
    events = [_event(0, "start"), _progress(50, 50),
              _event(100, "start"), _event(101, "loaded", tier="persistent", iteration=20),
              _progress(140, 40), _event(141, "save_published", tier="local", iteration=40),
              _event(200, "start"), _event(201, "loaded", tier="local", iteration=40), _progress(250, 45),
              _event(251, "canary", message="nan loss", tier="local", iteration=40, reason="nan loss"),
              _event(252, "loaded", tier="persistent", iteration=20),
              _progress(400, 55), _event(401, "exit", message="--exit-interval", iteration=55, exit_code=0)]
    _write_log(tmp_path / "events.jsonl", events)
    tl = timeline.analyse(*timeline.read_events(str(tmp_path / "events.jsonl")))
    assert [a.recomputed for a in tl.attempts] == [0, 20, 5 + 30]  # 21..40; 41..45, then 21..50
    assert [a.lost_s for a in tl.attempts] == [0, 0, pytest.approx(400 - 50)]
    assert tl.attempts[2].loaded == "local@40, then persistent@20"
    assert tl.attempts[2].ending == "exit 0"
    assert "canary trip" in timeline.draw(tl, "run").axes[0].get_legend_handles_labels()[1]


def test_a_log_file_path_draws_beside_it_and_summary_only_draws_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    _write_log(run / "events.jsonl", _killed_then_resumed_from_an_older_checkpoint())
    assert timeline.main([str(run / "events.jsonl"), "--summary-only"]) == 0
    assert not (run / "timeline.png").exists()
    assert timeline.main([str(run / "events.jsonl")]) == 0
    _assert_png(run / "timeline.png")
    assert timeline.main([str(run), "--out", str(tmp_path / "elsewhere.png")]) == 0
    _assert_png(tmp_path / "elsewhere.png")
    capsys.readouterr()


def test_a_missing_or_unreadable_log_or_unwritable_out_is_one_line_and_exit_code_2(tmp_path, capsys):
    assert timeline.main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(tmp_path / "nowhere") in err
    (tmp_path / "events.jsonl").write_text("not json\n")
    assert timeline.main([str(tmp_path)]) == 2
    assert "holds no readable event (1 unreadable line(s))" in capsys.readouterr().err
    _write_log(tmp_path / "events.jsonl", [_event(0, "start")])
    assert timeline.main([str(tmp_path), "--out", str(tmp_path / "no_such_dir" / "t.png")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_progress_values_are_strict_json_even_when_nan():
    from megatron_resil.train_log import json_safe  # imports torch: only this test pays for it

    record = {"loss": json_safe(float("nan")), "grad_norm": json_safe(float("inf")), "ok": json_safe(1.5)}
    assert json.loads(json.dumps(record, allow_nan=False)) == {"loss": "nan", "grad_norm": "inf", "ok": 1.5}


def _not_json(constant: str) -> None:
    raise AssertionError(f"{constant} is not JSON")


def _assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width > 1000 and height > 500
    assert len(data) > 30_000, "a figure with lines, marks and a legend is not this small"
