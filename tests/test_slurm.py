"""scripts/pretrain.sbatch under a real Slurm: a throwaway single-node Slurm 22.05 (Debian's slurmctld
and slurmd, started for this module by megatron_resil.tools.local_slurm, installed first when missing
and this is root), jobs submitted the way the README tells users to, and the outcome read from
`scontrol show job` (JobState, Restarts, ExitCode) and the job's output file.

The stories: a run finishes COMPLETED beside a second job on the same node (each with its own
rendezvous); at the time limit the warning signal makes the ranks save the iteration they reached, the
job requeues itself and the next attempt resumes from exactly there; `scontrol requeue` does the same
through Slurm; `scancel` lets the ranks save and the job stays CANCELLED; bad arguments (2) and nothing
to load (3) end the job without a requeue, as does a project root or Python that cannot run; under
--enable-ft-package a frozen rank is caught by ft_launcher inside the job and the job still finishes; with
--recover-from-replicas a killed rank's reserve takes its place at the same iteration, nothing reloaded; on
two "nodes" (two slurmd on this host) srun starts one launcher per node and they meet on the first node.

The jobs run as users run them (issue 35): the jobs whose ranks Slurm signals, requeues, cancels or whose
frozen rank ft_launcher restarts have a standby inside the job step (`RESIL_STANDBY=1`, each node's
launcher starting its own, so Slurm holds it and its forks); the others run cold, as by default. None
uses the standby the tests start outside the job (tests/conftest.py), though their environment names it,
as a user's shell may: the script does not pass it on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_resil.launch import standby
from megatron_resil.tools import local_slurm
from tests import launch, reserves

pytestmark = pytest.mark.slow

SBATCH = "scripts/pretrain.sbatch"  # relative, as a user submits it from the checkout
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE"}
# Iterations slowed to at least 0.1 s (rank 0 sleeps; rank 1 waits for it), so that a run of a few
# hundred iterations is still training when what a test does after seeing an iteration takes effect.
SLOW = ["--inject-fault", "slow", "--inject-fault-iteration", "1", "--inject-fault-slow-secs", "0.1"]


def _cluster(tmp_path_factory, nodes: int):
    try:
        local_slurm.install()
    except local_slurm.SlurmUnavailable as e:
        pytest.skip(f"no Slurm: {e}")
    directory = tmp_path_factory.mktemp(f"slurm{nodes}")
    try:  # the nodes register within seconds, but a busy machine is no reason to skip
        env = local_slurm.start(directory, nodes=nodes, timeout=120)
    except local_slurm.SlurmUnavailable as e:
        pytest.skip(f"Slurm does not start here: {e}")
    yield env
    subprocess.run(["scancel", "--full", "--user", str(os.getuid())], env=env, capture_output=True)
    deadline = time.monotonic() + 60
    while _queue(env) and time.monotonic() < deadline:
        time.sleep(0.5)
    local_slurm.stop(directory)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> dict[str, str]:
    """The clients' environment of a single-node Slurm that lives as long as this module."""
    yield from _cluster(tmp_path_factory, nodes=1)


@pytest.fixture(scope="module")
def slurm_two_nodes(tmp_path_factory) -> dict[str, str]:
    """Two nodes on this host: two slurmd, node1 and node2, each with its own port and spool."""
    yield from _cluster(tmp_path_factory, nodes=2)


def _queue(env) -> str:
    return subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip()


def _job_env(slurm_env: dict[str, str], **extra: str) -> dict[str, str]:
    """The job's environment: cold unless `RESIL_STANDBY` is among `extra` (a standby in the job step).
    It names the tests' standby, as a user's shell may name one: the script does not pass it on."""
    return {**launch.env(), "SLURM_CONF": slurm_env["SLURM_CONF"], "NPROC_PER_NODE": "2",
            "RESIL_PYTHON": sys.executable, "MAX_RESTARTS": "0", **extra}


def _story(text: str) -> str:
    """What an assertion shows of a job's output: every attempt's decisions, then the end."""
    said = [line for line in text.splitlines() if "[resil" in line or "error" in line.lower()]
    return "\n".join(said[-60:]) + "\n--- end of the output ---\n" + text[-1500:]


