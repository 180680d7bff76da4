"""Hung ranks under NVRx's ft_launcher (--enable-ft-package), real processes on loopback.

The stories: a rank stopped with SIGSTOP is killed by its rank monitor within the step timeout,
ft_launcher restarts the worker group once, and the workers resume from the newest checkpoint with
exactly the losses of an uninterrupted run. A section the launcher does not configure is not opened
(NVRx would stop watching the rank). Timeouts calculated by a fast run are floored before they are used
or kept, and floored again when loaded, so a slower next run is not killed by them; heartbeats keep it
alive under heartbeat timeouts shorter than the run. Without ft_launcher, one line and exit code 2.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_resil.arguments import parse_args
from megatron_resil.progress import TrainProgress
from megatron_resil.resilience import fault_tolerance
from megatron_resil.resilience.fault_tolerance import STATE_FILE, floor_timeouts, merge_saved_timeouts

try:
    from tests import launch  # tests/ is a package
except ImportError:  # tests/ on sys.path instead
    import launch

TRAIN_ITERS = 10
COMMON = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--enable-ft-package"]
FLOOR = 60.0  # --ft-timeouts-floor-secs default
CHECK_EVERY = "0.5"  # --ft-workload-check-interval: how often a monitor looks at its rank
REFERENCE_FT = ("--ft-rank-section-timeouts", "setup:120,step:30",  # no checkpointing section, on purpose
                "--ft-workload-check-interval", CHECK_EVERY)


def _ft_lines(output: str, event: str = "ft") -> list[str]:
    return [line for line in output.splitlines() if line.startswith(f"[resil] {event}: ")]


def _events(save: Path, event: str) -> list[dict]:
    with open(save / "events.jsonl") as f:
        return [e for e in map(json.loads, f) if e["event"] == event]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """An uninterrupted fast run under ft_launcher that calculates and keeps timeouts (the reference
    losses for the restart test, and the source of ft_state.json for the slow run)."""
    save = tmp_path_factory.mktemp("reference") / "ckpt"
    result = launch.run_ft([*COMMON, "--train-iters", str(TRAIN_ITERS), "--save", str(save),
                            "--load", str(save), "--save-interval", "5", "--calc-ft-timeouts",
                            "--ft-num-warmup-iters", "2"], ft_args=REFERENCE_FT)
    return result, save


@pytest.mark.slow
def test_fast_run_with_unconfigured_section_completes_and_keeps_floored_timeouts(reference) -> None:
    result, save = reference
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert sorted(launch.losses(out)) == list(range(1, TRAIN_ITERS + 1))
    # The launcher has no `checkpointing` section: not opened (NVRx's checking task would die on the
    # unknown name), said once, with the option that fixes it; saves still happen.
    missing = [line for line in _ft_lines(out) if "'checkpointing'" in line]
    assert len(missing) == 1, _ft_lines(out)
    assert "--ft-rank-section-timeouts setup:600,step:180,checkpointing:420" in missing[0]
    # What covers the saves instead is the installed NVRx's default: NVRx 0.4 has heartbeat timeouts by
    # default, NVRx 0.7 none (and then the line says the rank is unmonitored in them).
    from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig
    defaults = FaultToleranceConfig()
    if defaults.rank_heartbeat_timeout is not None:
        assert f"the heartbeat timeout ({defaults.rank_heartbeat_timeout:g} s)" in missing[0]
    elif defaults.rank_out_of_section_timeout is None:
        assert "fall back to NOTHING: this rank is UNMONITORED while in them" in missing[0]
    assert "Unknown section" not in out and "KeyError" not in out and "Traceback" not in out
    assert "successfully saved checkpoint from iteration       5" in out
    # The heartbeat decision is logged once; the NIC monitor is off (the helper passes
    # --ft-enable-nic-monitor false; the monitor would log "Enable NIC health monitoring.").
    assert sum("NVRx does not count sections as heartbeats" in line for line in _ft_lines(out)) == 1
    assert "NIC health monitoring" not in out and "NIC monitor is on" not in out
    # Calculated step timeouts (a few tenths of a second here) are used and kept at the floor, never below.
    calculated = [line for line in _ft_lines(out) if "timeouts calculated" in line]
    assert calculated, _ft_lines(out)
    raw = [float(m) for m in re.findall(r"step ([\d.e+-]+) s -> 60 s", calculated[0])]
    assert raw and raw[0] < FLOOR, calculated[0]
    state = json.loads((save / STATE_FILE).read_text())["current_timeouts"]["section"]
    assert state["calculated_sections"] == ["step"]  # fresh start: no setup; no checkpointing section
    assert state["section"]["step"] == FLOOR
    assert not [p.name for p in save.iterdir() if ".tmp" in p.name]  # written atomically


@pytest.mark.slow
def test_slower_next_run_survives_low_persisted_timeouts_and_short_heartbeat_timeouts(reference, tmp_path):
    """ft_state.json as someone else may have left it: 7 ms calculated timeouts (what killed the next run
    in our reference). Loaded, they are floored; iterations of 1.5 s (far above the fast run's calculated
    step timeout, below the floor) complete. The heartbeat timeouts are shorter than the run, which
    survives only because the client heartbeats after set-up and iterations (NVRx does not count
    sections as heartbeats)."""
    _, reference_save = reference
    save = tmp_path / "ckpt"
    save.mkdir()
    state = json.loads((reference_save / STATE_FILE).read_text())
    section = state["current_timeouts"]["section"]
    section["section"] = {"setup": 0.007, "step": 0.007, "checkpointing": 0.007}
    section["calculated_sections"] = ["checkpointing", "setup", "step"]
    section["out_of_section"], section["is_out_of_section_calculated"] = 0.007, True
    (save / STATE_FILE).write_text(json.dumps(state))
    slow_secs, iters, heartbeat_timeout = 1.5, 12, 15
    result = launch.run_ft(
        [*COMMON, "--train-iters", str(iters), "--save", str(save), "--load", str(save),
         "--inject-fault", "slow", "--inject-fault-iteration", "1", "--inject-fault-ranks", "0,1",
         "--inject-fault-slow-secs", str(slow_secs)],
        ft_args=("--ft-rank-section-timeouts", "setup:120,step:30,checkpointing:120",
                 "--ft-workload-check-interval", CHECK_EVERY,
                 "--ft-initial-rank-heartbeat-timeout", "15",
                 "--ft-rank-heartbeat-timeout", str(heartbeat_timeout)))
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    loaded = [line for line in _ft_lines(out) if line.startswith("[resil] ft: loaded calculated timeouts")]
    assert len(loaded) == 1, _ft_lines(out)
    for name in ("setup", "step", "checkpointing", "out-of-section"):
        assert f"{name} 0.007 s -> 60 s" in loaded[0]
    assert max(launch.losses(out)) == iters
    assert "Did not get" not in out and "FT timeout elapsed" not in out  # the monitor never fired
    # What makes this test able to fail: the iterations alone outlast the heartbeat timeout.
    assert iters * slow_secs > heartbeat_timeout


def _workers(launcher_pid: int) -> dict[int, int]:
    """global rank -> pid of ft_launcher's worker processes (its direct children with a RANK)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = launch.proc_stat(int(entry.name))
            if stat is None or stat.parent != launcher_pid:
                continue
            environ = dict(kv.split("=", 1) for kv in (entry / "environ").read_text().split("\0")
                           if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in environ and "TORCHELASTIC_RESTART_COUNT" in environ:
            found[int(environ["RANK"])] = int(entry.name)
    return found


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, log.read_text()):
            return time.monotonic()
        assert proc.poll() is None, f"ft_launcher exited ({proc.returncode}) before {pattern!r}:\n" \
                                    f"{log.read_text()[-4000:]}"
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} within {timeout} s:\n{log.read_text()[-4000:]}")


