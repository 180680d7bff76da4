"""NVRx's in-process Wrapper restarts a rank whose function raised by raising RankShouldRestart into its
training thread from the monitor thread. Once in CI (stop 43) that exception never arrived: the Wrapper ended
the process with InternalError, and the job with it, where a restart was due. patches/nvrx.py raises it
again. The failure is injected for real: NVRx's own monitor thread raises the exception into the training
thread, and it is consumed on its way."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

try:
    from tests import launch  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch

_SCRIPT = textwrap.dedent("""
    import datetime, sys, time
    from megatron_resil.patches import nvrx, registry
    guarded, lose = sys.argv[1] == "guarded", sys.argv[2] == "lose"
    # as pretrain.py installs them under --inprocess-restart: NVRx 0.5+ checks a GPU before each restart
    registry.install(only=(nvrx.NO_GPU_HEALTH_CHECKS, *([nvrx.RESTART_LOST] if guarded else [])))
    from nvidia_resiliency_ext import inprocess
    from nvidia_resiliency_ext.inprocess import monitor_thread, progress_watchdog
    from megatron_resil.resilience import inprocess_restart

    spin_till_paused = progress_watchdog.ProgressWatchdog.spin_till_paused

    def spin_losing_the_restart(self):
        # the monitor thread pauses the watchdog, then raises RankShouldRestart into this thread: it
        # arrives here and goes no further
        try:
            spin_till_paused(self)
            while True:
                time.sleep(0.001)
        except monitor_thread.RankShouldRestart:
            print("the restart was consumed", flush=True)

    if lose:
        progress_watchdog.ProgressWatchdog.spin_till_paused = spin_losing_the_restart

    def train(call_wrapper: inprocess.CallWrapper = None) -> int:
        if call_wrapper.iteration == 0:
            raise RuntimeError("the first attempt fails")
        print(f"attempt {call_wrapper.iteration} ran to the end", flush=True)
        return 0

    interval = datetime.timedelta(seconds=0.1)
    sys.exit(inprocess.Wrapper(
        abort=inprocess_restart.ReleaseProcessGroups(), health_check=None,
        initialize=inprocess.initialize.RetryController(max_iterations=2),
        monitor_thread_interval=interval, monitor_process_interval=interval,
        progress_watchdog_interval=interval, last_call_wait=interval,
        soft_timeout=datetime.timedelta(seconds=60), hard_timeout=datetime.timedelta(seconds=90),
    )(train)())
""")
_LINE = "[resil] inprocess: rank 0: NVRx's restart signal to the training thread never arrived"


def _run(guarded: bool, lose: bool) -> subprocess.CompletedProcess:
    port = launch.free_loopback_port()  # for the Wrapper's store
    env = {**launch.env(standby=False), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "1", "MASTER_PORT": str(port)}
    return subprocess.run([sys.executable, "-c", _SCRIPT, "guarded" if guarded else "bare",
                           "lose" if lose else "keep"], cwd=launch.REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_without_the_patch_a_lost_restart_ends_the_process_with_nvrxs_internal_error():
    done = _run(guarded=False, lose=True)
    out = done.stdout + done.stderr
    assert "the restart was consumed" in out, out[-3000:]
    assert done.returncode != 0 and "InternalError" in out, out[-3000:]  # as in CI, stop 43
    assert "ran to the end" not in out


@pytest.mark.parametrize("lose", [True, False], ids=["lost", "arrived"])
def test_a_lost_restart_is_raised_again_and_the_next_attempt_runs(lose):
    done = _run(guarded=True, lose=lose)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "attempt 1 ran to the end" in out, out[-3000:]
    assert "InternalError" not in out, out[-3000:]
    # said once, and only when it was lost
    assert out.count(_LINE) == (1 if lose else 0), out[-3000:]
