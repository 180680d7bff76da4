"""Data-parallel replicas must hold the same weights (--check-weight-hash-across-dp-replicas-interval). A bit
flipped for real in one replica's weights inside the running job (--inject-fault flip-weight) is one
decision line naming the ranks and the first differing weight, one `rerun` event, and the rerun mode's
answer: validate_results stops every rank before any save with exit 17; report_determinism_stats reports
and trains on."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from megatron_resil.checkpointing import layout
from megatron_resil.resilience.weight_hashes import Divergence, compare
from megatron_resil.tools import requeue
from tests import launch

HOST = socket.gethostname()
_RERUN = re.compile(r"\[resil\] rerun: (.*)")
# "[resil] fault: injecting flip-weight on rank 1 before iteration 4: bit 22 of element 9 of NAME, a -> b"
_FLIP = re.compile(r"injecting flip-weight on rank (\d+) before iteration (\d+): bit \d+ of element \d+ of "
                   r"(.+), \S+ -> \S+")


def _args(iters: int, interval: int, *extra: str) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(iters),
            "--check-weight-hash-across-dp-replicas-interval", str(interval), *extra]


# When one rank exits, torchrun sends SIGTERM to those still running; with the handler it is only recorded,
# so each rank's own exit code reaches torchrun's summary (a rank stuck in a collective would show -9).
OWN_EXIT = "--exit-signal-handler"


def _flip(rank: int, iteration: int) -> list[str]:
    return ["--inject-fault", "flip-weight", "--inject-fault-iteration", str(iteration),
            "--inject-fault-ranks", str(rank)]


def _events(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]


def _matches(out: str) -> list[int]:
    """The iterations after which Megatron-LM's line says the hashes matched."""
    return [int(i) for i in re.findall(r">>> Weight hashes match after (\d+) iterations\.\.\.", out)]


def _flipped_weight(out: str, rank: int, iteration: int) -> str:
    flip = _FLIP.search(out)
    assert flip and (int(flip.group(1)), int(flip.group(2))) == (rank, iteration), out[-3000:]
    assert ".layers.1." in flip.group(3)  # not the model's first weight: the line must find it
    return flip.group(3)


@pytest.mark.slow
def test_a_bit_flipped_on_one_of_two_replicas_stops_every_rank_unsaved_with_exit_17(tmp_path):
    """Flipped before iteration 4, found after it: the interval save of iteration 4 and the end-of-run
    save do not happen, the checkpoint of iteration 2 stays the newest, and the scripts stop."""
    root = tmp_path / "ckpt"
    out = launch.run(_args(6, 1, "--save", str(root), "--load", str(root), "--save-interval", "2", OWN_EXIT,
                           *_flip(1, 4)), timeout=180).stdout
    assert out.count("exitcode  : 17") == 2, out[-3000:]  # both ranks exited, each with 17
    weight = _flipped_weight(out, 1, 4)
    assert _matches(out) == [0, 1, 2, 3]
    lines = _RERUN.findall(out)
    assert lines == [f"iteration 4: weight hashes differ across data-parallel replicas: ranks 0 ({HOST}) and "
                     f"1 ({HOST}) disagree (two replicas: no majority says which is right); first differing "
                     f"weight: {weight}; the replicas no longer hold one model: nothing is saved, the newest "
                     "checkpoint stays the newest (resume from it once the devices named are checked); "
                     "exiting with code 17"]
    assert sorted(launch.losses(out)) == [1, 2, 3, 4]
    assert layout.published_iterations(str(root)) == [2]
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    log = _events(root)
    [decision] = [e for e in log if e["event"] == "rerun"]
    assert (decision["verdict"], decision["iteration"], decision["ranks"], decision["weights"]) == \
        ("weights-differ", 4, [0, 1], [weight])
    assert [(e["exit_code"], e["requeue"]) for e in log if e["event"] == "exit"] == [(17, False)]
    assert (root / ".injected_faults" / "flip-weight-iter4-rank1").is_file()  # once per job, as every fault
    assert [e["iteration"] for e in log if e["event"] == "save_published"] == [2]
    assert requeue.decide(log, launcher_exit_code=1)[:2] == ("stop", 17)


