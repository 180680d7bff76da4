"""The collective-abort drill (megatron_resil/tools/abort_drill.py) on gloo: a rank left inside an all-reduce
whose peer was stopped and then killed gets out of it, the in-process layer's abort runs without error, and
the survivor forms a new group with a replacement on a fresh store namespace. With the peer still stopped
at the abort (a hung rank), only the abort can end the collective: on gloo, by shutting down the group's
connections (megatron_resil/group_connections.py). The GPU check runs the same drill on NCCL, where only
NCCL's abort ends the collective (two GPUs)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

try:
    from tests import launch  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch


@pytest.mark.compat  # NVRx's abort on the users' NVRx too
def test_the_survivor_of_a_collective_with_a_dead_peer_reforms_with_a_replacement(tmp_path):
    done = subprocess.run([sys.executable, "-m", "megatron_resil.tools.abort_drill", "--backend", "gloo",
                           "--workdir", str(tmp_path)], env=launch.env(), cwd=launch.REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["abort_error"] is None and result["sum_after_reforming"], result
    # On gloo the dead peer's closed socket is what ends the collective, with an error.
    assert result["hung_collective"].startswith("raised"), result
    assert result["exit_codes"] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.log", "rank1.log", "replacement.log"]


@pytest.mark.compat
def test_a_collective_with_a_stopped_peer_is_ended_by_the_abort_alone(tmp_path):
    """Rank 1 stays stopped until rank 0 is out of its all-reduce: before group_connections, gloo's abort()
    left it there (the drill then waited out its 300 s bound)."""
    done = subprocess.run([sys.executable, "-m", "megatron_resil.tools.abort_drill", "--backend", "gloo",
                           "--peer", "stopped", "--workdir", str(tmp_path)], env=launch.env(),
                          cwd=launch.REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["peer"] == "stopped" and result["abort_error"] is None, result
    assert result["hung_collective"] == "raised RuntimeError", result  # gloo's "Connection closed by peer"
    assert result["seconds_after_abort"] is not None  # the abort came first, then the collective ended
    assert result["sum_after_reforming"] and result["exit_codes"] == [0, 0]


@pytest.mark.compat
def test_a_collective_in_a_group_made_later_is_ended_by_the_abort_too(tmp_path):
    """As above, in a group made after the process group started (group_connections.new_group, as the
    local tier's replication groups are): before stop 49 its connections were not noted, and the abort
    left a replication blocked with a hung peer where it was."""
    done = subprocess.run([sys.executable, "-m", "megatron_resil.tools.abort_drill", "--backend", "gloo",
                           "--peer", "stopped", "--group", "later", "--workdir", str(tmp_path)],
                          env=launch.env(), cwd=launch.REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["group"] == "later" and result["abort_error"] is None, result
    assert result["hung_collective"] == "raised RuntimeError", result
    assert result["sum_after_reforming"] and result["exit_codes"] == [0, 0]


def test_nccl_without_two_gpus_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "megatron_resil.tools.abort_drill", "--backend", "nccl"],
                          env=launch.env(), cwd=launch.REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].startswith(
        "abort_drill: error: --backend nccl needs two GPUs; this machine has "), done.stderr
