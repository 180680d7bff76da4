"""Same-step recovery (--recover-from-replicas): after an in-process restart, training goes on at the
interrupted iteration with no checkpoint read. The survivors keep their state in memory, and a warm reserve
in a lost rank's place receives it from a data-parallel replica, every tensor checked.

The runs are real: scripts/run_local.sh with 3 processes (2 training, 1 warm reserve) on loopback, gloo, a
tiny GPT, no in-job restart and no requeue allowed. Faults are injected before iteration 7, after the
checkpoint of 4: a recovery that read it would log iterations 5 and 6 twice.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_resil.arguments import parse_args
from megatron_resil.progress import TrainProgress
from megatron_resil.resilience import replica_recovery
from megatron_resil.resilience.replica_recovery import FallBack, Kept, plan

try:
    from tests import launch, reserves  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch
    import reserves

_ITERATION = re.compile(r"^ \[[^\]]*\] iteration\s+(\d+)/", re.MULTILINE)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict, Path]:
    """The losses and the final checkpoint of the same run with nothing lost (torchrun, 2 ranks)."""
    save = tmp_path_factory.mktemp("uninterrupted") / "ckpt"
    reference = launch.run(reserves.args(save))
    assert reference.returncode == 0, reference.stdout[-4000:]
    return launch.losses(reference.stdout), save


def _run(save: Path, log: Path, fault: list[str], env: dict[str, str] | None = None,
         processes: int = 3) -> str:
    with reserves.running(save, log, 0, [*fault, "--inject-fault-iteration", "7", "--recover-from-replicas"],
                          env=env, processes=processes) as run:
        code = run.wait(timeout=600)
    out = log.read_text()
    assert code == 0, out[-6000:]
    return out


def _recovery_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("[resil] recovery:")]


@pytest.mark.slow
@pytest.mark.compat
def test_a_reserve_in_killed_rank_0s_place_receives_its_state_and_training_goes_on_at_the_same_iteration(
        uninterrupted, tmp_path):
    losses, reference = uninterrupted
    save = tmp_path / "ckpt"
    out = _run(save, tmp_path / "run.log", ["--inject-fault", "kill", "--inject-fault-ranks", "0"])
    events = reserves.events(save)
    lines = _recovery_lines(out)
    assert lines[0].startswith("[resil] recovery: same-step recovery on"), lines
    assert len(lines) == 2 and lines[1].startswith(
        "[resil] recovery: same-step recovery at iteration 6: rank 0 receives its state from rank 1 ("), lines
    assert "no checkpoint read; training goes on at iteration 7" in lines[1]
    [recovered] = [e for e in events if e["event"] == "recovery" and "iteration" in e]
    assert recovered["receivers"] == [0] and recovered["tensors"] > 0, recovered

    # No checkpoint was read (the checkpoint of 4 was there), every iteration was taken once, and each
    # loss is the uninterrupted run's.
    assert [e for e in events if e["event"] == "loaded"] == []
    assert [int(i) for i in _ITERATION.findall(out)] == list(range(1, 11)), _ITERATION.findall(out)
    assert launch.losses(out) == losses
    # The end state, bit for bit: weights, the optimizer's moments and the RNG states in the final save.
    assert launch.differing_tensors(save / "iter_0000010", reference / "iter_0000010", tmp_path,
                                    weights_only=False) == []
    # The restart's phases: the reserve's attempt is an in-process one, and its "load" is the transfer.
    phases = [e for e in events if e["event"] == "restart_phases"]
    assert phases[-1]["kind"] == "in-process restart" and phases[-1]["details"]["same_step"], phases[-1]
    # No rank built the datasets again: the survivor kept its own, the reserve built them while it waited.
    assert phases[-1]["details"]["datasets_kept"] is True, phases[-1]


@pytest.mark.slow
@pytest.mark.compat
def test_with_resil_standby_every_process_reserves_included_is_forked_and_the_kill_costs_no_rollback(
        uninterrupted, tmp_path):
    """RESIL_STANDBY=1 with --inprocess-restart: the run's standby forks all three processes (the
    reserve too), so a job step's start pays the imports once; rank 0 is killed at iteration 7, and the
    reserve, itself a fork, takes its place at the same iteration."""
    losses, _ = uninterrupted
    save = tmp_path / "ckpt"
    out = _run(save, tmp_path / "run.log", ["--inject-fault", "kill", "--inject-fault-ranks", "0"],
               env={"RESIL_STANDBY": "1"})
    assert [line for line in out.splitlines() if line.startswith("[resil] standby 'run-local-")], out[-6000:]
    assert "not used" not in out, out[-6000:]
    lines = _recovery_lines(out)
    assert len(lines) == 2 and lines[1].startswith(
        "[resil] recovery: same-step recovery at iteration 6: rank 0 receives its state from rank 1 ("), lines
    events = reserves.events(save)
    phases = [e for e in events if e["event"] == "restart_phases"]
    assert phases[0]["kind"] == "start-up" and phases[0]["details"]["standby"] is True, phases[0]
    assert [e for e in events if e["event"] == "loaded"] == []
    assert launch.losses(out) == losses


@pytest.mark.slow
def test_a_rank_killed_inside_the_gradient_reduction_is_replaced_at_the_same_iteration(
        uninterrupted, tmp_path):
    """Rank 1 is killed in iteration 7 as its gradients' reduction begins, rank 0 being inside the
    all-reduce (or entering it): the gradients of iteration 7 are lost with it, but no state had changed.
    The reserve in rank 1's place receives from rank 0, and iteration 7 is taken again, exactly."""
    losses, reference = uninterrupted
    save = tmp_path / "ckpt"
    out = _run(save, tmp_path / "run.log",
               ["--inject-fault", "kill-in-grad-sync", "--inject-fault-ranks", "1"])
    assert ("[resil] fault: injecting kill-in-grad-sync on rank 1 in iteration 7 as its gradients' reduction "
            "begins") in out, out[-6000:]
    lines = _recovery_lines(out)
    assert len(lines) == 2 and lines[1].startswith(
        "[resil] recovery: same-step recovery at iteration 6: rank 1 receives its state from rank 0 ("), lines
    assert [e for e in reserves.events(save) if e["event"] == "loaded"] == []
    assert [int(i) for i in _ITERATION.findall(out)] == list(range(1, 11)), _ITERATION.findall(out)
    assert launch.losses(out) == losses
    assert launch.differing_tensors(save / "iter_0000010", reference / "iter_0000010", tmp_path,
                                    weights_only=False) == []


