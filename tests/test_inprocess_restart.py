"""--inprocess-restart: an exception on one rank restarts training on every rank inside the same processes,
from the newest checkpoint, and the run completes exactly as an uninterrupted one; restarts are bounded.

Real torchrun runs on loopback (2 ranks, gloo): an exception injected on rank 1 before iteration 5, with
checkpoints every 2 iterations. Three launches in all (the restarted run, its uninterrupted reference, and
a fault that strikes every attempt); the flag checks run in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_resil import exit_codes
from megatron_resil.arguments import parse_args
from megatron_resil.events import EVENT_LOG_NAME

try:
    from tests import launch  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch


def _args(save: Path, iters: int, *extra: str) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(iters),
            "--save", str(save), "--load", str(save), "--save-interval", "2", *extra]


def _events(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / EVENT_LOG_NAME).read_text().splitlines()]


def _named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["event"] == name]


def _nvrx_gpu_health_checks_left_out() -> list[str]:
    """The checks this NVRx adds of its own before a restart, all GPU ones (none in 0.4.1), where there is
    no CUDA; none where there is."""
    import torch
    from nvidia_resiliency_ext.inprocess import health_check

    if torch.cuda.is_available():
        return []
    return [name for name in ("ChainedGPUHealthCheck", "ChainedNVLHealthCheck", "ChainedNicHealthCheck")
            if hasattr(health_check, name)]


@pytest.mark.slow
def test_exception_on_one_rank_restarts_every_rank_in_the_same_processes_and_the_run_completes(tmp_path):
    save = tmp_path / "ckpt"
    run = launch.run(_args(save, 8, "--inprocess-restart", "--inject-fault", "exception",
                           "--inject-fault-iteration", "5", "--inject-fault-ranks", "1"))
    out = run.stdout
    assert run.returncode == 0, out[-4000:]
    assert "[resil] fault: injecting exception on rank 1 before iteration 5" in out

    # One restart, reported once by rank 0, naming the rank and its exception.
    restarts = [line for line in out.splitlines() if line.startswith("[resil] restart:")]
    assert len(restarts) == 1, restarts
    assert ("in-process restart 1 of at most 3: rank 1 raised RuntimeError: injected fault: exception on "
            "rank 1 at iteration 5; every rank trains again in the same processes") in restarts[0]
    events = _events(save)
    [restart] = _named(events, "restart")
    assert (restart["count"], restart["kind"], restart["failed_ranks"]) == (1, "inprocess", [1])

    # The same processes: every attempt starts in the processes torchrun started first.
    [setup] = _named(events, "inprocess")
    assert len(set(setup["pids"])) == 2 and restart["pids"] == setup["pids"]
    # NVRx's own GPU checks before a restart (NVRx >= 0.5) cannot run without a GPU: left out, and said so.
    assert setup["health_checks_left_out"] == _nvrx_gpu_health_checks_left_out(), setup
    assert ("no CUDA here" in setup["message"]) == bool(setup["health_checks_left_out"]), setup["message"]
    starts = _named(events, "start")
    assert len(starts) == 2 and starts[0]["pid"] == starts[1]["pid"] == setup["pids"][0]

    # The second attempt loaded iteration 4 and trained 5..8, never repeating an iteration it had done.
    after = out.split(restarts[0], 1)[1]
    assert "successfully loaded checkpoint from" in after and "at iteration 4 " in after
    assert [e["iteration"] for e in _named(events, "loaded")] == [4]
    assert sorted(launch.losses(after)) == [5, 6, 7, 8]
    assert _named(events, "finished")[-1]["iteration"] == 8

    # Exactly the uninterrupted run's losses and grad norms, every iteration.
    reference = launch.run(_args(tmp_path / "reference", 8))
    assert reference.returncode == 0, reference.stdout[-4000:]
    expected = launch.losses(reference.stdout)
    assert launch.losses(after) == {i: expected[i] for i in (5, 6, 7, 8)}
    assert launch.losses(out.split(restarts[0], 1)[0]) == {i: expected[i] for i in (1, 2, 3, 4)}


@pytest.mark.slow
def test_a_fault_that_strikes_every_attempt_exhausts_max_iterations_and_exits_8(tmp_path):
    save = tmp_path / "ckpt"
    run = launch.run(_args(save, 3, "--inprocess-restart", "--inprocess-max-iterations", "2",
                           "--inject-fault", "exception", "--inject-fault-iteration", "2",
                           "--inject-fault-ranks", "1", "--inject-fault-repeat"))
    out = run.stdout
    assert run.returncode != 0
    assert "exitcode  : 8" in out, out[-4000:]  # torchrun's summary (it may end the other rank first)
    assert out.count("[resil] restart: in-process restart 1 of at most 1: rank 1 raised RuntimeError") == 1
    assert "[resil] restart: in-process restart 2" not in out
    assert ("[resil] inprocess: all 2 attempts allowed by --inprocess-max-iterations failed; the last "
            "failure: rank 1 raised RuntimeError: injected fault") in out
    exits = _named(_events(save), "exit")
    assert [e["exit_code"] for e in exits] == [exit_codes.UNRECOVERABLE]  # what the launch scripts read
    assert "finished" not in {e["event"] for e in _events(save)}


def _parse(tmp_path: Path, *extra: str, world_size: int = 2):
    return parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                       "--seq-length", "32", "--max-position-embeddings", "32", "--tokenizer-type",
                       "NullTokenizer", "--vocab-size", "128", "--micro-batch-size", "2", "--train-iters",
                       "10", "--lr", "1e-3", "--mock-data", "--save", str(tmp_path), *extra],
                      world_size=world_size)


def test_flags_have_megatrons_defaults(tmp_path):
    args = _parse(tmp_path, "--inprocess-restart")
    assert args.inprocess_restart and args.inprocess_max_iterations == 4  # bounded: ours, not Megatron's
    assert (args.inprocess_soft_timeout, args.inprocess_hard_timeout, args.inprocess_barrier_timeout,
            args.inprocess_completion_timeout) == (60, 90, 120, 120)
    assert (args.inprocess_heartbeat_interval, args.inprocess_heartbeat_timeout) == (30, 60)
    assert (args.inprocess_monitor_thread_interval, args.inprocess_monitor_process_interval,
            args.inprocess_progress_watchdog_interval) == (1.0, 1.0, 1.0)
    assert (args.inprocess_last_call_wait, args.inprocess_termination_grace_time) == (1, 1)
    assert args.inprocess_granularity == "node" and args.inprocess_active_world_size == 2
    assert not args.inprocess_empty_cuda_cache


@pytest.mark.parametrize("extra, names", [
    (("--inprocess-soft-timeout", "90"), ("--inprocess-soft-timeout (90)", "--inprocess-hard-timeout (90)")),
    (("--inprocess-hard-timeout", "200"), ("--inprocess-hard-timeout (200)", "--inprocess-barrier-timeout")),
    (("--inprocess-heartbeat-interval", "60"), ("--inprocess-heartbeat-interval (60)",)),
    (("--inprocess-max-iterations", "0"), ("--inprocess-max-iterations must be >= 1",)),
    (("--inprocess-last-call-wait", "-1"), ("--inprocess-last-call-wait must be >= 0",)),
    (("--inprocess-active-world-size", "3"), ("--inprocess-active-world-size 3", "world size (2)")),
])
def test_bad_inprocess_flags_end_in_one_line_and_exit_2(tmp_path, capsys, extra, names):
    with pytest.raises(SystemExit) as exc:
        _parse(tmp_path, "--inprocess-restart", *extra)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pretrain.py: error: ")
    assert all(name in err[0] for name in names), err[0]


def test_inprocess_restart_nests_inside_the_ft_package_as_in_megatron(tmp_path, monkeypatch):
    """Accepted together (their runs: tests/test_warm_reserve.py's ladder, tests/test_replica_recovery.py)."""
    monkeypatch.setenv("FT_RANK_MONITOR_IPC_SOCKET", str(tmp_path / "socket"))  # as under ft_launcher
    args = _parse(tmp_path, "--inprocess-restart", "--enable-ft-package")
    assert args.inprocess_restart and args.enable_ft_package


def test_without_the_flag_nvrx_inprocess_is_never_imported():
    # A fresh interpreter: pretrain.py's path without --inprocess-restart (its arguments, the patches they
    # ask for, as pretrain.py installs them), all of training imported.
    argv = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "4"]
    probe = (f"import sys; sys.argv = ['pretrain.py', *{argv!r}]; import pretrain; "
             "from megatron_resil import patches; patches.install(pretrain.parse_args()); "
             "import megatron_resil.training; "
             "print(sorted(m for m in sys.modules if m.startswith('nvidia_resiliency_ext.inprocess') "
             "or m == 'megatron_resil.resilience.inprocess_restart'))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=launch.REPO, env=launch.env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
