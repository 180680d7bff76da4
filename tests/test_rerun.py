"""megatron-core's rerun state machine validates every step: a rejected loss or grad norm reruns the step in
place on the same batches; a check that is not fatal then continues, a fatal one saves the iteration before
the step and exits 17 (not reproduced: a transient fault) or 16 (reproduced: resume on another device)."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    RerunMode,
    RerunState,
    RerunStateMachine,
)

from megatron_resil import patches
from megatron_resil.arguments import parse_args
from megatron_resil.checkpointing import layout
from megatron_resil.checkpointing.safe_load import CommonLoadWeightsOnly
from tests import launch

pytestmark = pytest.mark.slow

_RERUN = re.compile(r"\[resil\] rerun: iteration (\d+): (.*)")


def _args(iters: int, *extra: str) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(iters), *extra]


def _saving(root: Path) -> list[str]:
    return ["--save", str(root), "--load", str(root), "--save-interval", "50"]


def _machine_state(root: Path, iteration: int) -> dict | None:
    # As pretrain.py does: the machine's enums load weights-only, and megatron-core 0.19's common state
    # (inside the shards, not in common.pt) is read through DCP with the allow-lists in place.
    patches.install()
    common = CommonLoadWeightsOnly().load_common(layout.iteration_dir(str(root), iteration))
    return common["rerun_state_machine"]


def _checkpoint_asked_on_exit_17() -> bool:
    """Whether megatron-core asks for a checkpoint when a fatal check does not reproduce in place: 0.16
    does (for examination); 0.19 does not (Megatron-LM #3981: resume from the previous one). Asked of its
    own machine; the training loop follows whichever answer it gives."""
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    machine.state = RerunState.RERUNNING_IN_PLACE
    checkpoint, should_exit, code = machine.should_checkpoint_and_exit()
    assert should_exit and code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    return checkpoint


def _events(root: Path, kind: str) -> list[dict]:
    events = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["event"] == kind]


def test_injected_transient_errors_and_a_real_loss_spike_are_rerun_in_place_and_training_completes():
    """Not fatal (--check-for-spiky-loss alone): every rejection is rerun and the run goes on. A spike is
    judged against the first 100 losses, so it is injected after them."""
    out = launch.run(_args(110, "--log-interval", "10", "--no-check-for-nan-in-loss-and-grad",
                           "--check-for-spiky-loss", "--error-injection-rate", "50",
                           "--inject-fault", "spiky-loss", "--inject-fault-iteration", "110",
                           "--inject-fault-repeat")).stdout
    assert "exitcode" not in out and "Traceback" not in out, out[-3000:]
    reruns = {int(m.group(1)): m.group(2) for m in _RERUN.finditer(out)}
    injected = {it: line for it, line in reruns.items() if "injected transient_error" in line}
    assert 2 <= len(injected) <= 10, reruns  # about 1 in 50 losses, not every step after the first one
    for line in injected.values():
        # The rerun replays the same batch with the same RNG: the same loss, to the last digit.
        initial, replayed = re.search(r"\((\S+), injected transient_error; rerun: (\S+)\)", line).groups()
        assert initial == replayed and line.endswith("rerun in place: the check is not fatal; continuing")
    spike_line = re.search(r"rank 0: Spiky loss \((\S+); rerun: (\S+)\)", reruns[110])
    spike, replayed = map(float, spike_line.groups())
    assert spike > 100 * replayed and reruns[110].endswith("continuing")
    assert float(launch.losses(out)[110][0]) < 10  # the logged step is the rerun's, not the spike


def test_transient_error_on_the_nan_checks_exits_17_and_the_job_resumes(tmp_path):
    """The NaN/Inf checks are fatal (as in Megatron-LM): a result that a rerun in place does not
    reproduce exits 17, the step not taken. Where megatron-core asks for it (0.16), with a checkpoint of
    the iteration before the step, which megatron-core cannot resume in that state and we resume as a
    plain checkpoint; where it does not (0.19), with none, so the resume starts from the previous one
    (here: none, from scratch)."""
    root = tmp_path / "ckpt"
    first = launch.run(_args(6, *_saving(root), "--error-injection-rate", "8")).stdout
    assert "exitcode  : 17" in first, first[-3000:]
    step, line = next((int(m.group(1)), m.group(2)) for m in _RERUN.finditer(first))
    assert "injected transient_error" in line
    verdict = "not reproduced by a rerun in place on the same device (a transient fault) and the check is " \
              "fatal"
    saved = _checkpoint_asked_on_exit_17()
    if saved:
        assert line.endswith(f"{verdict}; saving the checkpoint of iteration {step - 1} (the step is not "
                             "taken) and exiting with code 17"), line
        assert layout.published_iterations(str(root)) == [step - 1]
        assert _machine_state(root, step - 1)["state"] == RerunState.RERUNNING_IN_PLACE
    else:
        assert line.endswith(f"{verdict}; exiting with code 17"), line
        assert layout.published_iterations(str(root)) == []
    assert _events(root, "exit")[-1]["exit_code"] == 17
    assert _events(root, "rerun")[-1]["verdict"] == "transient"

    resumed = launch.run(_args(6, *_saving(root)))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    plain_resume = f"[resil] rerun: the checkpoint was saved after iteration {step} failed validation " \
                   "(exit code 17"
    assert (plain_resume in resumed.stdout) == saved, resumed.stdout[-3000:]
    assert sorted(launch.losses(resumed.stdout)) == list(range(step if saved else 1, 7))


def test_persistent_error_is_reproduced_in_place_saved_with_the_machine_state_and_exits_16(tmp_path):
    """Reproduced in place: save the iteration before the step, with the machine's state, and exit 16 to
    rerun on another device. (Resumed on the same host, megatron-core then exits 16 again without a
    checkpoint; that loop and its end are the next test's and the node-loss drill's.)"""
    root = tmp_path / "ckpt"
    args = _args(6, *_saving(root), "--error-injection-rate", "8",
                 "--error-injection-type", "persistent_error", "--rerun-max-same-device-retries", "1")
    first = launch.run(args).stdout
    assert "exitcode  : 16" in first, first[-3000:]
    step, line = next((int(m.group(1)), m.group(2)) for m in _RERUN.finditer(first))
    assert "injected persistent_error" in line and line.endswith(
        f"saving the checkpoint of iteration {step - 1} (the step is not taken) and exiting with code 16")
    assert "retries of it are bounded by --rerun-max-same-device-retries 1" in line
    saved = _machine_state(root, step - 1)
    assert saved["state"] == RerunState.WILL_RERUN_FROM_CHECKPOINT and len(saved["per_rank"]) == 2
    assert socket.gethostname() in {rank["suspicious_node"] for rank in saved["per_rank"]}
    assert [(e["exit_code"], e["requeue"]) for e in _events(root, "exit")] == [(16, True)]
    ledger = json.loads((root / "rerun_escape.json").read_text())
    assert (ledger["fault_iteration"], ledger["same_device_retries"], ledger["status"]) == (step, 0, "open")


def test_a_nan_reproducing_from_every_checkpoint_falls_back_once_then_exits_8(tmp_path):
    """The escape hatch with no same-device retry allowed: the second job falls back to the persistent
    checkpoint before the diagnostic one, meets the NaN again and stops with exit 8; the diagnostic
    checkpoint is kept as it was, and a third job would not loop either (it counts from the ledger)."""
    root = tmp_path / "ckpt"
    args = _args(6, "--save", str(root), "--load", str(root), "--save-interval", "2",
                 "--inject-fault", "nan-loss", "--inject-fault-iteration", "5", "--inject-fault-repeat",
                 "--rerun-max-same-device-retries", "0")
    first = launch.run(args).stdout
    assert "exitcode  : 16" in first, first[-3000:]
    assert _machine_state(root, 4)["state"] == RerunState.WILL_RERUN_FROM_CHECKPOINT

    second = launch.run(args).stdout
    assert "exitcode  : 8" in second, second[-3000:]
    assert "[resil] rerun: resuming the rerun of iteration 5 that the previous job asked for" in second
    assert f"resumed on the node and device that produced it ({socket.gethostname()}, device " in second
    assert "the 0 same-device retries (--rerun-max-same-device-retries) are used up: instead of exiting 16 " \
           "again, falling back to the newest verified persistent checkpoint older than iteration 4" in second
    assert "[resil] load: accepted persistent iteration 2" in second
    assert "[resil] save: not saving iteration 4: its diagnostic checkpoint" in second
    line = [m.group(2) for m in _RERUN.finditer(second)][-1]
    assert "it reproduced again after the fallback from the checkpoint of iteration 4 to the persistent " \
           "one of iteration 2: it follows neither the device nor the checkpoint" in line
    assert "Look at the data of iteration 5" in line
    assert line.endswith("(do not requeue); exiting with code 8")
    assert sorted(launch.losses(second)) == [3, 4]  # trained again from the fallback, up to the fault
    assert _machine_state(root, 4)["state"] == RerunState.WILL_RERUN_FROM_CHECKPOINT  # kept as it was
    ledger = json.loads((root / "rerun_escape.json").read_text())
    assert (ledger["fallback_iteration"], ledger["status"]) == (2, "unrecoverable")
    assert [e["exit_code"] for e in _events(root, "exit")] == [16, 8]


def test_megatrons_report_stats_spelling_runs_report_determinism_stats():
    out = launch.run(_args(4, "--rerun-mode", "report_stats", "--log-interval", "2")).stdout
    assert "exitcode" not in out and "Traceback" not in out, out[-3000:]
    assert out.count("pretrain.py: note: --rerun-mode report_stats is Megatron-LM's spelling") == 1
    # Each step runs twice; on CPU the two passes agree exactly.
    assert " determinism to iteration 4: 'found NaN in local forward loss calculation': 4 samples, all " \
           "identical" in out
    assert sorted(launch.losses(out)) == [2, 4]


_BASE = _args(4)


def test_rerun_flags_default_to_megatrons():
    args = parse_args(_BASE, world_size=2)
    assert (args.rerun_mode, args.error_injection_rate, args.error_injection_type) == \
        ("validate_results", 0, "transient_error")
    assert args.check_for_nan_in_loss_and_grad and not args.check_for_spiky_loss
    assert args.rerun_max_same_device_retries == 2  # ours: Megatron has no bound


@pytest.mark.parametrize("extra, flag", [
    (["--error-injection-rate", "-1"], "--error-injection-rate"),
    (["--error-injection-type", "persistent_error"], "--error-injection-type"),
    (["--error-injection-rate", "5", "--rerun-mode", "disabled"], "--error-injection-rate"),
    (["--error-injection-rate", "5", "--no-check-for-nan-in-loss-and-grad"], "--error-injection-rate"),
    (["--rerun-mode", "report_stats", "--no-check-for-nan-in-loss-and-grad"], "--rerun-mode"),
    (["--rerun-mode", "validate"], "--rerun-mode"),
    (["--rerun-max-same-device-retries", "-1"], "--rerun-max-same-device-retries"),
])
def test_bad_rerun_flags_exit_2_with_one_line_naming_the_flag(extra, flag, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args([*_BASE, *extra], world_size=2)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pretrain.py: error: ") and flag in err, err