@pytest.mark.slow
def test_a_stopped_rank_is_terminated_and_the_reserve_in_its_place_goes_on_at_the_same_iteration(
        uninterrupted, tmp_path):
    """Rank 1 hangs before iteration 7 and its process is then stopped with SIGSTOP. NVRx finds it at the
    soft timeout and terminates it at the hard timeout. Rank 0 is blocked in the gradients' reduction with
    it, which the abort at the soft timeout ends (on gloo by shutting down the groups' connections:
    group_connections.py), so rank 0 keeps its state and its timestamps, and survives its own hard timeout;
    the reserve receives rank 1's state from it. --distributed-timeout-minutes is left at 10: before that
    abort, gloo's collective held rank 0 past its hard timeout and its state was lost with it. With
    --exit-signal-handler, as users' scripts carry it, NVRx's SIGTERM to the hung rank is caught: that rank
    must still end as a lost rank, not with an exit code that makes the launcher end the others."""
    losses, _ = uninterrupted
    save, log = tmp_path / "ckpt", tmp_path / "run.log"
    fault = ["--inject-fault", "hang", "--inject-fault-ranks", "1", "--inject-fault-iteration", "7",
             "--recover-from-replicas", "--inprocess-soft-timeout", "10", "--inprocess-hard-timeout", "20",
             "--exit-signal-handler"]
    with reserves.running(save, log, 0, fault) as run:
        reserves.wait_for(run, log, "[resil] fault: injecting hang on rank 1 ")
        [setup] = [e for e in reserves.events(save) if e["event"] == "inprocess"]
        os.kill(setup["pids"][1], signal.SIGSTOP)
        code = run.wait(timeout=600)
    out = log.read_text()
    assert code == 0, out[-6000:]
    restarts = [line for line in out.splitlines() if line.startswith("[resil] restart:")]
    assert len(restarts) == 1 and "rank 1 made no progress for --inprocess-soft-timeout 10 s" in restarts[0]
    lines = _recovery_lines(out)
    assert len(lines) == 2 and lines[1].startswith(
        "[resil] recovery: same-step recovery at iteration 6: rank 1 receives its state from rank 0 ("), lines
    assert [e for e in reserves.events(save) if e["event"] == "loaded"] == []
    assert [int(i) for i in _ITERATION.findall(out)] == list(range(1, 11))
    assert launch.losses(out) == losses


