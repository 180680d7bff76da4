"""The GPU check (scripts/gpu_check.sh) cannot rot: its dry run, every step a CPU can run, passes here on
gloo with a tiny GPT, on both lanes (the GPU machine runs megatron-core 0.19 and NVRx 0.7), an async save
killed with SIGKILL resuming exactly among them, while the steps that need CUDA say so; its argument errors
and the wheel fetcher's size refusal are one line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from megatron_resil.tools.gpu_check import __main__ as gpu_check
from megatron_resil.tools.gpu_check import install
from megatron_resil.tools.gpu_check.context import Check, Failed, Skipped
from megatron_resil.tools.gpu_check.profiles import DRY_RUN
from megatron_resil.tools.gpu_check.runs import Launcher
from tests import launch

FETCH = launch.REPO / "scripts" / "fetch_gpu_wheels.sh"
CPU_STEPS = ["train", "save_sync_persistent", "save_async_persistent", "save_sync_local", "save_async_local",
             "async_stall_ratio", "step_time_ratio", "kill9_async_resume", "inprocess_restart", "straggler",
             "rerun_nan"]
CUDA_STEPS = ["collective_abort", "straggler_gpu", "standby", "transformer_engine"]
_HANG_GUARD_S = 2400


@pytest.mark.slow
@pytest.mark.compat
def test_the_dry_run_passes_every_step_a_cpu_can_run_and_marks_the_cuda_ones_skipped(tmp_path):
    out = tmp_path / "results"
    # The dry run's own budget (600 s) would race this host's load: stop 40's CI ran out of it before the
    # last step (rerun_nan, "skipped: out of time"). Here the budget guards against a hang only.
    done = subprocess.run(["bash", str(launch.REPO / "scripts" / "gpu_check.sh"), "--dry-run", str(out),
                           "--budget-s", str(_HANG_GUARD_S)],
                          env={**launch.env(), "PYTHON": sys.executable}, cwd=launch.REPO,
                          timeout=_HANG_GUARD_S + 300,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results = json.loads((out / "results.json").read_text())
    steps = {s["name"]: s for s in results["steps"]}
    failed = {name: s["reason"] for name, s in steps.items() if s["status"] == "failed"}
    assert done.returncode == 0 and not failed, f"{failed}\n{done.stdout[-3000:]}"
    assert results["mode"] == "dry-run" and list(steps) == ["install", *gpu_check.STEPS]
    assert [name for name in CPU_STEPS if steps[name]["status"] != "passed"] == []
    for name in CUDA_STEPS:
        assert (steps[name]["status"], steps[name]["reason"]) == ("skipped", "needs CUDA"), steps[name]
    assert steps["install"]["status"] == "skipped" and "dry run" in steps["install"]["reason"]

    # The kill landed while an async save was in flight, after an earlier one was published; the resume
    # loaded that one and went on exactly as the uninterrupted run.
    kill = steps["kill9_async_resume"]["figures"]
    assert kill["killed_during_save_of_iteration"] > kill["resumed_from"] > 0, kill
    assert kill["iterations_compared"] == DRY_RUN.train_iters - kill["resumed_from"], kill
    restart = steps["inprocess_restart"]["figures"]
    assert restart["iterations_compared"] == DRY_RUN.train_iters - restart["resumed_from"], restart
    # Every save step trained as the train run did, with at least three saves; the async ones say what
    # blocked the trainer, by part, and what the worker did.
    saves = {name: steps[name]["figures"] for name in CPU_STEPS if name.startswith("save_")}
    assert all(f["losses_as_train"] and f["saves"] >= 3 for f in saves.values()), saves
    for name in ("save_async_persistent", "save_async_local"):
        parts = set(saves[name]["blocking_parts_s_median"])
        assert parts == {"prepare", "plan", "copy", "copy_wait", "wait", "finalize"}, saves[name]
        assert saves[name]["worker_s_median"]["write_seconds"] > 0, saves[name]
    stall = steps["async_stall_ratio"]["figures"]
    for tier in ("persistent", "local"):
        assert stall[tier]["blocked_s"] > 0 and "extra_loop_ratio" in stall[tier], stall
    rounds = steps["step_time_ratio"]["figures"]["rounds"]
    assert len(rounds) == DRY_RUN.step_rounds and all(r["ours"] > 0 and r["bare"] > 0 for r in rounds), rounds
    assert set(results["ratios"]) == {"step_time", "async_stall_persistent", "async_stall_local"}

    summary = (out / "summary.txt").read_text().splitlines()
    assert len(summary) <= 30 and all(len(line) <= 120 for line in summary), summary
    assert all(any(line.split()[:1] == [name] for line in summary) for name in steps), summary
    assert {p.name for p in (out / "logs").iterdir()} >= {"train.log", "kill9_run.log", "kill9_resume.log"}


def _check(tmp_path: Path) -> Check:
    return Check(DRY_RUN, Launcher(dict(os.environ), tmp_path / "logs"), tmp_path, deadline=1e12, cuda=False,
                 transformer_engine=False)


def test_a_failing_step_is_recorded_with_its_reason_and_a_bug_in_one_too(tmp_path, capsys):
    check = _check(tmp_path)

    def failing(_check):
        raise Failed("resumed losses differ", compared=3)

    def skipped(_check):
        raise Skipped("needs CUDA")

    def buggy(_check):
        return {}["figures"]

    results = [gpu_check.run_step(check, name, step)
               for name, step in (("a", failing), ("b", skipped), ("c", buggy), ("d", lambda _: ({}, "ok")))]
    assert [(r.status, r.reason) for r in results[:2]] == [("failed", "resumed losses differ"),
                                                          ("skipped", "needs CUDA")]
    assert results[0].figures == {"compared": 3}
    assert results[2].status == "failed" and results[2].reason.startswith("KeyError: 'figures'")
    assert "KeyError" in (tmp_path / "logs" / "c.traceback").read_text()
    assert (results[3].status, results[3].reason) == ("passed", "ok")
    assert capsys.readouterr().out.count("[gpu_check] ") == 4


@pytest.mark.parametrize("argv, named", [
    (["--steps", "train,warp_drive"], "--steps warp_drive"),
    (["--wheels", "/nonexistent/wheels"], "--wheels /nonexistent/wheels"),
    (["--budget-s", "0"], "--budget-s 0"),
])
def test_bad_arguments_end_in_one_line_naming_the_flag_and_exit_2(tmp_path, capsys, argv, named):
    with pytest.raises(SystemExit) as exited:
        gpu_check.main([*argv, "--dry-run", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and named in err, err
    assert not (tmp_path / "out").exists()


def test_a_results_path_that_is_a_file_is_refused(tmp_path, capsys):
    taken = tmp_path / "results"
    taken.write_text("not a folder")
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(["--dry-run", str(taken)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and str(taken) in err


@pytest.mark.slow  # asks torch (a fresh interpreter) whether it sees CUDA: a few seconds
def test_without_dry_run_a_machine_without_cuda_is_told_to_use_it(tmp_path, capsys):
    assert gpu_check.main([str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sees no CUDA device here" in err and "--dry-run" in err, err
    assert not (tmp_path / "out").exists()


def test_a_wheel_for_a_newer_glibc_than_this_one_goes_in_under_the_generic_linux_tag(tmp_path):
    nvrx = tmp_path / "nvidia_resiliency_ext-0.7.0-cp312-cp312-manylinux_2_39_x86_64.whl"
    isal = tmp_path / "isal-1.9.1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
    for wheel in (nvrx, isal):
        wheel.write_bytes(b"PK")
    staging = tmp_path / "staging"
    staging.mkdir()
    copy, note = install.installable(nvrx, 36, staging)
    assert copy == staging / "nvidia_resiliency_ext-0.7.0-cp312-cp312-linux_x86_64.whl"
    assert copy.read_bytes() == b"PK"
    assert "glibc 2.39" in note and "2.36" in note
    assert install.installable(nvrx, 39, staging) == (nvrx, None)  # the GPU machine's Ubuntu 24.04
    assert install.installable(isal, 36, staging) == (isal, None)
    assert install.installable(nvrx, None, staging) == (nvrx, None)  # not glibc: pip decides


def test_without_pip_a_wheel_is_unpacked_as_pip_would_and_one_with_a_data_folder_is_refused(tmp_path):
    plain, with_data = tmp_path / "plain-1.0-py3-none-any.whl", tmp_path / "data-1.0-py3-none-any.whl"
    with zipfile.ZipFile(plain, "w") as archive:
        archive.writestr("plain/__init__.py", "VALUE = 7\n")
        archive.writestr("plain-1.0.dist-info/METADATA", "Name: plain\n")
    with zipfile.ZipFile(with_data, "w") as archive:
        archive.writestr("data-1.0.data/scripts/tool", "#!/bin/sh\n")
    install.unpack([plain], tmp_path / "site")
    assert (tmp_path / "site" / "plain" / "__init__.py").read_text() == "VALUE = 7\n"
    assert (tmp_path / "site" / "plain-1.0.dist-info" / "METADATA").exists()
    with pytest.raises(RuntimeError, match="data-1.0-py3-none-any.whl has a .data folder"):
        install.unpack([with_data], tmp_path / "site")


def _fetch(*args: str, budget_mib: int = 64) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(FETCH), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GPU_CARRY_BUDGET_MIB": str(budget_mib)})


def test_the_wheel_folder_is_measured_with_the_working_tree_and_refused_over_the_budget(tmp_path):
    wheels = tmp_path / "gpu_wheels"
    wheels.mkdir()
    (wheels / "big-1.0-py3-none-any.whl").write_bytes(b"\0" * (3 * 2**20))
    fits = _fetch("--check", str(wheels))
    assert fits.returncode == 0 and f"{wheels}: 3.0 MiB in 1 wheels" in fits.stdout, fits.stdout + fits.stderr
    refused = _fetch("--check", str(wheels), budget_mib=2)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith(f"fetch_gpu_wheels.sh: error: {wheels} and the working tree come to ")
    for args in (["--check", str(tmp_path / "missing")], ["--verbose"]):
        bad = _fetch(*args)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "error" in bad.stderr, bad.stderr