@pytest.mark.slow
def test_with_three_replicas_the_line_names_the_odd_one_out():
    out = launch.run(_args(3, 1, "--inject-fault-repeat", OWN_EXIT, *_flip(2, 2)), nproc=3,
                     timeout=240).stdout
    assert out.count("exitcode  : 17") == 3, out[-3000:]
    weight = _flipped_weight(out, 2, 2)
    assert _matches(out) == [0, 1]
    [line] = _RERUN.findall(out)
    assert line.startswith(f"iteration 2: weight hashes differ across data-parallel replicas: rank 2 "
                           f"({HOST}) is the odd one out (ranks 0, 1 agree); first differing weight: "
                           f"{weight}; the replicas no longer hold one model"), line


@pytest.mark.slow
def test_matching_hashes_are_logged_and_report_stats_reports_a_flip_and_trains_to_the_end(tmp_path):
    """Interval 2: the replicas match before training and after iteration 2; the flip before iteration 3
    is found after iteration 4, reported, and the run finishes."""
    root = tmp_path / "ckpt"
    run = launch.run(_args(4, 2, "--rerun-mode", "report_stats", "--save", str(root), "--load", str(root),
                           "--save-interval", "100", *_flip(0, 3)), timeout=180)
    assert run.returncode == 0, run.stdout[-3000:]
    weight = _flipped_weight(run.stdout, 0, 3)
    assert _matches(run.stdout) == [0, 2]
    assert _RERUN.findall(run.stdout) == [
        f"iteration 4: weight hashes differ across data-parallel replicas: ranks 0 ({HOST}) and 1 ({HOST}) "
        f"disagree (two replicas: no majority says which is right); first differing weight: {weight}; "
        "--rerun-mode report_determinism_stats: reported, training continues"]
    log = _events(root)
    assert [(e["verdict"], e["iteration"]) for e in log if e["event"] == "rerun"] == [("weights-differ", 4)]
    assert [e["iteration"] for e in log if e["event"] == "finished"] == [4]
    assert not [e for e in log if e["event"] == "exit"]


# ---- the decision from the gathered hashes (no processes) ------------------------------------------
_NAMES = ["embedding", "layer 1", "layer 2"]
_SAME = [b"a", b"b", b"c"]


def test_replicas_that_agree_are_no_divergence():
    assert compare([0, 1, 2], [_SAME, _SAME, _SAME], _NAMES) is None


def test_two_replicas_both_disagree_and_the_first_differing_weight_is_named():
    found = compare([4, 6], [_SAME, [b"a", b"b", b"x"]], _NAMES)
    assert found == Divergence((4, 6), (4, 6), False, "layer 2")
    assert found.describe({4: "n1", 6: "n2"}) == \
        "ranks 4 (n1) and 6 (n2) disagree (two replicas: no majority says which is right); first differing " \
        "weight: layer 2"


def test_the_majority_of_replicas_names_the_odd_ones_out():
    odd = [b"a", b"x", b"c"]
    assert compare([0, 1, 2, 3, 4], [_SAME, odd, _SAME, [b"y", b"b", b"c"], _SAME], _NAMES) == \
        Divergence((0, 1, 2, 3, 4), (1, 3), True, "embedding")
    one = compare([0, 2, 4], [_SAME, _SAME, odd], _NAMES)
    assert one.describe({0: "h", 2: "h", 4: "h"}) == "rank 4 (h) is the odd one out (ranks 0, 2 agree); " \
                                                     "first differing weight: layer 1"


def test_an_even_split_has_no_majority():
    found = compare([0, 1, 2, 3], [_SAME, _SAME, [b"x", b"b", b"c"], [b"x", b"b", b"c"]], _NAMES)
    assert found == Divergence((0, 1, 2, 3), (0, 1, 2, 3), False, "embedding")
    assert found.describe({}).startswith("ranks 0 (?), 1 (?), 2 (?), 3 (?) disagree with no majority")