# --time=10: the script's warning signal (--signal=B:TERM@300) is due 300 s before the limit, and Slurm
# sends it at its first time-limit check (every 30 s, fixed in Slurm 22.05) from 30 s before that on:
# under a limit of 5 minutes or less, at the first check after the job starts.
def _submit(slurm_env, out: Path, args: list[str], sbatch_args: tuple[str, ...] = ("--time=10",),
            **extra_env: str) -> str:
    done = subprocess.run(["sbatch", "--parsable", *sbatch_args, f"--output={out}", SBATCH, *args],
                          env=_job_env(slurm_env, **extra_env), cwd=launch.REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _job(slurm_env, job: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict (JobState, Restarts, ExitCode, ...)."""
    line = subprocess.run(["scontrol", "show", "job", "-o", job], env=slurm_env, capture_output=True,
                          text=True).stdout
    return dict(field.split("=", 1) for field in line.split() if "=" in field)


def _wait(what, condition, timeout: float, out: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            tail = out.read_text(errors="replace")[-4000:] if out is not None and out.exists() else ""
            raise AssertionError(f"{what} within {timeout:.0f} s\n{tail}")
        time.sleep(0.5)


def _wait_ended(slurm_env, job: str, out: Path, timeout: float = 300) -> dict[str, str]:
    _wait(f"job {job} did not end", lambda: _job(slurm_env, job).get("JobState") in ENDED, timeout, out)
    return _job(slurm_env, job)


def _wait_for_line(out: Path, pattern: str, timeout: float = 180) -> None:
    _wait(f"no line matching {pattern!r}",
          lambda: out.exists() and re.search(pattern, out.read_text(errors="replace")), timeout, out)


def _args(save: Path, iters: int, *extra: str) -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(iters), "--save", str(save),
            "--load", str(save), "--save-interval", "1000", "--exit-signal-handler", *extra]


def _saved(out: str) -> list[int]:
    return [int(n) for n in re.findall(r"successfully saved checkpoint from iteration\s+(\d+)", out)]


def _attempts(out: str) -> list[str]:
    """The output of each attempt of the job (--open-mode=append keeps them in one file)."""
    return re.split(r"\[resil-launch\] \S+ \S+ job \d+ \(requeue \d+ of", out)[1:]


def _assert_resumed_where_it_saved(out: str, final_iteration: int) -> int:
    """Two attempts: the first saved the last iteration it trained, the second resumed from it."""
    first, second = _attempts(out)
    trained = sorted(launch.losses(first))
    saved = _saved(first)
    assert saved and trained and saved[-1] == trained[-1], (saved, trained[-3:])  # nothing trained is lost
    assert "requeue 5: stopped by the exit signal after saving" in first
    loaded = rf"successfully loaded checkpoint from .* at iteration {saved[-1]} "
    assert re.search(loaded, second), second[-3000:]
    assert min(launch.losses(second)) == saved[-1] + 1
    assert f"stop 0: training finished at iteration {final_iteration}" in second
    return saved[-1]


def test_two_jobs_on_one_node_each_train_to_completion_with_their_own_rendezvous(slurm, tmp_path):
    jobs = {}
    for name in ("a", "b"):
        out = tmp_path / f"{name}.out"
        jobs[name] = (_submit(slurm, out, _args(tmp_path / name, 20, *SLOW)), out)
    ports = set()
    for name, (job, out) in jobs.items():
        info = _wait_ended(slurm, job, out)
        text = out.read_text()
        ended = (info["JobState"], info["ExitCode"], info["Restarts"])
        assert ended == ("COMPLETED", "0:0", "0"), _story(text)
        assert "stop 0: training finished at iteration 20" in text
        assert sorted(launch.losses(text)) == list(range(1, 21))
        _assert_cold(text, tmp_path / name)
        ports.add(re.search(r"rendezvous on \S+:(\d+)", text).group(1))
        assert (tmp_path / name / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    assert len(ports) == 2, ports  # a shared port made the second job join the first one's store


def test_time_limit_saves_the_iteration_reached_requeues_and_resumes_from_it(slurm, tmp_path):
    out, save = tmp_path / "job.out", tmp_path / "ckpt"
    # A limit that is not near until training runs; then the operator shortens it to 5 minutes, which
    # puts the warning (300 s before the limit) in the past: Slurm sends it at its next time-limit check,
    # at most 30 s on, while the run has more than 39 s of its 400 iterations left. A short --time from
    # the start would signal at the first check after the start: in set-up, on a slow day.
    job = _submit(slurm, out, _args(save, 400, *SLOW), ("--time=10", "--signal=B:TERM@300"),
                  RESIL_STANDBY="1")
    _wait_for_line(out, r"iteration\s+1/")
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=5"], env=slurm, check=True)
    _wait_for_line(out, r"SIGTERM: forwarding to the job step's launchers", timeout=90)
    # The operator gives the job its time back (under 5 minutes the next attempt would be signalled at
    # its first time-limit check, before it trains).
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=10"], env=slurm, check=True)
    info = _wait_ended(slurm, job, out)
    text = out.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), _story(text)
    assert "forcing job termination" not in text  # srun's answer to a SIGTERM: the ranks were killed
    assert "requeueing job" in text and "(Slurm shows it RUNNING)" in text
    _assert_resumed_where_it_saved(text, 400)
    _assert_forked_in_the_job(text, save, attempts=2)


@pytest.mark.compat
def test_scontrol_requeue_mid_run_saves_and_resumes_once(slurm, tmp_path):
    out, save = tmp_path / "job.out", tmp_path / "ckpt"
    job = _submit(slurm, out, _args(save, 150, *SLOW), RESIL_STANDBY="1")
    _wait_for_line(out, r"iteration\s+10/")
    subprocess.run(["scontrol", "requeue", job], env=slurm, check=True)
    info = _wait_ended(slurm, job, out)
    text = out.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), _story(text)
    # Slurm requeued it; the script saw that and did not requeue it a second time.
    assert "already requeued by Slurm" in text and "requeueing job" not in text
    _assert_resumed_where_it_saved(text, 150)
    _assert_forked_in_the_job(text, save, attempts=2)


def test_scancel_mid_run_saves_within_the_grace_and_the_job_stays_cancelled(slurm, tmp_path):
    out, save = tmp_path / "job.out", tmp_path / "ckpt"
    job = _submit(slurm, out, _args(save, 400, *SLOW), RESIL_STANDBY="1")
    _wait_for_line(out, r"iteration\s+10/")
    subprocess.run(["scancel", job], env=slurm, check=True)
    info = _wait_ended(slurm, job, out)
    # A requeue would show after the credential lifetime (cred_expire=10) as PENDING, then RUNNING.
    time.sleep(12)
    info = _job(slurm, job)
    text = out.read_text()
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), _story(text)
    assert "not requeueing: Slurm shows job" in text and "requeueing job" not in text
    trained = sorted(launch.losses(text))
    assert _saved(text) == [trained[-1]]  # KillWait (30 s) was enough to save what was trained
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(trained[-1])
    _assert_forked_in_the_job(text, save, attempts=1)


def test_a_warning_signal_before_the_job_step_starts_requeues_the_job(slurm, tmp_path):
    """The warning came while the script was still checking its arguments, before its trap: the batch
    shell died, the job ended FAILED 0:15 and was never requeued."""
    out, save = tmp_path / "job.out", tmp_path / "ckpt"
    slow_python = tmp_path / "slow_python.sh"  # a slow start-up: the argument check takes 8 s
    slow_python.write_text("#!/bin/bash\n"
                           "for a in \"$@\"; do [ \"$a\" = --check-args-only ] && sleep 8; done\n"
                           f"exec {sys.executable} \"$@\"\n")
    slow_python.chmod(0o755)
    job = _submit(slurm, out, _args(save, 10), RESIL_PYTHON=str(slow_python))
    _wait("the job did not start", lambda: _job(slurm, job).get("JobState") == "RUNNING", 120, out)
    time.sleep(2)
    subprocess.run(["scancel", "--batch", "--signal=TERM", job], env=slurm, check=True, timeout=30)
    try:
        _wait("the job was not requeued", lambda: _job(slurm, job).get("Restarts") == "1", 120, out)
    finally:
        subprocess.run(["scancel", job], env=slurm, capture_output=True, timeout=30)
    text = out.read_text()
    said = "job step not started: requeue 5: SIGTERM arrived before the job step started"
    assert said in text, _story(text)
    assert "requeueing job" in text and "Traceback" not in text, _story(text)


@pytest.mark.parametrize("case", ["bad-argument", "nothing-to-load", "no-checkout", "no-torch"])
def test_a_job_that_would_fail_again_is_not_requeued(slurm, tmp_path, case):
    out, save = tmp_path / "job.out", tmp_path / "ckpt"
    args, env, code = _args(save, 10), {}, 2
    if case == "bad-argument":
        args += ["--micro-batch-size", "0"]
    elif case == "nothing-to-load":
        args += ["--exit-on-missing-checkpoint"]
        code = 3
    elif case == "no-checkout":
        env = {"RESIL_ROOT": str(tmp_path / "not-the-checkout")}
    else:
        env = {"RESIL_PYTHON": "/usr/bin/python3"}  # Debian's python: no torch
    job = _submit(slurm, out, args, **env)
    info = _wait_ended(slurm, job, out)
    text = out.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", f"{code}:0", "0"), text
    assert "Traceback" not in text and "requeueing job" not in text
    if case == "nothing-to-load":
        assert "stop 3: nothing loadable under --load" in text
    else:  # one line that says what to fix
        lines = [line for line in text.splitlines() if line.strip()]
        assert len(lines) == 1, lines
        assert {"bad-argument": "--micro-batch-size", "no-checkout": "RESIL_ROOT",
                "no-torch": "RESIL_PYTHON"}[case] in lines[0]
    assert not save.exists() or not list(save.glob("iter_*"))


def _assert_forked_in_the_job(text: str, save: Path, attempts: int) -> None:
    """Every attempt's ranks were forked from the standby its job step started, none imported for itself
    (rank 0 says why it does; the standby, a connection it dropped)."""
    assert "not used" not in text and "[resil] standby: dropped" not in text, _story(text)
    assert len(re.findall(r"\[resil\] standby 'launcher-\d+': ready", text)) >= 1, _story(text)
    events = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines()]
    phases = [e["details"]["standby"] for e in events if e["event"] == "restart_phases"]
    assert phases == [True] * attempts, phases


def _assert_cold(text: str, save: Path) -> None:
    """The job's ranks imported for themselves: the standby its environment named (the tests', outside
    the job) was not passed on."""
    assert f"{standby.ENV}={launch.env()[standby.ENV]} names a standby outside this job" in text or \
        standby.ENV not in launch.env(), _story(text)
    events = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines()]
    assert [e["details"]["standby"] for e in events if e["event"] == "restart_phases"] == [False]


def _ancestors(pid: int) -> list[int]:
    found = []
    while (stat := launch.proc_stat(pid)) is not None and stat.parent > 1:
        pid = stat.parent
        found.append(pid)
    return found


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _workers(save: Path) -> dict[int, int]:
    """{local rank: pid} of the pretrain.py ranks of the run saving to `save` (not its launcher)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        # The launcher runs `pretrain.py` too, in its arguments, but has no LOCAL_RANK.
        if any(a.endswith(b"pretrain.py") for a in argv) and str(save).encode() in argv:
            rank = [v for v in environ if v.startswith(b"LOCAL_RANK=")]
            if rank:
                found[int(rank[0].split(b"=")[1])] = int(entry.name)
    return found


def test_enable_ft_package_under_the_script_restarts_a_frozen_rank_inside_the_job(slurm, tmp_path):
    out, save = tmp_path / "job.out", tmp_path / "ckpt"
    # The stop may land in a step or in a save (every 5 iterations): both sections are timed short.
    ft_args = ("--ft-rank-section-timeouts setup:120,step:6,checkpointing:15 "
               "--ft-rank-out-of-section-timeout 60 --ft-workload-check-interval 0.5")
    job = _submit(slurm, out, [*_args(save, 60, *SLOW), "--enable-ft-package", "--save-interval", "5"],
                  MAX_RESTARTS="1", FT_LAUNCHER_ARGS=ft_args, RESIL_STANDBY="1")
    _wait_for_line(out, r"iteration\s+8/")
    workers = _workers(save)
    assert sorted(workers) == [0, 1], workers
    # The ranks' standby is inside the job step: Slurm holds it, and the forks it runs them in.
    (name,) = re.findall(r"\[resil\] standby '(launcher-\d+)': ready", out.read_text())
    (standby,) = launch.processes_named(name)
    assert "slurmstepd" in [_command(pid) for pid in _ancestors(standby)]
    assert len(launch.children_of(standby)) >= 2
    os.kill(workers[1], signal.SIGSTOP)
    info = _wait_ended(slurm, job, out)
    text = out.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), text[-4000:]
    # The rank monitor saw the hang: in a section, or, when the stop lands between sections (the exit-signal
    # check after a save, say), out of section, where the peer then waits too.
    hang = r"Section '(step|checkpointing)' has been open|Was out of section for"
    assert re.search(hang, text), text[-4000:]
    assert "[resil] restart: worker group restart 1 of at most 1" in text
    assert "stop 0: training finished at iteration 60" in text
    _assert_forked_in_the_job(text, save, attempts=2)  # the in-job restart too