def _kill_tree(pid: int) -> None:
    """SIGKILL ft_launcher and everything below it (on failure only; a passing run has ended)."""
    for child in {pid} | launch.descendants_of(pid):  # workers, their helpers, and the helpers' children
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_rank_stopped_with_sigstop_is_killed_and_restarted_workers_resume_exactly(reference, tmp_path):
    reference_losses = launch.losses(reference[0].stdout)
    save, log = tmp_path / "ckpt", tmp_path / "ft_launcher.log"
    step_timeout, max_restarts = 6, 2
    # Iterations of at least 0.5 s give the test time to stop rank 1 between the saves at iterations
    # 5 and 10; the two untimed warm-up iterations are the slow ones on a busy machine.
    proc = launch.start_ft(
        [*COMMON, "--train-iters", str(TRAIN_ITERS), "--save", str(save), "--load", str(save),
         "--save-interval", "5", "--ft-num-warmup-iters", "2",
         "--inject-fault", "slow", "--inject-fault-iteration", "1", "--inject-fault-ranks", "0,1",
         "--inject-fault-slow-secs", "0.5"],
        log, max_restarts=max_restarts,
        ft_args=("--ft-rank-section-timeouts", f"setup:120,step:{step_timeout},checkpointing:120",
                 "--ft-rank-out-of-section-timeout", "60", "--ft-workload-check-interval", CHECK_EVERY))
    try:
        _wait_for(log, r"iteration\s+7/", proc, timeout=180)
        workers = _workers(proc.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        detected_at = _wait_for(log, r"Section 'step' has been open", proc, timeout=60)
        returncode = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
    out = log.read_text()
    assert returncode == 0, out[-4000:]
    # Caught by the step section, within its timeout plus the monitor's check interval (and slack for
    # this test's polling on a busy machine).
    assert detected_at - stopped_at < step_timeout + 2 * float(CHECK_EVERY) + 3
    restarts = _ft_lines(out, "restart")
    assert restarts == [f"[resil] restart: worker group restart 1 of at most {max_restarts} (the launcher "
                        "restarted every rank after a failure); resuming from the newest checkpoint"]
    assert [(e["count"], e["max_restarts"]) for e in _events(save, "restart")] == [(1, max_restarts)]
    before, after = out.split(restarts[0])
    assert "(exitcode: -9)" in before  # the monitor's SIGCONT + SIGKILL, not some other failure
    saved = [int(n) for n in re.findall(r"successfully saved checkpoint from iteration\s+(\d+)", before)]
    assert saved, before[-4000:]
    assert re.search(rf"successfully loaded checkpoint from .* at iteration {saved[-1]} ", after)
    resumed = launch.losses(after)
    assert sorted(resumed) == list(range(saved[-1] + 1, TRAIN_ITERS + 1))
    assert resumed == {i: reference_losses[i] for i in resumed}  # exact continuation
    assert "successfully saved checkpoint from iteration      10" in after


def test_enable_ft_package_without_ft_launcher_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    result = launch.run_single([*COMMON, "--train-iters", "10", "--save", str(tmp_path / "ckpt")])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "--enable-ft-package" in lines[0] and "ft_launcher" in lines[0], lines
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("conf, key", [
    ("keep_alive_interval=0.5", "keep_alive_interval"),
    ("join_timeout=60,keep_alive_max_attempt=0", "keep_alive_max_attempt"),
])
def test_a_bad_keep_alive_in_rdzv_conf_is_one_line_and_exit_code_2(conf, key) -> None:
    """`python -m megatron_resil.launch.ft_launcher` (docs/drills.md, "The rendezvous keep-alive") checks
    torch's keep-alive keys before NVRx's launcher starts: whole numbers of at least 1."""
    result = subprocess.run([sys.executable, "-m", "megatron_resil.launch.ft_launcher", "--nnodes", "1",
                             "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-conf", conf,
                             launch.PRETRAIN, "--train-iters", "1"], env=launch.env(), cwd=launch.REPO,
                            timeout=60, capture_output=True, text=True)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"[resil] ft_launcher: --rdzv-conf {key}="), lines
    assert "at least 1" in lines[0]


