"""A launcher killed with SIGKILL takes its ranks with it: each rank notices within a second or so,
writes its exit record and stops, so no orphan trains on or writes the checkpoint directory. A save that
finishes after the launcher died is not published: the checkpointer asks the trainer first."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from megatron_resil.checkpointing import layout
from megatron_resil.checkpointing.global_tier import GlobalTier
from megatron_resil.checkpointing.tier import PublishWithheld
from megatron_resil.checkpointing.tracker import tracker_path
from tests import launch


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "ft_launcher"])
def test_ranks_stop_within_seconds_of_their_launcher_dying_and_leave_no_orphan(tmp_path, launcher):
    save = tmp_path / "ckpt"
    log = tmp_path / "run.log"
    args = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "100000", "--save", str(save),
            "--save-interval", "3", "--log-interval", "1"]
    if launcher == "torchrun":
        proc = launch.start(args, log_path=log)
    else:
        proc = launch.start_ft([*args, "--enable-ft-package"], log_path=log)
    try:
        deadline = time.monotonic() + 120
        while "successfully saved checkpoint from iteration       3" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        children = launch.children_of(proc.pid)  # the ranks, and under ft_launcher their rank monitors
        ranks = [pid for pid in children if b"LOCAL_RANK=" in Path(f"/proc/{pid}/environ").read_bytes()]
        assert len(ranks) == 2, children
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone, as an OOM killer would
        killed_at = time.monotonic()
        # The orphans stop by themselves: waited for as an event, the bound only a guard on a loaded host.
        while any(launch.alive(pid) for pid in children):
            alive = [pid for pid in children if launch.alive(pid)]
            kinds = {pid: "rank" if pid in ranks else Path(f"/proc/{pid}/cmdline").read_bytes()[:80]
                     for pid in alive}
            assert time.monotonic() - killed_at < 60, f"{kinds} still running without their launcher"
            time.sleep(0.1)
        # Nor anything else of this run: megatron-core's forked writers, caught mid-save, included.
        while leftovers := [pid for pid in _processes_mentioning(str(save)) if launch.alive(pid)]:
            assert time.monotonic() - killed_at < 60, f"{leftovers} outlived their rank"
            time.sleep(0.1)
    finally:
        for pid in [*launch.children_of(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)

    records = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "exit" and records[-1]["exit_code"] == 9, records[-3:]
    assert "the launcher (pid" in records[-1]["message"]
    # Whatever was published verifies; the tool names no leftover it could not explain.
    verify = launch.ckpt_tool("verify", save)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_save_written_after_the_launcher_died_is_withheld_for_the_trainer_and_never_published(tmp_path):
    """The trainer hands the tier launcher_watch.launcher_alive as `may_publish`; here it says no. The
    shards are on disk, yet nothing takes the iteration's name or the tracker: the save is raised to the
    trainer's loop, whose error path stops the rank with exit code 9, and the next run removes it."""
    root = str(tmp_path / "ckpt")
    tier = GlobalTier(root)
    tier.may_publish = lambda: False
    staging = layout.new_staging_dir(root, 5)
    os.makedirs(staging)
    Path(staging, "common.pt").write_bytes(b"the shards of iteration 5")
    with pytest.raises(PublishWithheld):
        tier.finish(staging, 5, {})
    assert layout.published_iterations(root) == []
    assert not os.path.exists(tracker_path(root))
    assert layout.leftovers(root)["staging"] == [staging]