def test_recover_from_replicas_under_the_script_replaces_a_killed_rank_at_the_same_iteration(slurm, tmp_path):
    """Same-step recovery as users run it under Slurm (issue 37): pretrain.sbatch with 3 processes, 2 of
    them training, and --recover-from-replicas. Rank 0 is killed (SIGKILL) before iteration 7, after the
    checkpoint of 4. The reserve, forked like every rank from the standby inside the job step, takes its
    place at the same iteration with its state from rank 1, and the job completes with no in-job restart
    and no requeue, its losses those of a run with nothing lost."""
    out, save = tmp_path / "job.out", tmp_path / "ckpt"
    fault = ["--inject-fault", "kill", "--inject-fault-ranks", "0", "--inject-fault-iteration", "7"]
    job = _submit(slurm, out, reserves.args(save, *reserves.INPROCESS, "--recover-from-replicas", *fault),
                  NPROC_PER_NODE="3", RESIL_STANDBY="1")
    reference = launch.run(reserves.args(tmp_path / "reference"))  # meanwhile: nothing lost, torchrun
    assert reference.returncode == 0, reference.stdout[-3000:]
    info = _wait_ended(slurm, job, out)
    text = out.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), _story(text)
    recovered = [line for line in text.splitlines()
                 if line.startswith("[resil] recovery: same-step recovery at iteration 6: ")]
    assert len(recovered) == 1 and "rank 0 receives its state from rank 1" in recovered[0], _story(text)
    assert "no checkpoint read; training goes on at iteration 7" in recovered[0], recovered
    assert "worker group restart" not in text, _story(text)  # ft_launcher restarted nothing
    events = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines()]
    assert [e for e in events if e["event"] == "loaded"] == []
    assert launch.losses(text) == launch.losses(reference.stdout)
    phases = [e for e in events if e["event"] == "restart_phases"]
    assert [p["kind"] for p in phases] == ["start-up", "in-process restart"], phases
    assert phases[0]["details"]["standby"] is True and phases[1]["details"]["same_step"], phases


