"""Ranks that start with torch already imported: a standby process per node, and pretrain.py its client.

A rank spends most of its start-up, and of every restart, importing torch and what megatron-core imports
from it (issue 26's split: 56-67% of a restart on our machines). `python -m megatron_resil.launch.standby
--name N` imports them once and waits. A pretrain.py started with MEGATRON_RESIL_STANDBY=N in its
environment (by torchrun, ft_launcher, srun, after every restart) hands its command line, environment,
working directory and standard streams to the standby, which forks a worker that runs pretrain.py with
them. The arguments, our patches and everything after are decided in the worker as in any rank; a
launcher's standby also imports megatron-core ahead, with the first run's patches (standby_warmup.py), and
serves only ranks whose run installs the same.

The process the launcher started (the client) stays, and is the rank to everyone outside:
- a signal it can catch (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCONT) is handled as the
  worker handles it when it comes (the client reads that from /proc then): passed on where the worker
  catches it, ignored where it ignores it, and where the worker has the default the client dies of it (and
  so the worker: see below), as the rank itself would;
- SIGSTOP and SIGKILL cannot be caught: the standby watches each client and stops, continues or kills
  its worker when the client is stopped, continued or gone (a pidfd for death, /proc every 20 ms for
  stops), so a launcher's or a test's kill of "the rank" keeps its meaning;
- the worker's end is the client's: the same exit code, or the same signal.
The worker records its client (rank_process.launched_pid, launcher_pid): the launcher watch, the restart
phases and the time budget ask about the process the launcher started, not the fork.

What was imported must be what the rank would have imported: the standby serves only a client with the
same interpreter, the same megatron_resil, the same module search path and the same import-time
environment (PYTHON*, TORCH*, OMP_*, ... below); otherwise, or with no standby answering, the rank says so
in one line and imports for itself. Under --inprocess-restart a rank's process lives through its restarts,
but its first start (and a new job step's, warm reserves included) is forked like any other.

Trust, each way (docs/standby.md, "Who may connect"). The socket is in Linux's abstract namespace: nothing
is written on disk, and any local user may bind a name first. So the client sends nothing until the peer
credentials (SO_PEERCRED) of the process holding the name show its own uid and, with
MEGATRON_RESIL_STANDBY=NAME@PID, the pid its starter recorded; it signals only a process that the
standby forked (a pidfd, checked against the standby's pid), and the worker runs pretrain.py only after
the client has checked it. The standby serves only clients of its own uid, reads each request without
blocking, bounded in size, nesting and time and checked against a schema, and drops a bad one with one
line: no request can stall it or end it (and with it its workers). A worker takes its client's rlimits,
nice value, CPU affinity and NUMA memory policy before anything else, or refuses the client, which then
imports for itself.
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

from megatron_resil import phase_marks, rank_process
from megatron_resil.launch import standby_settings
from megatron_resil.launch import standby_wire as wire

ENV = "MEGATRON_RESIL_STANDBY"  # NAME@PID (or NAME): the standby a rank hands itself to, and its pid
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT)
# What the standby imports: torch and the parts of it megatron-core imports, none of which our patches
# must precede (patches/: their NotImported checks name megatron-core's modules only).
PRELOAD = ("numpy", "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
           "torch.optim", "torch.nn.functional")
# Environment read while those are imported (or by the interpreter at start-up): a client whose values
# differ would get a torch set up for another environment.
_IMPORT_ENV_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "LD_",
                        "CUDA", "NVIDIA_", "NVTE_", "LANG", "LC_")
# ... but not what launchers set for each rank's run (torchrun, ft_launcher: NVRx 0.7 adds
# TORCH_ELASTIC_WORKER_IDENTICAL), read when the rank runs, not when torch is imported; nor the inductor
# cache directory, which torch itself writes into os.environ the first time anything asks for it (a parent
# that touched inductor passes it on) and reads again at each use.
_NOT_IMPORT_ENV = ("TORCHELASTIC_", "TORCH_ELASTIC_", "TORCH_NCCL_", "TORCH_WORKER_",
                   "TORCH_DISABLE_SHARE_RDZV", "PYTHON_EXEC", "TORCHINDUCTOR_CACHE_DIR")
_TICK = 0.02  # seconds between checks of the clients' stopped state
_HANDSHAKE_SECS = 30.0
_MAX_PENDING = 32  # requests being read at once (standby_wire.Pending); more are dropped

# ---- the client: pretrain.py's first lines --------------------------------------------------------------

def hand_over(who: str = "this rank") -> None:
    """Run this rank (or `who`: the launcher, launch/ft_launcher.py) in the standby named by
    MEGATRON_RESIL_STANDBY, if there is one that fits: then this process only mirrors its worker and never
    returns. Otherwise return, having said why in one line."""
    value = os.environ.get(ENV)
    if not value or rank_process.in_standby_worker():
        return
    try:
        sock, standby = _connect(value)
    except _NotUsed as why:
        return _not_used(value, str(why), who)
    fds = [fd for fd in (0, 1, 2) if _is_open(fd)]
    umask = os.umask(0)
    os.umask(umask)
    request = {"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(), "path": sys.path,
               "umask": umask, "pid": os.getpid(), "fds": fds,
               "streams": _streams(), "marks": phase_marks.process_marks(), "fingerprint": fingerprint(),
               **standby_settings.current()}
    try:  # a stopped or stuck standby: import here instead (a worker it forks later is never let run)
        wire.send(sock, request, fds)
        worker, worker_fd = _worker(wire.receive(sock), standby)
        wire.send(sock, {"go": True})
        sock.settimeout(None)
    except _NotUsed as why:
        sock.close()
        return _not_used(value, str(why), who)
    except (OSError, ValueError) as err:
        sock.close()
        return _not_used(value, f"the standby did not answer ({err})", who)
    _mirror(sock, worker, worker_fd)


class _NotUsed(Exception):
    """Why this rank does not hand itself over: it imports for itself."""


def _not_used(value: str, why: str, who: str = "this rank") -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"[resil] standby: {ENV}={value} not used: {why}; {who} imports torch itself",
              file=sys.stderr, flush=True)


def _connect(value: str) -> tuple[socket.socket, int]:
    """A connection to the standby that `value` (NAME@PID, or NAME) names, and its pid: only once the
    process holding the name is known to run as this process's uid and, given PID, to be that process.
    Anyone may bind an abstract name first; nothing is sent to a process that is not the standby."""
    name, at, recorded = value.partition("@")
    if not name or at and not (recorded.isascii() and recorded.isdigit() and int(recorded) > 0):
        raise _NotUsed("not NAME or NAME@PID (the standby's pid, as `python -m megatron_resil.launch.standby "
                       "--name NAME` prints it)")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_HANDSHAKE_SECS)  # a full backlog: connect() waits
    try:
        sock.connect(wire.address(name))
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError as err:
        sock.close()
        raise _NotUsed(f"no standby answers ({err.strerror or err})") from None
    if uid != os.geteuid():
        why = f"the process holding that name (pid {pid}) runs as uid {uid}, this rank as {os.geteuid()}"
    elif at and pid != int(recorded):
        why = f"the process holding that name is pid {pid}, not the standby's pid {recorded}"
    else:
        return sock, pid
    sock.close()
    raise _NotUsed(f"{why}; nothing was sent to it")


def _worker(reply: object, standby: int) -> tuple[int, int]:
    """The worker the standby forked for this rank, as (pid, pidfd): a child of `standby`, pinned by a
    pidfd so that no signal of this process can reach another that took its pid. Raises _NotUsed."""
    if not isinstance(reply, dict):
        raise _NotUsed("the standby's answer is not one")
    if isinstance(reply.get("refused"), str):
        raise _NotUsed(reply["refused"])
    pid = reply.get("pid")
    if type(pid) is not int or pid <= 0:
        raise _NotUsed(f"the standby answered {wire.short(reply)}, not with its worker")
    try:
        fd = os.pidfd_open(pid)
    except OSError as err:
        raise _NotUsed(f"the worker it named (pid {pid}) cannot be found ({err.strerror})") from None
    found = rank_process.proc_stat(pid)
    try:
        signal.pidfd_send_signal(fd, 0)  # still alive: the stat just read was the pidfd's process's
        if found is not None and found.parent == standby:
            return pid, fd
    except OSError:
        pass
    os.close(fd)
    raise _NotUsed(f"the standby (pid {standby}) answered with pid {pid}, which is not a process it forked")


def _mirror(sock: socket.socket, worker: int, worker_fd: int) -> None:
    """Be the worker to the launcher: handle each signal as the worker does when it comes (pass it on where
    the worker catches it, ignore it where it ignores it, die of it as the worker would where it has the
    default), and end as it ends. Nothing runs in between: the client sleeps until a signal or its end.
    (It used to copy the worker's dispositions every 10 ms: 9 clients took a tenth of a 2-core machine.)"""
    def on_signal(signum, _frame):
        how = _dispositions(worker).get(signum)  # None: the worker is gone, and its end is on its way
        if how == "caught":
            try:
                signal.pidfd_send_signal(worker_fd, signum)
            except ProcessLookupError:
                pass
        elif how == "default" and signum != signal.SIGCONT:  # SIGCONT's default: the standby continues it
            _die_of(signum)

    for signum in FORWARDED:
        signal.signal(signum, on_signal)
    select.select([sock], [], [])  # a handler runs in between; select goes on waiting after it (PEP 475)
    try:
        end = wire.receive(sock)
    except (OSError, ValueError):
        end = {}
    end = end if isinstance(end, dict) else {}
    sys.stdout.flush()
    if type(end.get("signal")) is int and 0 < end["signal"] < signal.NSIG:
        _die_of(end["signal"])
    if type(end.get("exit")) is int:
        os._exit(end["exit"] & 0xFF)
    try:  # the standby died: its worker dies with it (parent-death signal); make sure
        signal.pidfd_send_signal(worker_fd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    print(f"[resil] standby: the standby process that ran this rank (worker pid {worker}) is gone; the rank "
          f"ends with it; exiting with code 1", file=sys.stderr, flush=True)
    os._exit(1)


def _die_of(signum: int) -> None:
    """End this process of signal `signum`, as its default action would."""
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default is not to end the process


def _dispositions(pid: int) -> dict[int, str]:
    """How process `pid` handles each of FORWARDED: "caught", "ignored" or "default" ({} once it is gone)."""
    masks = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:") and line.split()[1] in ("Z", "X"):
                    return {}  # exited: it handles nothing any more
                if line.startswith(("SigIgn:", "SigCgt:")):
                    masks[line[:6]] = int(line.split()[1], 16)
    except OSError:
        return {}
    return {signum: "caught" if masks.get("SigCgt", 0) >> (signum - 1) & 1 else
            "ignored" if masks.get("SigIgn", 0) >> (signum - 1) & 1 else "default" for signum in FORWARDED}


def fingerprint() -> dict:
    """What decides what an import gives: a standby serves only a client whose fingerprint is its own."""
    import megatron_resil

    env = {k: v for k, v in os.environ.items()
           if k.startswith(_IMPORT_ENV_PREFIXES) and not k.startswith(_NOT_IMPORT_ENV)}
    return {"executable": sys.executable, "prefix": sys.prefix, "version": sys.version,
            "flags": list(sys.flags), "xoptions": sorted(map(str, sys._xoptions.items())),
            "warnoptions": list(sys.warnoptions),
            "megatron_resil": os.path.realpath(os.path.dirname(megatron_resil.__file__)),
            "path": [os.path.realpath(p) for p in sys.path[1:]], "env": env}


def _streams() -> dict:
    """How this interpreter set up stdout and stderr (-u, PYTHONUNBUFFERED, a terminal), for the worker."""
    found = {}
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(getattr(stream, "buffer", None), (io.BufferedWriter, io.FileIO)):
            found[name] = {"encoding": stream.encoding, "errors": stream.errors,
                           "line_buffering": stream.line_buffering, "write_through": stream.write_through,
                           "buffered": isinstance(stream.buffer, io.BufferedWriter)}
    return found


def _set_streams(streams: dict) -> None:
    """The worker's stdout and stderr as the client's interpreter made them, on the client's descriptors."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        how = streams.get(name)
        if how is None:
            continue
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(io.BufferedWriter(raw) if how["buffered"] else raw,
                                  encoding=how["encoding"], errors=how["errors"],
                                  line_buffering=how["line_buffering"], write_through=how["write_through"])
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# ---- the standby -----------------------------------------------------------------------------------------

class _Served:
    def __init__(self, conn: socket.socket, client: int, client_fd: int, worker: int) -> None:
        self.conn, self.client, self.client_fd, self.worker = conn, client, client_fd, worker
        self.worker_fd = os.pidfd_open(worker)
        self.stopped = False
        self.killed = False

    def close(self) -> None:
        for fd in (self.client_fd, self.worker_fd):
            os.close(fd)
        self.conn.close()


def serve(name: str, preload: tuple[str, ...] = PRELOAD, ready_fd: int | None = None,
          torch_only: bool = False) -> None:
    import importlib

    import megatron_resil  # noqa: F401 - its import-time set-up (quiet_imports), as a rank has it
    from megatron_resil.launch.standby_warmup import Warmup

    started = time.monotonic()
    parent = os.getppid()
    value = f"{name}@{os.getpid()}"  # what ranks are started with
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(wire.address(name))
    except OSError as err:
        print(f"[resil] standby: the name {name!r} is taken ({err.strerror}): another process serves it",
              file=sys.stderr, flush=True)
        sys.exit(2)
    # Bound before the imports: a rank that comes meanwhile waits in the backlog (its handshake allows
    # for that), so a launcher started with this standby need not wait for the imports to begin.
    listener.listen(64)
    if ready_fd is not None:
        os.write(ready_fd, b"1")
        os.close(ready_fd)
    for module in preload:
        importlib.import_module(module)
    mine = fingerprint()
    from megatron_resil.patches import torch_startup

    # A fork that torch would refuse CUDA (something asked the CUDA runtime while importing) serves no rank.
    unusable = ("a rank forked from it could not use CUDA (torch was asked about CUDA devices while it "
                "imported)") if torch_startup.forks_cannot_use_cuda() else None
    if unusable is not None:
        print(f"[resil] standby {name!r}: {unusable}; ranks started with {ENV}={value} import torch "
              "themselves", flush=True)
    print(f"[resil] standby {name!r}: ready in {time.monotonic() - started:.1f} s ({', '.join(preload)} "
          f"imported); ranks started with {ENV}={value} are forked from it", flush=True)
    # SIGTERM: no new ranks, and an end once the running ones have ended. Slurm's scancel, requeue and
    # time-limit signal reach every process of the job step, this one and its workers among them: were
    # it to end now, its workers would die with it (parent-death signal) before they could save.
    terminated: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: terminated.append(signum))
    served: dict[int, _Served] = {}
    pending: dict[socket.socket, wire.Pending] = {}
    warmup = Warmup(enabled=not torch_only)  # megatron-core too, for the first pretrain.py run's patches
    while listener is not None or served:
        if listener is not None and (terminated or os.getppid() != parent):
            # No new ranks. The running ones end by themselves: their launcher watch sees the launcher
            # gone and writes the exit record (exit 9), which a standby dying under them would not; or
            # they got the SIGTERM too, and save.
            if served:
                why = "SIGTERM" if terminated else "its parent is gone"
                print(f"[resil] standby {name!r}: {why}: no new ranks; it ends once its {len(served)} "
                      "running rank(s) have", flush=True)
            listener.close()
            listener = None
            for request in pending.values():
                request.close()
            pending.clear()
        waiting = [fd for s in served.values() for fd in (s.client_fd, s.worker_fd)] + list(pending)
        ready, _, _ = select.select(waiting + ([listener] if listener is not None else []), [], [], _TICK)
        if listener is not None and listener in ready:
            _accept(listener, pending)
        for conn in [conn for conn in ready if conn in pending]:
            _take(pending[conn], listener, mine, served, pending, warmup, unusable)
        for request in [r for r in pending.values() if time.monotonic() > r.deadline]:
            # One last look first: it may have come while the standby was busy (importing ahead).
            _take(request, listener, mine, served, pending, warmup, unusable)
            if request.conn in pending:
                del pending[request.conn]
                got = len(request.data)
                _drop(request, f"not whole {wire.REQUEST_SECS:.0f} s after it came ({got} bytes of it)")
        _tend(served)


def _take(request: wire.Pending, listener: socket.socket, mine: dict, served: dict[int, _Served],
          pending: dict[socket.socket, wire.Pending], warmup, unusable: str | None) -> None:
    """Read what has come of a pending request and, once it is whole, answer it; whatever goes wrong
    drops this connection with one line, and the standby serves on."""
    try:
        if request.read():
            del pending[request.conn]
            _answer(request, listener, mine, served, pending, warmup, unusable)
    except Exception as err:  # noqa: BLE001 - whatever a request does, the standby serves on
        pending.pop(request.conn, None)
        _drop(request, err if isinstance(err, ValueError) else f"{type(err).__name__}: {err}")


def _accept(listener: socket.socket, pending: dict[socket.socket, wire.Pending]) -> None:
    """Take a connection: a client of this uid is read from without waiting; anyone else is closed."""
    try:
        conn, _ = listener.accept()
    except OSError as err:  # out of descriptors, say: the rank waits in the backlog (its handshake allows)
        print(f"[resil] standby: cannot take a connection ({err.strerror})", flush=True)
        return
    try:
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        request = wire.Pending(conn, pid)
    except OSError as err:
        print(f"[resil] standby: dropped a connection: {err.strerror}", flush=True)
        conn.close()
        return
    if uid != os.geteuid():
        _drop(request, f"uid {uid} is not the standby's ({os.geteuid()}): nothing read")
    elif len(pending) >= _MAX_PENDING:
        _drop(request, f"{_MAX_PENDING} requests are being read already")
    else:
        pending[conn] = request


def _drop(request: wire.Pending, why: object) -> None:
    print(f"[resil] standby: dropped a connection from pid {request.pid}: {str(why)[:300]}", flush=True)
    request.close()


def _answer(request: wire.Pending, listener: socket.socket, mine: dict, served: dict[int, _Served],
            pending: dict[socket.socket, wire.Pending], warmup, unusable: str | None) -> None:
    """A whole request: a ping's answer, a refusal, or a worker forked for the client (which answers it
    itself: _become_worker). Raises ValueError for a request that is not one."""
    conn, pid, fds = request.conn, request.pid, request.fds
    message = request.message()
    why = wire.invalid(message, len(fds))
    if why is not None:
        raise ValueError(f"not a request: {why}")
    conn.settimeout(1.0)  # what the standby sends are a few bytes: never a wait, unless the client is gone
    if "ping" in message:
        wire.send(conn, {"ready": True})
        request.close()
        return
    if message["pid"] != pid:
        raise ValueError(f"it names pid {message['pid']}, not its connection's")
    why = "the rank is the standby's own worker" if pid in served else \
        unusable or _mismatch(mine, message["fingerprint"]) or warmup.refusal(message)
    if why is not None:
        wire.send(conn, {"refused": why})
        request.close()
        return
    client_fd = os.pidfd_open(pid)  # before the fork: a client already gone gets no worker
    # Every object so far out of the collector's sight: a worker's collections then walk only what it made.
    # Walked, each object's header is written, and the copy-on-write pages of torch and megatron-core it
    # shares with the standby are copied, in every worker (a second of nine ranks' start on two cores).
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    worker = os.fork()
    if worker == 0:
        _become_worker(listener, conn, served, pending, message, fds)  # never returns
    try:
        served[worker] = _Served(conn, pid, client_fd, worker)
    except BaseException:
        _signal(worker, signal.SIGKILL)
        os.close(client_fd)
        raise
    for fd in fds:
        os.close(fd)
    request.fds = []


def _mismatch(mine: dict, theirs: dict) -> str | None:
    for key in mine:
        if key == "env":
            names = sorted(set(mine["env"]) | set(theirs.get("env", {})))
            differ = [n for n in names if mine["env"].get(n) != theirs.get("env", {}).get(n)]
            if differ:
                return (f"it was started with another import-time environment ({', '.join(differ[:4])} "
                        f"differ{'s' if len(differ) == 1 else ''})")
        elif mine[key] != theirs.get(key):
            ours, its = mine[key], theirs.get(key)
            if isinstance(ours, list) and isinstance(its, list):  # the first entry that differs
                shorter = min(len(ours), len(its))
                at = next((i for i in range(shorter) if ours[i] != its[i]), shorter)
                ours = ours[at] if at < len(ours) else "(none)"
                its = its[at] if at < len(its) else "(none)"
                key = f"{key} (entry {at})"
            return f"it was started with another {key}: {wire.short(ours)}, this rank's: {wire.short(its)}"
    return None


def _tend(served: dict[int, _Served]) -> None:
    for worker, s in list(served.items()):
        try:
            done, status = os.waitpid(worker, os.WNOHANG)
        except ChildProcessError:
            done, status = worker, 0
        if done:
            end = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else \
                {"exit": os.waitstatus_to_exitcode(status)}
            if end.get("signal") == signal.SIGKILL:  # at once, stopped or not (a rank monitor's kill)
                _signal(s.client, signal.SIGKILL)
            try:
                wire.send(s.conn, end)
            except OSError:
                pass
            s.close()
            del served[worker]
            continue
        found = rank_process.proc_stat(s.client)
        state = found.state if found else None
        if state is None or state in "ZX":
            if not s.killed:
                _signal(worker, signal.SIGKILL)
                s.killed = True
        elif (state == "T") != s.stopped:
            s.stopped = state == "T"
            _signal(worker, signal.SIGSTOP if s.stopped else signal.SIGCONT)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _become_worker(listener, conn, served, pending, request: dict, fds: list[int]) -> None:
    """In the fork: take the client's settings and say so, or refuse it; once the client has checked
    this process and said go, become its rank and run pretrain.py as its __main__. Never returns."""
    go = False
    try:
        listener.close()
        for s in served.values():
            s.close()
        for other in pending.values():
            other.close()
        os.setsid()  # as torchrun starts a rank: a session of its own
        _die_with_parent()
        conn.settimeout(_HANDSHAKE_SECS)
        refused = standby_settings.take(request)
        if refused is not None:
            print(f"[resil] standby: refused pid {request['pid']}: {refused}", flush=True)
            wire.send(conn, {"refused": refused})
        else:
            wire.send(conn, {"pid": os.getpid()})
            go = wire.receive(conn) == {"go": True}
        conn.close()
    except (OSError, ValueError):  # the client is gone or did not answer: it imports for itself
        go = False
    except BaseException:  # noqa: BLE001 - a bug: Python's report, in the standby's output; nothing runs
        import traceback

        traceback.print_exc()
        go = False
    finally:
        if not go:
            os._exit(0)
    _run_as_rank(request, fds)


def _run_as_rank(request: dict, fds: list[int]) -> None:
    """The worker, let go by its client: its descriptors, directory, environment and streams, then
    pretrain.py as __main__; exit as it ends. Never returns."""
    code = 1
    try:
        for target, fd in zip(request["fds"], fds, strict=True):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        for sig in FORWARDED + (signal.SIGTERM,):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _set_streams(request["streams"])
        sys.argv[:] = request["argv"]
        sys.path[:] = request["path"]
        rank_process.became_worker_of(request["pid"])
        phase_marks.adopt_process_marks(request["marks"])
        import runpy

        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - a bug: Python's report, and its exit code
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _die_with_parent() -> None:
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def ping(value: str) -> bool:
    """Whether the standby `value` (NAME@PID or NAME, as in MEGATRON_RESIL_STANDBY) answers, checked as a
    rank checks it (for scripts and tests that start one and wait for it)."""
    try:
        sock, _pid = _connect(value)  # it may still be importing: the handshake's timeout allows for that
    except _NotUsed:
        return False
    with sock:
        try:
            wire.send(sock, {"ping": True})
            reply = wire.receive(sock)
        except (OSError, ValueError):
            return False
    return isinstance(reply, dict) and reply.get("ready") is True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(prog="python -m megatron_resil.launch.standby", description=(
        "Import torch once and fork each rank started with MEGATRON_RESIL_STANDBY=NAME@PID from it "
        "(docs/standby.md; it prints that value when it is ready). It ends after its parent, once its "
        "ranks have. With `-- LAUNCHER ARGS...`: start the standby, then run the launcher in this process "
        "with MEGATRON_RESIL_STANDBY set; the standby ends after it."))
    parser.add_argument("--name", help=f"the name ranks find it by (default: ${ENV}'s; with a launcher: "
                                       "'launcher'; this process's pid is added, so each launcher on a host "
                                       "has its own)")
    ahead = parser.add_mutually_exclusive_group()
    ahead.add_argument("--import-megatron-core", dest="torch_only", action="store_false", default=None,
                       help="also install the first pretrain.py run's patches and import megatron-core "
                            "before forking ranks (the default with a launcher: its ranks are one run's); "
                            "ranks of a run with other patches import for themselves")
    ahead.add_argument("--torch-only", dest="torch_only", action="store_true",
                       help="import torch only (the default without a launcher: a standby named for a node "
                            "may serve different runs)")
    parser.add_argument("--ranks-per-node", metavar="N",
                        help="with `-- COMMAND`: the ranks per node of the launchers COMMAND starts (their "
                             "--nproc-per-node), where COMMAND does not say it (a script that starts them)")
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)  # written to once it serves
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if "--" in argv and not command:
        parser.error("name the launcher to run after --")
    if args.ranks_per_node is not None and not command:
        parser.error("--ranks-per-node goes with `-- COMMAND`")
    if command:
        return _serve_then_run(f"{args.name or 'launcher'}-{os.getpid()}", command, bool(args.torch_only),
                               args.ranks_per_node)
    args.name = args.name or os.environ.get(ENV, "").partition("@")[0]
    if not args.name:
        parser.error(f"--name is required (or set {ENV})")
    if "@" in args.name:
        parser.error(f"--name {args.name!r}: a name has no '@' ({ENV}=NAME@PID adds the standby's pid)")
    serve(args.name, ready_fd=args.ready_fd, torch_only=args.torch_only is not False)
    return 0


def set_import_time_defaults(argv: list[str], env) -> None:
    """What pretrain.py (with arguments `argv`) sets in `env` before torch is imported, here so that a
    launcher's standby imports torch as its ranks would. --inprocess-restart: NVRx polls its store once a
    second, and each poll that times out makes torch print two C++ warnings per rank; torch reads this
    level once, at import, and Megatron only advises setting it. A level the user set is kept."""
    if "--inprocess-restart" in argv:
        env.setdefault("TORCH_CPP_LOG_LEVEL", "error")


def ranks_environment(command: list[str], env: dict[str, str] | None = None,
                      nproc: str | None = None) -> dict[str, str]:
    """The import-time environment the launcher `command` gives its ranks, for its standby: torchrun and
    ft_launcher set OMP_NUM_THREADS=1 for more than one rank per node (`nproc`, else the command's
    --nproc-per-node) when it is not set, and pretrain.py its own defaults (`set_import_time_defaults`)."""
    env = dict(os.environ if env is None else env)
    set_import_time_defaults(command, env)
    for i, arg in enumerate(command):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if arg == flag and i + 1 < len(command):
                nproc = command[i + 1]
            elif arg.startswith(flag + "="):
                nproc = arg.split("=", 1)[1]
    if nproc is not None and "OMP_NUM_THREADS" not in env and not (nproc.isdigit() and int(nproc) <= 1):
        env["OMP_NUM_THREADS"] = "1"  # "gpu", "auto": more than one where it matters; one: a mismatch, said
    return env


def _serve_then_run(name: str, command: list[str], torch_only: bool = False,
                    nproc: str | None = None) -> int:
    """Start the standby as a process of its own (its command line names no run), wait until its socket is
    bound (its imports go on beside the launcher's start-up; ranks that come before they end wait for
    them), then become the launcher (exec): the standby's parent is then the launcher."""
    ready_r, ready_w = os.pipe()
    standby = subprocess.Popen([sys.executable, "-m", "megatron_resil.launch.standby", "--name", name,
                                "--torch-only" if torch_only else "--import-megatron-core",
                                "--ready-fd", str(ready_w)],
                               pass_fds=(ready_w,), env=ranks_environment(command, nproc=nproc))
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        started = ready.read(1) == b"1"  # EOF without it: the standby could not bind (its line says why)
    env = dict(os.environ)
    if started:
        env[ENV] = f"{name}@{standby.pid}"  # the ranks check that the name's holder is this process
    else:
        env.pop(ENV, None)
        print("[resil] standby: not started; the ranks import torch themselves", file=sys.stderr, flush=True)
    sys.stdout.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as err:
        print(f"[resil] standby: cannot run the launcher {command[0]!r} ({err.strerror})", file=sys.stderr)
        return 2


if __name__ == "__main__":  # run as the module itself, not as __main__: a worker's pretrain.py imports it
    from megatron_resil import process_exit
    from megatron_resil.launch import standby

    # Without the interpreter's teardown of torch and megatron-core (0.5 s or more of CPU, beside the next
    # job step's start; under Slurm the job step waits for this process too).
    process_exit.run(standby.main)