@pytest.mark.slow
def test_a_rank_that_raised_keeps_its_state_and_nothing_is_sent(uninterrupted, tmp_path):
    losses, _ = uninterrupted
    save = tmp_path / "ckpt"
    # Nested inside ft_launcher's in-job restart (--enable-ft-package): each attempt's rank monitor client
    # connects afresh, and the monitoring decisions are said once.
    out = _run(save, tmp_path / "run.log", ["--inject-fault", "exception", "--inject-fault-ranks", "1",
                                            "--enable-ft-package"])
    assert out.count("[resil] ft: hang detection on:") == 1, out[-6000:]
    lines = _recovery_lines(out)
    assert len(lines) == 2 and "same-step recovery at iteration 6: no rank had lost its state (0.0 MB in 0 " \
        "tensors" in lines[1], lines
    assert [e for e in reserves.events(save) if e["event"] == "loaded"] == []
    assert [int(i) for i in _ITERATION.findall(out)] == list(range(1, 11))
    assert launch.losses(out) == losses


@pytest.mark.slow
@pytest.mark.compat
def test_a_nan_that_raises_makes_the_state_suspect_and_every_rank_reloads(uninterrupted, tmp_path):
    """--rerun-mode disabled: megatron-core raises on rank 1's NaN loss in iteration 7. Nothing was lost,
    but the state that produced the NaN is suspect, so no replica hands it on: every rank loads the
    checkpoint of 4, with the reason, and the run ends as if uninterrupted (the NaN is injected once)."""
    losses, _ = uninterrupted
    save = tmp_path / "ckpt"
    out = _run(save, tmp_path / "run.log", ["--inject-fault", "nan-loss", "--inject-fault-ranks", "1",
                                            "--rerun-mode", "disabled"])
    lines = _recovery_lines(out)
    assert len(lines) == 2 and lines[1].startswith(
        "[resil] recovery: same-step recovery not possible: the state of rank 1 is suspect"), lines
    assert "every rank loads the newest checkpoint instead" in lines[1], lines
    assert [e["iteration"] for e in reserves.events(save) if e["event"] == "loaded"] == [4]
    assert launch.losses(out.split(lines[1], 1)[1]) == {i: losses[i] for i in range(5, 11)}


@pytest.mark.slow
def test_a_transfer_that_fails_its_check_falls_back_to_the_newest_checkpoint_with_the_reason(uninterrupted,
                                                                                            tmp_path):
    """The sender flips a byte of the first tensor it sends (a test hook): the receiver's checksum finds it,
    and every rank loads the checkpoint of 4 instead; the run still ends as if uninterrupted."""
    losses, _ = uninterrupted
    save = tmp_path / "ckpt"
    out = _run(save, tmp_path / "run.log", ["--inject-fault", "kill", "--inject-fault-ranks", "0"],
               env={replica_recovery.CORRUPT_TRANSFER_ENV: "1"})
    lines = _recovery_lines(out)
    assert len(lines) == 2 and lines[1].startswith(
        "[resil] recovery: same-step recovery not possible: a transfer failed its check (rank 0: tensor 0 of "
        "the state from rank 1 (state.model[0].embedding.word_embeddings.weight) does not match its "
        "checksum); every rank loads the newest checkpoint instead"), lines
    events = reserves.events(save)
    assert [e["iteration"] for e in events if e["event"] == "loaded"] == [4]
    assert launch.losses(out.split(lines[1], 1)[1]) == {i: losses[i] for i in range(5, 11)}


