"""Run the longest test files first.

N at a time (`--dist loadfile`, what scripts/test.sh does by default) hands whole files to the
workers in collection order. A long file handed out last leaves one worker busy while the others
idle, so the heaviest files are collected first: longest-first is the usual way to keep the queues
even. The weights are seconds per file from a three-at-a-time run (tests/README.md); a file not
listed keeps its place after them. Only the order changes,
never what runs.
"""

from __future__ import annotations

SECONDS_PER_FILE = {  # seconds per file, three at a time on a quiet machine, 2026-11-26 (stop 31's
    # profile, `--durations=0`; test_tokenizers and test_resume as after that stop's cuts)
    "test_node_loss_drill.py": 290, "test_slurm.py": 231, "test_resume.py": 220, "test_async_save.py": 216,
    "test_integrity.py": 149, "test_engine.py": 121, "test_megatron_lm_checkpoints.py": 106,
    "test_gpu_check.py": 104, "test_megatron_flags.py": 103, "test_exit_signal.py": 103,
    "test_tokenizers.py": 100, "test_rerun.py": 88, "test_disk_full.py": 86, "test_fault_injection.py": 83,
    "test_crash_consistency.py": 83, "test_resume_semantics.py": 82, "test_elastic.py": 82,
    "test_megatron_lm_layout.py": 76, "test_ft_launcher.py": 63, "test_untrusted_checkpoint.py": 58,
    "test_zarr_format.py": 56, "test_patches.py": 54, "test_megatron_integrity.py": 52,
    "test_local_tier.py": 52, "test_dist_ckpt_strictness.py": 52, "test_launcher_watch.py": 51,
    "test_load_io_errors.py": 47, "test_use_checkpoint_args.py": 45, "test_bf16.py": 43,
    "test_inprocess_restart.py": 38, "test_dir_lock.py": 37, "test_weight_hashes.py": 31,
    "test_non_persistent.py": 28, "test_launch_scripts.py": 27, "test_sample_based.py": 26,
    "test_safe_load.py": 21, "test_restart_phases.py": 15, "test_straggler.py": 14,
    "test_failing_fs_steps.py": 14, "test_data.py": 12, "test_gpu_path.py": 9, "test_zarr_strategy.py": 8,
    "test_real_data.py": 8, "test_install.py": 7,
    # The second lane only (Muon is there): its four resumes, estimated from a loaded run (590 s at a load
    # average of about 10 on 2 cores, 2026-11-28); the first lane skips them at once.
    "test_muon.py": 170,
    # Stop 41's, alone on a quiet host (2026-11-28): four runs of 3 processes and a reference.
    "test_warm_reserve.py": 110,
    # Stop 42's: seven runs of 3-5 processes and three references, about 380 s alone on lane 1 (2026-11-28);
    # stop 43 added two runs of 5 processes with their 4-rank references, stop 44 two more (about 75 s and
    # 40 s).
    "test_replica_recovery.py": 470,  # stop 46: the SIGSTOP test's hard timeout 90 s -> 20 s
    # Stop 44's: three processes of NVRx's Wrapper, about 45 s.
    "test_inprocess_lost_restart.py": 45, "test_abort_drill.py": 45, "test_group_timeouts.py": 20,
}


def pytest_collection_modifyitems(session, config, items):
    # sort() is stable: within a file, and among unlisted files, the collected order stays.
    items.sort(key=lambda item: -SECONDS_PER_FILE.get(item.path.name, 0))


# ---- ranks forked from a standby (megatron_resil/launch/standby.py) ------------------------------------
# Each test process starts one standby with the environment launch.env() gives every rank, and every rank
# the tests start hands itself to it: about half of a 2-rank launch's CPU is each rank importing torch, on
# 2 cores that is the suite's time. Ranks that cannot use it (another interpreter, PYTHONPATH or
# import-time environment, such as the C++ log level --inprocess-restart sets) say so and import for
# themselves.
# MEGATRON_RESIL_TEST_STANDBY=0 runs the suite without it, every rank importing for itself. Users' ranks
# start cold unless they ask for a standby, so the cold tier (tests marked `cold`: a resume after a rank
# is killed, a signal during a save) always runs that way; the Slurm tests start a standby inside the job,
# or none (tests/test_slurm.py).

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _standby(tmp_path_factory):
    if os.environ.get("MEGATRON_RESIL_TEST_STANDBY", "1") == "0":
        yield None
        return
    try:
        from tests.launch import REPO, env
    except ImportError:  # tests/ on sys.path instead
        from launch import REPO, env
    from megatron_resil.launch import standby

    name = f"tests-{os.getpid()}"
    log = tmp_path_factory.mktemp("standby") / "standby.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_resil.launch.standby", "--name", name],
                                env=env(), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    value = f"{name}@{proc.pid}"  # as a launcher's standby is named: the ranks check who holds the name
    deadline = time.monotonic() + 120
    while not standby.ping(value):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.exit(f"the tests' standby did not start: {log.read_text()[-2000:]}", returncode=1)
        time.sleep(0.1)
    os.environ[standby.ENV] = value
    try:
        yield value
    finally:
        os.environ.pop(standby.ENV, None)
        proc.terminate()  # it ends once its ranks have: a test's leftover rank must not hold the session
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(autouse=True)
def _cold_tier(request, monkeypatch):
    """A test marked `cold` starts its ranks without the tests' standby."""
    if request.node.get_closest_marker("cold") is not None:
        monkeypatch.delenv("MEGATRON_RESIL_STANDBY", raising=False)