@pytest.mark.parametrize("argv, names", [
    (["--calc-ft-timeouts"], ("--calc-ft-timeouts", "--enable-ft-package")),
    (["--enable-ft-package", "--calc-ft-timeouts", "--no-save"], ("--calc-ft-timeouts", "--save")),
    (["--enable-ft-package", "--ft-num-warmup-iters", "-1"], ("--ft-num-warmup-iters",)),
    (["--enable-ft-package", "--ft-timeouts-floor-secs", "0"], ("--ft-timeouts-floor-secs",)),
], ids=["calc-without-ft", "calc-without-save", "negative-warmup", "zero-floor"])
def test_bad_ft_flags_are_one_line_naming_the_flag(argv, names, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("FT_RANK_MONITOR_IPC_SOCKET", str(tmp_path / "rmon.socket"))  # as under ft_launcher
    save = [] if "--no-save" in argv else ["--save", str(tmp_path / "ckpt")]
    argv = [a for a in argv if a != "--no-save"]
    with pytest.raises(SystemExit) as exc:
        parse_args([*COMMON[:-1], "--train-iters", "10", *save, *argv], world_size=1)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert all(name in err for name in names), err


def test_without_enable_ft_package_every_hook_works_without_nvrx_fault_tolerance(monkeypatch) -> None:
    """Neither importing our module nor the default path imports NVRx's fault_tolerance (made
    unimportable here)."""
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext.fault_tolerance", None)
    module = importlib.reload(fault_tolerance)
    args = parse_args([*COMMON[:-1], "--train-iters", "10"], world_size=1)
    ft = module.FaultTolerance.from_args(args)
    ft.log_setup()
    ft.setup_done(resumed=False)
    with ft.step():
        pass
    assert ft.checkpointing(lambda progress: progress.iteration == 0, TrainProgress()) is True
    ft.close()
    assert type(ft) is module.FaultTolerance


class _Cfg:  # the two fields of NVRx's FaultToleranceConfig that merging reads
    rank_section_timeouts = {"setup": 600.0, "step": 180.0, "checkpointing": 420.0}
    rank_out_of_section_timeout = None


def test_a_7ms_persisted_timeout_is_floored_and_stale_configured_values_are_not_loaded() -> None:
    saved = {"current_timeouts": {
        "section": {"section": {"setup": 0.007, "step": 95.0, "checkpointing": 5.0, "old": 1.0},
                    "out_of_section": 0.5, "calculated_sections": ["setup", "step"],
                    "is_out_of_section_calculated": True},
        "heartbeat": {"initial": 0.007, "subsequent": 300.0, "were_calculated": True}}}
    state, notes = merge_saved_timeouts(saved, _Cfg, frozenset({"setup", "step", "checkpointing"}), FLOOR)
    section = state["current_timeouts"]["section"]
    # Calculated values: floored; checkpointing (configured, not calculated, when the file was written):
    # this launcher's 420 s, not the file's 5 s.
    assert section["section"] == {"setup": FLOOR, "step": 95.0, "checkpointing": 420.0}
    assert section["out_of_section"] == FLOOR and section["calculated_sections"] == ["setup", "step"]
    assert state["current_timeouts"]["heartbeat"] == {"initial": FLOOR, "subsequent": 300.0,
                                                      "were_calculated": True}
    assert "setup 0.007 s -> 60 s" in notes and "initial heartbeat 0.007 s -> 60 s" in notes
    # Applied to the client's own state before use and before persisting, too.
    floored, raised = floor_timeouts(saved, FLOOR)
    assert floored["current_timeouts"]["section"]["section"]["setup"] == FLOOR
    assert saved["current_timeouts"]["section"]["section"]["setup"] == 0.007  # a copy
    assert len(raised) == 3