@pytest.mark.slow
def test_a_receiver_killed_during_the_recovery_is_replaced_by_the_next_reserve_at_the_same_iteration(
        uninterrupted, tmp_path):
    """A second fault during the recovery: the reserve in rank 0's place is killed with SIGKILL once it has
    the header of rank 0's state (a test hook). The sender's transfer fails, the next in-process restart
    puts the second reserve in rank 0's place, and it receives the state; rank 1 kept its own throughout."""
    losses, _ = uninterrupted
    save = tmp_path / "ckpt"
    out = _run(save, tmp_path / "run.log", ["--inject-fault", "kill", "--inject-fault-ranks", "0"],
               env={replica_recovery.DIE_RECEIVING_ENV: str(tmp_path / "died")}, processes=4)
    assert out.count("[resil] fault: rank 0 is killed while it receives its state") == 1, out[-6000:]
    restarts = [line for line in out.splitlines() if line.startswith("[resil] restart:")]
    assert len(restarts) == 2 and restarts[1].startswith(
        "[resil] restart: in-process restart 2 of at most 3: rank 0 ended (its process is gone)"), restarts
    lines = _recovery_lines(out)
    assert len(lines) == 2 and lines[1].startswith(
        "[resil] recovery: same-step recovery at iteration 6: rank 0 receives its state from rank 1 ("), lines
    assert [e for e in reserves.events(save) if e["event"] == "loaded"] == []
    assert [int(i) for i in _ITERATION.findall(out)] == list(range(1, 11))
    assert launch.losses(out) == losses


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "source"), [
    (("--tensor-model-parallel-size", "2"), 3),  # rank 1 is tensor rank 1: its replica is rank 3
    (("--pipeline-model-parallel-size", "2"), 0),  # rank 1 is in stage 0 with rank 0
    # instances of ranks 0, 1 and 2, 3: rank 1's optimizer shard is also rank 3's
    (("--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"), 3),
], ids=["tp2xdp2", "pp2xdp2", "distopt2xdp4"])
def test_a_shard_is_received_from_its_own_replica_under_tensor_and_pipeline_parallelism(layout, source,
                                                                                      tmp_path):
    """4 training ranks and a reserve: rank 1's process killed; the reserve receives rank 1's shard from the
    data-parallel replica at the same tensor or pipeline rank, or holding the same optimizer shard in the
    other instance, and the run ends with the losses of the same layout never interrupted."""
    reference = launch.run(reserves.args(tmp_path / "reference", *layout), nproc=4, timeout=600)
    assert reference.returncode == 0, reference.stdout[-4000:]
    save = tmp_path / "ckpt"
    # The later --inprocess-active-world-size wins over reserves.INPROCESS's 2, as argparse takes the last.
    fault = [*layout, "--inprocess-active-world-size", "4",
             "--inject-fault", "kill", "--inject-fault-ranks", "1"]
    out = _run(save, tmp_path / "run.log", fault, processes=5)
    lines = _recovery_lines(out)
    assert len(lines) == 2 and lines[1].startswith(
        "[resil] recovery: same-step recovery at iteration 6: rank 1 receives its state from "
        f"rank {source} ("), lines
    assert [e for e in reserves.events(save) if e["event"] == "loaded"] == []
    assert launch.losses(out) == launch.losses(reference.stdout)


_DISTOPT = ("--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2")


