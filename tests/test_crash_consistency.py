"""Crash consistency: the whole torchrun tree (agent, both ranks, their helpers) is SIGKILLed at random
moments while checkpoints are being saved, and after every kill the checkpoint directory tells the truth:

- every `iter_NNNNNNN` directory is complete: `.metadata`, a manifest, every listed file present at its
  recorded size (and CRC, where the manifest records one), and nothing on disk the manifest omits;
- the tracker, if present, parses and names a complete `iter_` directory;
- the next run resumes from what the tracker names (or the newest complete checkpoint without one),
  reports the leftovers of the interrupted save removed, never loads them, and trains on.

Reproduce a failure with the printed seed: CRASH_SEED=<seed> (CRASH_CYCLES=<n> to run more kills).
Kill timing also depends on machine load, so the seed fixes the choices, not the exact moment.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from megatron_resil.checkpointing import atomic, layout
from megatron_resil.checkpointing.atomic import atomic_write_text, publish_directory
from megatron_resil.checkpointing.manifest import MANIFEST_NAME, verify_manifest

try:  # tests/ as a package (repo root on sys.path) or as a plain directory (tests/ on sys.path)
    from tests import launch
except ImportError:
    import launch

_FINAL = re.compile(r"^iter_(\d{7})$")
_QUARANTINED = re.compile(r"^iter_\d{7,}\.quarantined\.")
_STAGING = re.compile(r"^\.tmp_iter_\d{7}_[0-9a-f]+$")
_LOSS_ITER = re.compile(r"^\s*\[[^\]]*\] iteration\s+(\d+)/", re.M)

KILL_CYCLES = int(os.environ.get("CRASH_CYCLES", "2"))
MAX_DELAY_S = 1.5  # kill this long (uniformly drawn) after a new staging directory appears
MAX_PUBLISH_DELAY_S = 0.01  # the same, after its manifest appears (rename and tracker take ~ms)
MAX_SKIP = 3  # let this many of a launch's saves pass first (each launch's first save is the slow one)
LONG_RUN_ITERS = 400
LAUNCH_DEADLINE_S = 180  # start-up alone takes 10-50 s on a loaded 2-core machine
KEEP_LAST = 3  # retention runs inside the kill window too: `.deleting_iter_*` leftovers get exercised


# ---- process handling ---------------------------------------------------------------------------
def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _run_groups(agent_pid: int, marker: str) -> set[int]:
    """Process groups of the run: the agent's and its descendants' (torchrun starts every worker in
    a session of its own, so killing the agent's group alone leaves the ranks running), plus those of
    any live process whose command line names `marker` (this test's own, unique save directory)."""
    table = launch.processes()
    tree = {agent_pid} | launch.descendants_of(agent_pid)
    tree |= {pid for pid in table if marker in _cmdline(pid)}
    own = os.getpgrp()
    return {table[pid].group for pid in tree if pid in table and table[pid].group not in (own, 0, 1)}


def _alive_in(groups: set[int]) -> list[int]:
    return [pid for pid, stat in launch.processes().items()
            if stat.group in groups and stat.state not in ("Z", "X")]


def _kill_run(proc, marker: str, timeout: float = 20.0) -> None:
    """SIGKILL every process of the run at once and wait until none is left (zombies count as gone)."""
    groups = _run_groups(proc.pid, marker)
    for pgid in sorted(groups, key=lambda g: g != proc.pid):  # the agent first: it gets no say
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        groups |= _run_groups(proc.pid, marker)  # anything that slipped out (e.g. a late helper)
        alive = _alive_in(groups)
        if not alive:
            return
        assert time.monotonic() < deadline, f"processes {alive} survived SIGKILL"
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


# ---- what the directory must say ----------------------------------------------------------------
def _tail(path: Path, n: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return text[-n:]


def _check_directory(root: str) -> tuple[int | None, list[int]]:
    """Assert the directory tells the truth; return (iteration a resume must load, complete iterations)."""
    problems, complete = [], []
    for name in sorted(os.listdir(root)):
        if _QUARANTINED.match(name):
            problems.append(f"{name}: a published checkpoint failed verification after a crash")
        m = _FINAL.match(name)
        if not m:
            continue
        path, iteration = os.path.join(root, name), int(m.group(1))
        if not os.path.isdir(path):
            problems.append(f"{name} is not a directory")
            continue
        if not os.path.isfile(os.path.join(path, ".metadata")):
            problems.append(f"{name} has no .metadata")
        if not os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            problems.append(f"{name} has no {MANIFEST_NAME}")
            continue
        reason = verify_manifest(path, iteration)
        if reason is not None:
            problems.append(f"{name}: {reason}")
            continue
        with open(os.path.join(path, MANIFEST_NAME)) as f:
            listed = set(json.load(f)["files"])
        on_disk = {os.path.relpath(os.path.join(d, n), path) for d, _s, ns in os.walk(path) for n in ns}
        on_disk.discard(MANIFEST_NAME)
        if listed != on_disk or ".metadata" not in listed:
            problems.append(f"{name}: manifest lists {sorted(listed)}, directory has {sorted(on_disk)}")
            continue
        complete.append(iteration)
    tracker = os.path.join(root, layout.TRACKER_NAME)
    tracked = None
    if os.path.exists(tracker):
        with open(tracker) as f:
            text = f.read()
        if not re.fullmatch(r"\d+\n?", text):
            problems.append(f"tracker is unparsable: {text!r}")
        else:
            tracked = int(text)
            if tracked not in complete:
                problems.append(f"tracker names iteration {tracked}, which is not a complete iter_ dir "
                                f"(complete: {complete})")
    assert not problems, f"checkpoint directory {root} lies:\n  " + "\n  ".join(problems) + \
        f"\n  listing: {sorted(os.listdir(root))}"
    expected = tracked if tracked is not None else (max(complete) if complete else None)
    return expected, complete


def _where_it_died(root: str) -> str:
    """Which step of a save the kill interrupted, read from what it left behind."""
    found = layout.leftovers(root)
    phases = []
    for path in found["staging"]:
        has_manifest = os.path.isfile(os.path.join(path, MANIFEST_NAME))
        phases.append("manifest written, before rename" if has_manifest else "DCP write / fsync")
    if found["displaced"]:
        phases.append("replacing an existing iter_ dir")
    if found["deleting"]:
        phases.append("retention delete")
    if found["tracker_tmp"]:
        phases.append("tracker update")
    published = layout.published_iterations(root)
    tracker = Path(root, layout.TRACKER_NAME)
    text = tracker.read_text().strip() if tracker.exists() else ""
    tracked = int(text) if text.isdigit() else None
    if published and (tracked is None or published[0] > tracked):
        phases.append(f"after rename of iter_{published[0]:07d}, before its tracker update")
    return "; ".join(phases) or "between saves"


def _check_resume(log: str, root: str, expected: int | None, leftovers: dict[str, list[str]]) -> None:
    """The run whose log this is loaded exactly what the directory promised and cleaned the debris."""
    if expected is None:
        assert re.search(r"^\[resil\] load: no (loadable )?checkpoint under --load", log, re.M), log[-3000:]
        assert "successfully loaded checkpoint" not in log, log[-3000:]
        assert "training from iteration 0 to" in log, log[-3000:]
    else:
        accepted = re.findall(r"^\[resil\] load: accepted \S+ iteration (\d+) \((\S+)\)", log, re.M)
        want = layout.iteration_dir(root, expected)
        assert accepted == [(str(expected), want)], f"expected to accept {want}; log:\n{log[-3000:]}"
        loaded = re.findall(r"successfully loaded checkpoint from .*? at iteration (\d+)", log)
        assert loaded == [str(expected)], log[-3000:]
        assert f"training from iteration {expected} to" in log, log[-3000:]
    assert "[resil] load: rejected" not in log, f"a published checkpoint was rejected:\n{log[-3000:]}"
    cleanup = [line for line in log.splitlines() if line.startswith("[resil] cleanup: ")]
    for path in leftovers["staging"]:
        assert any(f"removed {path}" in line for line in cleanup), \
            f"staging leftover {path} not reported removed; cleanup lines: {cleanup}"
    for kind in ("displaced", "deleting", "tracker_tmp"):
        for path in leftovers[kind]:
            assert any(path in line for line in cleanup), f"{kind} leftover {path} not reported: {cleanup}"
    assert not any(os.path.basename(p) in line for p in leftovers["staging"]
                   for line in log.splitlines() if "accepted" in line or "loaded checkpoint" in line)
    trained = {int(i) for i in _LOSS_ITER.findall(log)}
    first = (expected or 0) + 1
    assert first in trained, f"did not train on from iteration {expected}:\n{log[-3000:]}"


# ---- the test -----------------------------------------------------------------------------------
@pytest.fixture
def save_root(tmp_path: Path):
    root = tmp_path / "ckpt"
    root.mkdir()
    yield str(root)
    # Safety net: nothing started by this test outlives it (selected by the unique directory name).
    groups = {stat.group for pid, stat in launch.processes().items() if str(root) in _cmdline(pid)}
    for pgid in groups - {0, 1, os.getpgrp()}:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


MODES = {"sync": [], "async": ["--async-save", "--use-persistent-ckpt-worker"]}


def _args(root: str, train_iters: int, mode: str = "sync") -> list[str]:
    return [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", str(train_iters),
            "--save", root, "--load", root, "--save-interval", "1", "--ckpt-keep-last", str(KEEP_LAST),
            *MODES[mode]]


def _kill_during_a_save(root: str, log_path: Path, trigger: str, skip: int,
                        delay: float, mode: str) -> tuple[str, float]:
    """Start a long run and SIGKILL all of it `delay` s after the (skip+1)-th save of this launch
    reaches `trigger`: "staging" (its staging directory appears; polled every 10 ms) or "manifest"
    (its manifest appears in the staging directory, i.e. the publish steps are next; polled every
    1 ms). Returns that save's staging directory name and the seconds from launch to the first save."""
    known = set(os.listdir(root))  # staging leftovers of the previous kill are not a save in flight
    poll = 0.01 if trigger == "staging" else 0.001
    t0 = time.monotonic()
    proc = launch.start(_args(root, LONG_RUN_ITERS, mode), log_path=log_path)
    first_save = 0.0
    try:
        seen: list[str] = []  # new staging directories, in order of appearance
        hits: list[str] = []  # those that reached the trigger
        deadline = time.monotonic() + LAUNCH_DEADLINE_S
        while len(hits) <= skip:
            if proc.poll() is not None:
                pytest.fail(f"run exited ({proc.returncode}) before a save was in flight:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(f"no save reached {trigger} within {LAUNCH_DEADLINE_S} s:\n{_tail(log_path)}")
            try:
                names = os.listdir(root)
            except FileNotFoundError:
                names = []
            seen += [n for n in names if _STAGING.match(n) and n not in known and n not in seen]
            if seen and not first_save:
                first_save = time.monotonic() - t0
            if trigger == "staging":
                hits = seen
            else:
                hits += [n for n in seen[-2:] if n not in hits
                         and os.path.exists(os.path.join(root, n, MANIFEST_NAME))]
            time.sleep(poll)
        time.sleep(delay)
    finally:
        _kill_run(proc, root)
    return hits[skip], first_save


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_sigkill_during_saves_never_leaves_a_lie(save_root: str, tmp_path: Path, mode: str) -> None:
    """With --async-save the kills land while background workers write (their staging directories
    appear when a save is planned) and while the trainer publishes."""
    seed = int(os.environ.get("CRASH_SEED", random.SystemRandom().randrange(2**32)))
    rng = random.Random(seed)
    cycles = KILL_CYCLES if mode == "sync" else 2
    print(f"\n[crash] {mode}: seed {seed} (rerun with CRASH_SEED={seed}), {cycles} kill cycles")
    start = time.monotonic()
    expected: int | None = None  # iteration the next launch must resume from (None: fresh start)
    history = []
    for cycle in range(cycles):
        # Most kills land anywhere in a save (mostly in DCP's writes, the longest step); every
        # third one aims at the short publish window: fsync, rename, tracker, retention.
        trigger = "manifest" if cycle % 3 == 1 else "staging"
        skip = rng.randint(0, MAX_SKIP)
        delay = rng.uniform(0.0, MAX_DELAY_S if trigger == "staging" else MAX_PUBLISH_DELAY_S)
        leftovers = layout.leftovers(save_root)
        log_path = tmp_path / f"cycle{cycle}.log"
        t0 = time.monotonic()
        staging, first_save = _kill_during_a_save(save_root, log_path, trigger, skip, delay, mode)
        log = log_path.read_text(errors="replace")
        _check_resume(log, save_root, expected, leftovers)
        phase = _where_it_died(save_root)
        print(f"[crash] cycle {cycle}: resumed from {expected}; killed {delay:.3f} s after {staging} "
              f"reached {trigger} (skipped {skip} saves) -> died in: {phase}", flush=True)
        new_expected, complete = _check_directory(save_root)
        print(f"[crash]   complete {complete}, next resume {new_expected} "
              f"(first save at {first_save:.1f} s, cycle {time.monotonic() - t0:.1f} s)")
        if expected is not None:
            assert new_expected is not None and new_expected >= expected, \
                f"published progress went backwards: {expected} -> {new_expected}"
        expected = new_expected
        history.append((trigger, skip, round(delay, 3), phase))
    print(f"[crash] seed {seed} (trigger, skip, delay, phase): {history}")

    # If no kill left the tracker behind a published checkpoint, make that state by hand: the tracker
    # names the previous checkpoint, exactly what a kill right after the newest one's rename leaves.
    # The final run must then resume from the tracker's, and re-save the newer iteration over its
    # existing directory (publish_directory's replace path) on its way.
    _expected_again, complete = _check_directory(save_root)
    replaced = None
    if expected is not None and expected == max(complete) and len(complete) >= 2:
        replaced, expected = expected, sorted(complete)[-2]
        atomic_write_text(os.path.join(save_root, layout.TRACKER_NAME), f"{expected}\n")
        print(f"[crash] tracker set back to {expected} (iter_{replaced:07d} stays, untracked)")
    elif expected is not None and expected < max(complete):
        replaced = max(complete)  # a kill already left this state

    # A final launch runs to completion from where the kills left it.
    leftovers = layout.leftovers(save_root)
    final = (expected or 0) + 3
    result = launch.run(_args(save_root, final, mode), timeout=LAUNCH_DEADLINE_S)
    log = result.stdout
    assert result.returncode == 0, f"final run exited {result.returncode}:\n{log[-4000:]}"
    _check_resume(log, save_root, expected, leftovers)
    trained = {int(i) for i in _LOSS_ITER.findall(log)}
    assert set(range((expected or 0) + 1, final + 1)) <= trained, log[-3000:]
    assert f"successfully saved checkpoint from iteration {final:7d}" in log, log[-3000:]
    if replaced is not None and replaced <= final:
        assert f"successfully saved checkpoint from iteration {replaced:7d}" in log, log[-3000:]
    tracked, complete = _check_directory(save_root)
    assert tracked == final and final in complete
    assert not any(layout.leftovers(save_root).values()), layout.leftovers(save_root)
    print(f"[crash] final run resumed at {expected}, finished at {final}; "
          f"total {time.monotonic() - start:.1f} s")


# ---- the primitives, in one process -------------------------------------------------------------
def _tree_contents(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}


def _make_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_publish_directory_replaces_an_existing_directory(tmp_path: Path, monkeypatch, exchange) -> None:
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    root = tmp_path / "ckpt"
    final = root / "iter_0000005"
    _make_tree(final, {"old.txt": "old", "sub/old2.txt": "old2", ".metadata": "old metadata"})
    staging = Path(layout.new_staging_dir(str(root), 5))
    new = {"new.txt": "new", "sub/new2.txt": "new2", ".metadata": "new metadata"}
    _make_tree(staging, new)
    displaced = Path(layout.new_displaced_dir(str(root), 5))

    publish_directory(str(staging), str(final), str(displaced))

    assert _tree_contents(final) == new  # the old content is fully replaced, nothing of it left
    assert not staging.exists() and not displaced.exists()
    assert sorted(os.listdir(root)) == ["iter_0000005"]


def test_publish_directory_into_a_fresh_name(tmp_path: Path) -> None:
    staging = tmp_path / ".tmp_iter_0000001_abc"
    _make_tree(staging, {"a": "1", "d/b": "2"})
    final = tmp_path / "iter_0000001"
    publish_directory(str(staging), str(final), str(tmp_path / ".displaced_iter_0000001_abc"))
    assert _tree_contents(final) == {"a": "1", "d/b": "2"}
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001"]


def test_atomic_write_text_creates_and_replaces(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / layout.TRACKER_NAME
    atomic_write_text(str(path), "7\n")
    assert path.read_text() == "7\n"
    atomic_write_text(str(path), "12\n")
    assert path.read_text() == "12\n"
    assert os.listdir(tmp_path) == [layout.TRACKER_NAME]  # no temporary file left behind

    # A write that fails before the rename leaves the old content whole, and its debris is
    # recognisable to the start-up cleanup.
    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        atomic_write_text(str(path), "9999\n")
    assert path.read_text() == "12\n"
    debris = [n for n in os.listdir(tmp_path) if n != layout.TRACKER_NAME]
    assert [os.path.basename(p) for p in layout.leftovers(str(tmp_path))["tracker_tmp"]] == debris