def test_two_nodes_one_launcher_each_rendezvous_on_the_first_node(slurm_two_nodes, tmp_path):
    out, save = tmp_path / "job.out", tmp_path / "ckpt"
    # Both nodes are this host: NVRx 0.7 closes a rendezvous with two launchers on one address unless told
    # that this is a simulation.
    job = _submit(slurm_two_nodes, out, _args(save, 10), ("--time=10", "--nodes=2"), NPROC_PER_NODE="1",
                  NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE="1")
    info = _wait_ended(slurm_two_nodes, job, out)
    text = out.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), _story(text)
    # One ft_launcher per node (srun), both in one rendezvous on node1's address: a world of two.
    assert "2 nodes x 1, rendezvous on 127.0.0.1:" in text
    # The node's name is <address>_<launcher pid>_<n> (NVRx 0.4 says "has joined round 0 of the rendezvous",
    # NVRx 0.7 "has joined the rendezvous").
    joined = re.findall(r"The node '(\S+)' has joined (?:round 0 of )?the rendezvous .* as rank (\d) in a "
                        r"world of size 2", text)
    assert len({node for node, _ in joined}) == 2 and sorted(rank for _, rank in joined) == ["0", "1"], joined
    assert sorted(launch.losses(text)) == list(range(1, 11))
    assert "stop 0: training finished at iteration 10" in text
    _assert_cold(text, save)