def _dp4_run(tmp_path: Path, layout: tuple[str, ...], faults: list[str] = (),
             env: dict[str, str] | None = None) -> tuple[str, str, Path, Path]:
    """The uninterrupted reference (torchrun, 4 ranks) and the run with the faults (`faults`' flags, `env`'s
    hooks; 4 training ranks and a reserve at DP 4, `layout`'s optimizer): their outputs and final
    checkpoints' directories."""
    reference = tmp_path / "reference"
    uninterrupted = launch.run(reserves.args(reference, *layout), nproc=4, timeout=600)
    assert uninterrupted.returncode == 0, uninterrupted.stdout[-4000:]
    save = tmp_path / "ckpt"
    with reserves.running(save, tmp_path / "run.log", 0, [*layout, "--inprocess-active-world-size", "4",
                                                         "--recover-from-replicas", *faults],
                          env=env, processes=5) as run:
        code = run.wait(timeout=600)
    out = (tmp_path / "run.log").read_text()
    assert code == 0, out[-6000:]
    return uninterrupted.stdout, out, save, reference


@pytest.mark.slow
def test_under_plain_ddp_at_dp_4_a_killed_ranks_reserve_receives_from_a_live_peer_at_the_same_iteration(
        tmp_path):
    """DDP without the distributed optimizer, 4 data-parallel ranks and a reserve: every rank holds the
    whole state, so any live peer can give it. Rank 2's process is killed with SIGKILL in iteration 7; the
    reserve in its place receives rank 2's state from the lowest live peer, no checkpoint is read, every
    iteration is logged once, and the end state equals the uninterrupted run's bit for bit."""
    reference_out, out, save, reference = _dp4_run(
        tmp_path, (), ["--inject-fault", "kill", "--inject-fault-ranks", "2",
                       "--inject-fault-iteration", "7"])
    lines = _recovery_lines(out)
    assert len(lines) == 2 and lines[1].startswith(
        "[resil] recovery: same-step recovery at iteration 6: rank 2 receives its state from rank 0 ("), lines
    assert "no checkpoint read; training goes on at iteration 7" in lines[1]
    assert [e for e in reserves.events(save) if e["event"] == "loaded"] == []
    assert [int(i) for i in _ITERATION.findall(out)] == list(range(1, 11)), _ITERATION.findall(out)
    assert launch.losses(out) == launch.losses(reference_out)
    assert launch.differing_tensors(save / "iter_0000010", reference / "iter_0000010", tmp_path,
                                    weights_only=False) == []


@pytest.mark.slow
@pytest.mark.compat  # the distributed optimizer's accessors, on the users' megatron-core too
def test_a_rank_killed_between_its_shard_update_and_the_all_gather_leaves_no_mixed_state(tmp_path):
    """The distributed optimizer with two instances at DP 4 (instances of ranks 0, 1 and 2, 3): rank 1's
    process is killed right after its optimizer updated its shard in iteration 7, before the parameters'
    all-gather. Rank 0, its instance peer, is caught inside that update (its shard stepped, its parameters
    not gathered): it holds nothing and receives, as the reserve in rank 1's place does, from the other
    instance, which completed iteration 7. Training goes on at iteration 8, and the end state equals the
    uninterrupted run's bit for bit."""
    reference_out, out, save, reference = _dp4_run(
        tmp_path, _DISTOPT, env={replica_recovery.DIE_AFTER_UPDATE_ENV: f"1:7:{tmp_path / 'died'}"})
    assert "[resil] fault: rank 1 is killed right after its optimizer updated its state in iteration 7" in out
    lines = _recovery_lines(out)
    assert len(lines) == 2 and lines[1].startswith(
        "[resil] recovery: same-step recovery at iteration 7: rank 0 receives its state from rank 2; rank 1 "
        "receives its state from rank 3 ("), lines
    assert "training goes on at iteration 8" in lines[1]
    assert [e for e in reserves.events(save) if e["event"] == "loaded"] == []
    assert launch.differing_tensors(save / "iter_0000010", reference / "iter_0000010", tmp_path,
                                    weights_only=False) == []
    reference_losses, losses = launch.losses(reference_out), launch.losses(out)
    assert {i: reference_losses[i] for i in losses} == losses and {8, 9, 10} <= set(losses), losses


