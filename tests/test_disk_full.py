"""A full disk during a save ends the job cleanly: one [resil] line with the cause and exit 4 on every
rank, an exit record, the staging directory removed, the previous checkpoint and the tracker intact, and
no torn line left in the event log. The disk is a real tmpfs mounted for the test, filled for real
(bytes, or inodes)."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess

import pytest

from tests import launch

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    launch.mount_tmpfs(disk, "size=16m,nr_inodes=400")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _args(save, iters: int) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--use-distributed-optimizer", "--train-iters",
            str(iters), "--save", str(save), "--load", str(save), "--save-interval", "2"]


def _fill_bytes(disk) -> None:
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for size in (65536, 4096, 1):  # down to the last byte
            while True:
                os.write(fd, b"\0" * size)
    except OSError as err:
        assert err.errno == errno.ENOSPC
    finally:
        os.close(fd)
    stat = os.statvfs(disk)
    assert stat.f_bavail * stat.f_frsize < 65536


def _fill_inodes(disk) -> None:
    (disk / "inodes").mkdir()
    n = 0
    try:
        while True:
            (disk / "inodes" / str(n)).touch()
            n += 1
    except OSError as err:
        assert err.errno == errno.ENOSPC
    for k in range(3):  # room for the staging directory and a file or two, not for a checkpoint
        (disk / "inodes" / str(n - 1 - k)).unlink()


@pytest.mark.parametrize("fill", [_fill_bytes, _fill_inodes], ids=["bytes", "inodes"])
def test_a_full_disk_during_a_save_exits_4_everywhere_and_keeps_the_previous_checkpoint(small_disk, fill):
    save = small_disk / "ckpt"
    first = launch.run(_args(save, 4))
    assert first.returncode == 0, first.stdout[-3000:]
    fill(small_disk)

    result = launch.run(_args(save, 6))
    out = result.stdout
    assert result.returncode != 0
    root, codes = launch.failure_codes(out)  # 4; a rank torchrun ended once another had failed: -15
    assert root == 4 and codes <= {4, -15}, out[-3000:]
    exits = [line for line in out.splitlines() if line.startswith("[resil] exit:")]
    assert len(exits) == 1 and "No space left on device" in exits[0] and "exiting with code 4" in exits[0], \
        out[-3000:]
    no_rank_traceback = f'File "{launch.REPO}/megatron_resil' not in out and \
        "site-packages/megatron/" not in out
    assert no_rank_traceback
    assert not [p for p in os.listdir(save) if p.startswith(".tmp_iter")]  # the staging directory went
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    records = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines()]  # none torn
    assert records[-1]["event"] == "exit" and records[-1]["exit_code"] == 4, records[-1]

    os.remove(small_disk / "filler") if (small_disk / "filler").exists() else None
    verify = launch.ckpt_tool("verify", save)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_async_saves_on_a_full_disk_are_dropped_until_too_many_fail_in_a_row_then_exit_4(small_disk):
    save = small_disk / "ckpt"
    first = launch.run(_args(save, 4))
    assert first.returncode == 0, first.stdout[-3000:]
    _fill_bytes(small_disk)

    result = launch.run([*_args(save, 40), "--async-save", "--save-interval", "1",
                         "--async-save-max-failures", "3"])
    out = result.stdout
    dropped = [line for line in out.splitlines()
               if line.startswith("[resil] save: async save of persistent")]
    assert len(dropped) == 2 and all("training continues" in line for line in dropped), out[-4000:]
    exits = [line for line in out.splitlines() if line.startswith("[resil] exit:")]
    assert len(exits) == 1 and "3 async saves in a row failed" in exits[0], exits
    assert "exiting with code 4" in exits[0]
    root_cause = re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", out, re.DOTALL)
    assert root_cause and int(root_cause.group(1)) == 4, out[-3000:]
    assert launch.losses(out)  # it trained between the failed saves
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert not [p for p in os.listdir(save) if p.startswith(".tmp_iter")]
