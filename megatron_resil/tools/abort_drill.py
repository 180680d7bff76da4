"""The collective-abort drill (issue 37 item 8): a rank left inside a collective that never returns is freed
by the in-process layer's own abort, and its process then forms a new group with a replacement on a fresh
store namespace, as same-step recovery does.

    python -m megatron_resil.tools.abort_drill --backend gloo        # CPU (tests/test_abort_drill.py)
    python -m megatron_resil.tools.abort_drill --backend nccl        # two GPUs (the GPU check's step)
    python -m megatron_resil.tools.abort_drill --peer stopped ...    # the peer hung, not dead, at the abort
    python -m megatron_resil.tools.abort_drill --group later ...     # in a group made after the first

Two processes, ranks 0 and 1, each on its own device under NCCL. Both all-reduce once (checked). Rank 1 is
then stopped with SIGSTOP, from outside, and rank 0 enters an all-reduce with it, which cannot complete.
Once rank 0 is inside it, rank 1 is killed with SIGKILL (a lost rank) and rank 0's watcher thread runs
`ReleaseProcessGroups`, the abort NVRx's monitor thread runs on every rank under --inprocess-restart: the
gloo groups' connections shut down (group_connections.py), NVRx's AbortTorchDistributed (on NCCL, `abort()`
of every communicator, which is what ends a kernel waiting for a dead peer), then every reference to the
groups dropped. Rank 0's collective must return or raise. A replacement rank 1 is started, both join a
group on the next store namespace, and their all-reduce must give the right sum. With `--peer killed` (the
default) the kill alone already ends a gloo collective (the peer's socket closes); with `--peer stopped`
rank 1 is still stopped at the abort, and killed only once rank 0 is out of its collective: on either
backend nothing but the abort can end it then. With `--group later` the collectives run in a group made
after the process group started (group_connections.new_group, as the local tier's replication groups are).

Prints one JSON line; exit code 0 when every part held, 1 when one did not, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HOST = "127.0.0.1"
_STEP_TIMEOUT = datetime.timedelta(seconds=300)  # a bound on each wait, never a pace: every wait is an event


# -- a rank ----------------------------------------------------------------------------------------------

def _form_group(store, namespace: str, backend: str, rank: int):
    import torch
    import torch.distributed as dist
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    from megatron_resil import group_connections
    with group_connections.tracking():  # as parallel.initialize does
        dist.init_process_group(backend, store=dist.PrefixStore(namespace, store), rank=rank, world_size=2,
                                timeout=_STEP_TIMEOUT)
    return device


def _sum_is_right(device, rank: int, group=None) -> bool:
    import torch
    import torch.distributed as dist
    value = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(value, group=group)
    return bool((value == 3.0).all().item())


def _abort_when_told(store, aborted: dict) -> None:
    """Rank 0's watcher: NVRx's monitor thread, reduced to what matters here (wait, then our abort)."""
    from megatron_resil.resilience.inprocess_restart import ReleaseProcessGroups
    store.wait(["abort"], _STEP_TIMEOUT)
    aborted["at"] = time.monotonic()
    try:
        ReleaseProcessGroups()(None)
    except Exception as error:  # noqa: BLE001 - reported, the drill then fails on it
        aborted["error"] = f"{type(error).__name__}: {error}"
    store.set("aborted", "1")


def rank_main(backend: str, port: int, rank: int, namespace: str, group_made: str = "world") -> int:
    import torch.distributed as dist

    from megatron_resil import group_connections, parallel
    store = dist.TCPStore(HOST, port, is_master=False, timeout=_STEP_TIMEOUT)
    device = _form_group(store, namespace, backend, rank)
    group = group_connections.new_group([0, 1]) if group_made == "later" and namespace == "attempt1" else None
    report = {"first_sum": _sum_is_right(device, rank, group)}
    store.set(f"{namespace}/ready{rank}", json.dumps(report))
    if namespace == "attempt1" and rank == 0:
        aborted: dict = {}
        watcher = threading.Thread(target=_abort_when_told, args=(store, aborted), daemon=True)
        watcher.start()
        store.wait(["go"], _STEP_TIMEOUT)  # rank 1 is stopped now
        store.set("entered", "1")
        try:
            _sum_is_right(device, rank, group)  # cannot complete: its peer is stopped, then dead
            report["hung_collective"] = "returned"
        except Exception as error:  # noqa: BLE001 - the expected way out on gloo
            report["hung_collective"] = f"raised {type(error).__name__}"
        store.set("out", "1")
        report["seconds_after_abort"] = (round(time.monotonic() - aborted["at"], 3) if "at" in aborted
                                         else None)
        watcher.join(_STEP_TIMEOUT.total_seconds())
        report["abort_error"] = aborted.get("error")
        parallel.release_process_groups()  # what the finalize step between attempts does
        device = _form_group(store, "attempt2", backend, rank)
        report["sum_after_reforming"] = _sum_is_right(device, rank)
        store.set("attempt2/ready0", json.dumps(report))
    elif namespace == "attempt1":
        store.wait(["never"], _STEP_TIMEOUT)  # stopped and killed from outside before this ends
    dist.destroy_process_group()
    return 0


# -- the drill -------------------------------------------------------------------------------------------

def _start_rank(backend: str, port: int, rank: int, namespace: str, log: Path,
                group_made: str = "world") -> subprocess.Popen:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH")]))}
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)  # never via a symlink
    try:
        return subprocess.Popen([sys.executable, "-m", "megatron_resil.tools.abort_drill", "--rank",
                                 str(rank), "--port", str(port), "--backend", backend, "--namespace",
                                 namespace, "--group", group_made], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        os.close(out)


def drill(backend: str, workdir: Path, peer: str = "killed", group_made: str = "world") -> dict:
    import torch.distributed as dist
    workdir.mkdir(parents=True, exist_ok=True)
    # Port 0, taken by the store itself: held by us from the start.
    store = dist.TCPStore(HOST, 0, is_master=True, timeout=_STEP_TIMEOUT)
    ranks = [_start_rank(backend, store.port, r, "attempt1", workdir / f"rank{r}.log", group_made)
             for r in (0, 1)]
    replacement = None
    try:
        store.wait(["attempt1/ready0", "attempt1/ready1"])
        first = [json.loads(store.get(f"attempt1/ready{r}")) for r in (0, 1)]
        os.kill(ranks[1].pid, signal.SIGSTOP)  # from now on rank 1 takes part in nothing
        store.set("go", "1")
        store.wait(["entered"])
        if peer == "killed":
            os.kill(ranks[1].pid, signal.SIGKILL)  # the lost rank
            ranks[1].wait()
        store.set("abort", "1")
        store.wait(["out"])  # rank 0 is out of its collective: with a stopped peer, the abort alone did it
        if peer == "stopped":
            os.kill(ranks[1].pid, signal.SIGKILL)  # what NVRx does to a hung rank at its hard timeout
            ranks[1].wait()
        replacement = _start_rank(backend, store.port, 1, "attempt2", workdir / "replacement.log")
        store.wait(["attempt2/ready0", "attempt2/ready1"])
        survivor = json.loads(store.get("attempt2/ready0"))
        replaced = json.loads(store.get("attempt2/ready1"))
        codes = [ranks[0].wait(_STEP_TIMEOUT.total_seconds()),
                 replacement.wait(_STEP_TIMEOUT.total_seconds())]
    except Exception as error:  # noqa: BLE001 - a wait that timed out: the ranks' logs say why
        tails = {log.name: log.read_text(errors="replace")[-1500:] for log in sorted(workdir.glob("*.log"))}
        return {"backend": backend, "ok": False, "error": f"{type(error).__name__}: {error}", "logs": tails}
    finally:
        for proc in (*ranks, replacement):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    held = (all(r["first_sum"] for r in first) and survivor.get("abort_error") is None
            and survivor["sum_after_reforming"] and replaced["first_sum"] and codes == [0, 0])
    return {"backend": backend, "peer": peer, "group": group_made, "ok": bool(held),
            "hung_collective": survivor["hung_collective"],
            "seconds_after_abort": survivor["seconds_after_abort"], "abort_error": survivor["abort_error"],
            "sum_after_reforming": survivor["sum_after_reforming"], "exit_codes": codes}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"abort_drill: error: {message}\n")
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="abort_drill", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--peer", choices=("killed", "stopped"), default="killed",
                        help="rank 1 at the abort: killed (a lost rank; the default) or still stopped "
                        "(a hung one)")
    parser.add_argument("--group", choices=("world", "later"), default="world",
                        help="where the collectives run: the process group itself (the default) or a group "
                        "made after it started")
    parser.add_argument("--workdir", type=Path, help="where the ranks' logs go (default: a new temporary "
                        "directory)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--namespace", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.rank is not None:
        return rank_main(opts.backend, opts.port, opts.rank, opts.namespace, opts.group)
    if opts.backend == "nccl":
        import torch
        if torch.cuda.device_count() < 2:
            print(f"abort_drill: error: --backend nccl needs two GPUs; this machine has "
                  f"{torch.cuda.device_count()}", file=sys.stderr)
            return 2
    if opts.workdir is None:
        import tempfile
        opts.workdir = Path(tempfile.mkdtemp(prefix="abort_drill_"))
    result = drill(opts.backend, opts.workdir, opts.peer, opts.group)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