@pytest.mark.slow
def test_where_every_replica_was_caught_inside_its_update_every_rank_reloads_the_checkpoint(tmp_path):
    """As above, and rank 3, rank 1's replica in the other instance, stalls right after its own update in
    iteration 7, so rank 2 waits in its all-gather: every live rank is caught inside the update. Their kept
    state is iteration 6's commit, but their shards have stepped since (the keeper holds references, not
    copies): given, it would mix two steps. Nothing is sent; every rank falls back to the newest checkpoint,
    and the end state equals the uninterrupted run's bit for bit. (Found on the way: rank 3's DDP, interrupted
    inside its optimizer step, outlived the attempt, held from outside Python's sight, and rank 2 waited in
    their all-gather until NVRx's hard timeout; parallel.empty_leaked_engines.)"""
    reference_out, out, save, reference = _dp4_run(
        tmp_path, _DISTOPT, env={replica_recovery.DIE_AFTER_UPDATE_ENV: f"1:7:{tmp_path / 'died'}",
                                 replica_recovery.HOLD_AFTER_UPDATE_ENV: f"3:7:{tmp_path / 'held'}"})
    assert "[resil] fault: rank 3 stops until the restart right after its optimizer updated its state" in out
    lines = _recovery_lines(out)
    assert len(lines) == 2 and lines[1].startswith(
        "[resil] recovery: same-step recovery not possible: no rank holds a committed step"), lines
    assert [e["iteration"] for e in reserves.events(save) if e["event"] == "loaded"] == [4], out[-4000:]
    assert launch.differing_tensors(save / "iter_0000010", reference / "iter_0000010", tmp_path,
                                    weights_only=False) == []
    reference_losses, losses = launch.losses(reference_out), launch.losses(out)
    assert {i: reference_losses[i] for i in losses} == losses and {8, 9, 10} <= set(losses), losses


def _parse(*extra: str, world_size: int = 2) -> argparse.Namespace:
    return parse_args([*launch.TINY_MODEL, "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
                       "--mock-data", *extra], world_size=world_size)


def test_recover_from_replicas_without_inprocess_restart_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        _parse("--recover-from-replicas")
    assert stop.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith("--recover-from-replicas needs --inprocess-restart: only an in-process restart "
                         "keeps the surviving ranks' processes, and their state, today"), line


@pytest.mark.parametrize(("flags", "world_size", "why"), [
    ((), 2, None),
    ((), 1, "data-parallel size 1: no other rank holds a copy"),
    (("--tensor-model-parallel-size", "2"), 2, "data-parallel size 1"),
    (("--use-distributed-optimizer",), 2, "the distributed optimizer with 1 instance shards"),
    (("--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"), 4, None),
])
def test_the_layouts_where_no_replica_holds_a_ranks_state_are_named_at_start_up(flags, world_size, why):
    args = _parse("--inprocess-restart", "--recover-from-replicas", *flags, world_size=world_size)
    said = replica_recovery.arm(args)
    assert (said is None) if why is None else said.startswith(why), said


def _row(iteration: int, digest: int = 7, tp: int = 0, suspect: int = 0, shard: int = 0,
         updating: int = 0) -> list[int]:
    return [iteration, suspect, updating, 0, tp, 0, shard, digest]


def test_a_rank_behind_receives_from_the_lowest_replica_at_the_newest_iteration():
    # rank 0: a reserve (nothing); rank 2: one step behind (had not committed the interrupted step)
    assert plan([_row(-1, 0), _row(6), _row(5, 3), _row(6)]) == (6, [(1, 0), (1, 2)])
    assert plan([_row(6), _row(6)]) == (6, [])
    # two shards (tensor ranks 0 and 1), each with its own source
    assert plan([_row(-1, 0, tp=0), _row(-1, 0, tp=1), _row(6, 1, tp=0), _row(6, 2, tp=1)]) == \
        (6, [(2, 0), (3, 1)])
    # the distributed optimizer with two instances (ranks 0, 1 and 2, 3): a shard's replica is in the
    # other instance; rank 2, caught inside its update (its shard stepped, its parameters not gathered),
    # receives too
    table = [_row(6, shard=0), _row(6, shard=1), _row(5, shard=0, updating=1), _row(-1, 0, shard=1)]
    assert plan(table) == (6, [(0, 2), (1, 3)])


