"""An I/O error while reading a checkpoint is the storage's, not the checkpoint's, until it persists:
every rank tries the candidate again together (after 1 s and 3 s); an error that goes away costs a
retry and nothing else, one that stays makes the loader skip the candidate without quarantining it and
load the next one. The errors are real EIOs from a FUSE filesystem (tests/flaky_fs.py) the checkpoint
is read through."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests import flaky_fs, launch

pytestmark = pytest.mark.slow


def _args(load, save, iters: int) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(iters), "--load", str(load),
            "--save", str(save), "--save-interval", "2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """iter_0000002 and iter_0000004, tracker at 4."""
    if (why := flaky_fs.unavailable()) is not None:
        pytest.skip(f"no FUSE here: {why}")
    root = tmp_path_factory.mktemp("trained") / "ckpt"
    result = launch.run(_args(root, root, 4))
    assert result.returncode == 0, result.stdout[-3000:]
    return root


def _mount_flaky(source, mountpoint, match: str, fail_reads: int, log, stall: bool = False):
    mountpoint.mkdir()
    proc = subprocess.Popen([sys.executable, flaky_fs.__file__, str(source), str(mountpoint),
                             "--match", match,
                             "--fail-reads", str(fail_reads), *(["--stall"] if stall else [])],
                            stderr=open(log, "w"))
    deadline = time.monotonic() + 30
    while not os.path.ismount(mountpoint):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return proc


def _unmount(proc, mountpoint) -> None:
    subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.mark.parametrize("fail_reads", [2, -1], ids=["transient", "persistent"])
def test_io_errors_on_load_are_retried_then_the_candidate_is_skipped_never_quarantined(trained, tmp_path,
                                                                                       fail_reads):
    mnt, save, fuse_log = tmp_path / "mnt", tmp_path / "ckpt", tmp_path / "flaky_fs.log"
    proc = _mount_flaky(trained, mnt, "/iter_0000004/__1_0.distcp", fail_reads, fuse_log)
    try:
        result = launch.run(_args(mnt, save, 6))
    finally:
        _unmount(proc, mnt)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert "Traceback" not in out
    eios = fuse_log.read_text().count("flaky_fs: EIO on read of /iter_0000004/__1_0.distcp")
    retries = [line for line in out.splitlines() if line.startswith("[resil] load: I/O error while")]
    assert retries and "OSError: [Errno 5] Input/output error" in retries[0], retries
    if fail_reads > 0:  # gone after a retry: the newest checkpoint is loaded after all
        assert eios == fail_reads
        assert 1 <= len(retries) <= 2
        assert "[resil] load: accepted persistent iteration 4" in out
        assert sorted(launch.losses(out)) == [5, 6]
    else:  # still there after three attempts: skipped, and the older one is loaded
        assert len(retries) == 2 and "attempt 3 of 3" in retries[1]
        skipped = f"[resil] load: skipped persistent iteration 4 ({mnt / 'iter_0000004'}): "
        assert skipped + "I/O errors persisted through 3 attempts" in out
        assert "not quarantined" in out and "rejected" not in out
        assert "[resil] load: accepted persistent iteration 2" in out
        assert sorted(launch.losses(out)) == [3, 4, 5, 6]
    assert sorted(p.name for p in trained.iterdir() if p.name.startswith("iter_")) == ["iter_0000002",
                                                                                       "iter_0000004"]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


def _read_by_one_rank_only(checkpoint) -> tuple[str, int]:
    """A shard file that one rank alone reads while verifying (its checksum is that rank's share of the
    manifest) and that holds no object item (every rank reads those: the common state is one), and that
    rank. Which shard file holds the object items depends on the megatron-core release (0.19 puts them
    all into rank 0's), so which rank stalls does too."""
    import json
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    with open(checkpoint / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own checkpoint
    with_objects = {s.relative_path for i, s in metadata.storage_data.items()
                    if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata)}
    files = sorted(json.loads((checkpoint / "resil_manifest.json").read_text())["files"])
    return next((name, position % 2) for position, name in enumerate(files)
                if name.endswith(".distcp") and name not in with_objects)


def _rank_of(pid: int) -> int:
    environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=")[1])


def test_sigterm_during_a_load_stalled_on_storage_ends_the_job(trained, tmp_path):
    """One rank's read never returns (a hung storage server) and the other waits for it in a collective,
    where no Python code runs. Slurm's SIGTERM reaches both: the waiting rank ends at once (exit 5, nothing
    to save, one line). Before, it waited as long as the storage did. The stalled rank sleeps in the
    kernel, where not even SIGKILL reaches it until the storage answers (here: its server is killed); then
    it ends the same way. The exit record is rank 0's, whichever of the two it is."""
    import json
    import signal

    from tests.test_exit_signal import _handles_sigterm, _rank_pids
    mnt, save, fuse_log = tmp_path / "mnt", tmp_path / "ckpt", tmp_path / "flaky_fs.log"
    log = tmp_path / "run.log"
    name, stalled_rank = _read_by_one_rank_only(trained / 'iter_0000004')
    stalled, waiting_rank = f"/iter_0000004/{name}", 1 - stalled_rank
    proc = _mount_flaky(trained, mnt, stalled, 0, fuse_log, stall=True)
    run = launch.start([*_args(mnt, save, 6), "--exit-signal-handler"], log_path=log)
    try:
        deadline = time.monotonic() + 120
        while "flaky_fs: stalling" not in fuse_log.read_text():
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        ranks = {_rank_of(pid): pid for pid in _rank_pids(run.pid)}
        assert sorted(ranks) == [0, 1] and all(_handles_sigterm(pid) for pid in ranks.values())
        time.sleep(1)  # the other rank reaches the collective that waits for the stalled one
        signalled = time.monotonic()
        for pid in ranks.values():  # as Slurm signals every process of the step
            os.kill(pid, signal.SIGTERM)
        while os.path.exists(f"/proc/{ranks[waiting_rank]}") and time.monotonic() - signalled < 60:
            time.sleep(0.1)
        waiting_rank_ended_after = time.monotonic() - signalled
    finally:
        proc.kill()  # the storage server goes: the stalled read fails and rank 1 can die
        _unmount(proc, mnt)
        try:
            run.wait(timeout=90)
        except subprocess.TimeoutExpired:
            for pid in _rank_pids(run.pid):
                os.kill(pid, signal.SIGKILL)
            run.kill()
    out = log.read_text()
    said = "[resil] exit: SIGTERM received while loading the checkpoint; nothing trained since"
    assert said in out, out[-3000:]
    assert waiting_rank_ended_after < 10, (waiting_rank, waiting_rank_ended_after, out[-3000:])
    exits = [json.loads(x) for x in (save / "events.jsonl").read_text().splitlines() if '"exit"' in x]
    assert exits and exits[-1]["exit_code"] == 5, exits
    assert not (save / "latest_checkpointed_iteration.txt").exists()