@pytest.mark.parametrize(("table", "why"), [
    ([_row(-1, 0), _row(-1, 0)], "no rank holds a committed step"),
    ([_row(5, updating=1), _row(-1, 0)], "no rank holds a committed step"),
    ([_row(6, shard=0), _row(-1, 0, shard=1), _row(6, shard=0), _row(5, shard=1, updating=1)],
     "optimizer shard 1 holds iteration 6 (ranks [1, 3] hold [-1], ranks [3] caught inside an update"),
    ([_row(-1, 0, tp=0), _row(6, tp=1), _row(5, tp=0), _row(6, tp=1)],
     "no live replica of the shard at pipeline rank 0, tensor rank 0, context rank 0, optimizer shard 0 "
     "holds iteration 6"),
    ([_row(6, 1), _row(6, 2), _row(-1, 0)], "the replicas [0, 1] of one shard hold different models"),
    ([_row(6), _row(6, suspect=1)], "the state of rank 1 is suspect"),
])
def test_each_case_no_live_replica_can_serve_falls_back_with_its_reason(table, why):
    with pytest.raises(FallBack, match=re.escape(why)):
        plan(table)


def _kept() -> Kept:
    state = {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3, dtype=torch.bfloat16)}
    return Kept(6, [{"w": torch.randn(4, 3), "b": torch.arange(3), "_extra_state": None}],
                {"state": {0: state},
                 "param_groups": [{"params": [0], "betas": (0.9, 0.95), "lr": float("nan")}]},
                {"num_steps": 24, "max_lr": 1e-3},
                {"random_rng_state": (3, tuple(range(625)), None),
                 "np_rng_state": ("MT19937", np.arange(624, dtype=np.uint32), 624, 0, 0.0),
                 "torch_rng_state": torch.get_rng_state()},
                TrainProgress(6, 24, 0, 0, 1.5e9))


def test_the_wire_format_carries_a_ranks_state_exactly_and_unpickles_nothing():
    kept = _kept()
    header, tensors = replica_recovery._encode(kept)
    assert [e["path"] for e in header["tensors"]][:2] == ["state.model[0].w", "state.model[0].b"]
    got = replica_recovery._decode(header["skeleton"], [t.clone() for t in tensors])
    assert got.iteration == 6 and got.progress == kept.progress and got.scheduler == kept.scheduler
    assert torch.equal(got.model[0]["w"], kept.model[0]["w"]) and got.model[0]["_extra_state"] is None
    assert list(got.optimizer["state"]) == [0]  # integer keys stay integers
    assert torch.equal(got.optimizer["state"][0]["exp_avg"], kept.optimizer["state"][0]["exp_avg"])
    assert got.optimizer["param_groups"][0]["betas"] == (0.9, 0.95)
    assert got.rng["random_rng_state"] == kept.rng["random_rng_state"]
    assert got.rng["np_rng_state"][1].dtype == np.uint32
    assert np.array_equal(got.rng["np_rng_state"][1], kept.rng["np_rng_state"][1])


@pytest.mark.parametrize("skeleton", [
    {"p": []}, {"t": 99}, {"t": True}, {"l": {"a": 1}}, {"d": [[{"v": 1.5}, {"v": 1}]]}, {"v": [1]},
    {"n": 0, "dtype": "object"}, {"v": 1, "t": 0, "x": 2},
])
def test_a_malformed_header_is_a_fallback_never_an_object(skeleton):
    with pytest.raises(FallBack, match="malformed header"):
        replica_recovery._decode(skeleton, [torch.zeros(1)])


def test_what_cannot_be_sent_as_plain_values_and_tensors_is_a_fallback():
    kept = _kept()
    kept.scheduler["callback"] = print
    with pytest.raises(FallBack, match=r"scheduler.callback: a builtin_function_or_method cannot be sent"):
        replica_recovery._encode(kept)
