"""Ranks that start with torch already imported: a standby process per node, and pretrain.py its client.

A rank spends most of its start-up, and of every restart, importing torch and what megatron-core imports
from it (issue 26's split: 56-67% of a restart on our machines). `python -m megatron_resil.standby --name N`
imports them once and waits. A pretrain.py started with MEGATRON_RESIL_STANDBY=N in its environment (by
torchrun, ft_launcher, srun, after every restart) hands its command line, environment, working directory
and standard streams to the standby, which forks a worker that runs pretrain.py with them. The arguments,
our patches and everything after are decided in the worker as in any rank; a launcher's standby also
imports megatron-core ahead, with the first run's patches (standby_warmup.py), and serves only ranks whose
run installs the same.

The process the launcher started (the client) stays, and is the rank to everyone outside:
- a signal it can catch (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCONT) is handled as the
  worker handles it, which the client reads from /proc every 10 ms: passed on where the worker catches it,
  ignored where it ignores it, and where the worker has the default the client dies of it (and so the
  worker: see below), as the rank itself would;
- SIGSTOP and SIGKILL cannot be caught: the standby watches each client and stops, continues or kills
  its worker when the client is stopped, continued or gone (a pidfd for death, /proc every 20 ms for
  stops), so a launcher's or a test's kill of "the rank" keeps its meaning;
- the worker's end is the client's: the same exit code, or the same signal.
The worker knows its client (`launched_pid`, `launcher_pid`): the launcher watch and the restart phases
ask about the process the launcher started, not the fork.

What was imported must be what the rank would have imported: the standby serves only a client with the
same interpreter, the same megatron_resil, the same module search path and the same import-time
environment (PYTHON*, TORCH*, OMP_*, ... below); otherwise, or with no standby answering, the rank says so
in one line and imports for itself. --inprocess-restart keeps its processes and does not use a standby.
Only a client of the standby's own user is served (SO_PEERCRED). The socket is in Linux's abstract
namespace: nothing is written on disk.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

ENV = "MEGATRON_RESIL_STANDBY"  # the name of the standby a rank hands itself to
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
_FOLLOW_SECS = 0.01  # seconds between a client's looks at how its worker handles signals (0.2% of a core)
_HEADER = struct.Struct("!I")

_client: int | None = None  # in a worker: the pid of the process the launcher started


# ---- what every rank asks ------------------------------------------------------------------------------

def in_worker() -> bool:
    return _client is not None


def launched_pid() -> int:
    """The process the launcher started for this rank: this one, or a standby worker's client."""
    return _client if _client is not None else os.getpid()


def launcher_pid() -> int:
    """The parent of the process the launcher started (0 once that process is gone)."""
    if _client is None:
        return os.getppid()
    fields = _stat(_client)
    return 0 if fields is None or fields[0] in ("Z", "X") else int(fields[1])


# ---- the client: pretrain.py's first lines --------------------------------------------------------------

def hand_over() -> None:
    """Run this rank in the standby named by MEGATRON_RESIL_STANDBY, if there is one that fits: then this
    process only mirrors its worker and never returns. Otherwise return, having said why in one line."""
    name = os.environ.get(ENV)
    if not name or _client is not None:
        return
    if "--inprocess-restart" in sys.argv[1:]:
        return _not_used(name, "--inprocess-restart restarts within its processes")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(_address(name))
    except OSError as err:
        sock.close()
        return _not_used(name, f"no standby answers ({err.strerror or err})")
    fds = [fd for fd in (0, 1, 2) if _is_open(fd)]
    umask = os.umask(0)
    os.umask(umask)
    from megatron_resil import restart_phases

    request = {"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(), "path": sys.path,
               "umask": umask, "pid": os.getpid(), "fds": fds,
               "streams": _streams(), "marks": restart_phases.process_marks(), "fingerprint": fingerprint()}
    try:
        sock.settimeout(_HANDSHAKE_SECS)  # a stopped or stuck standby: import here instead (a worker it
        _send(sock, request, fds)  # forks later finds no one to tell its pid to, and is killed)
        reply = _receive(sock)
        sock.settimeout(None)
    except (OSError, ValueError) as err:
        sock.close()
        return _not_used(name, f"the standby did not answer ({err})")
    if "refused" in reply:
        sock.close()
        return _not_used(name, reply["refused"])
    _mirror(sock, int(reply["pid"]))


def _not_used(name: str, why: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"[resil] standby: {ENV}={name} not used: {why}; this rank imports torch itself",
              file=sys.stderr, flush=True)


def _mirror(sock: socket.socket, worker: int) -> None:
    """Be the worker to the launcher: handle each signal as the worker does (pass on the ones it catches,
    ignore the ones it ignores, die of the others as it would), and end as it ends."""
    def forward(signum, _frame):
        try:
            os.kill(worker, signum)
        except ProcessLookupError:
            pass

    followed: dict[int, object] = {}
    while not select.select([sock], [], [], _FOLLOW_SECS)[0]:
        for signum, how in _dispositions(worker).items():
            handler = forward if how == "caught" else signal.SIG_IGN if how == "ignored" else signal.SIG_DFL
            if followed.get(signum) is not handler:
                signal.signal(signum, handler)
                followed[signum] = handler
    try:
        end = _receive(sock)
    except (OSError, ValueError):
        end = {}
    sys.stdout.flush()
    if "signal" in end:
        signum = int(end["signal"])
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # a signal whose default is not to end the process
    if "exit" in end:
        os._exit(int(end["exit"]))
    try:  # the standby died: its worker dies with it (parent-death signal); make sure
        os.kill(worker, signal.SIGKILL)
    except ProcessLookupError:
        pass
    print(f"[resil] standby: the standby process that ran this rank (worker pid {worker}) is gone; the rank "
          f"ends with it; exiting with code 1", file=sys.stderr, flush=True)
    os._exit(1)


def _dispositions(pid: int) -> dict[int, str]:
    """How process `pid` handles each of FORWARDED: "caught", "ignored" or "default" ({} once it is gone)."""
    masks = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
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


# ---- the wire ------------------------------------------------------------------------------------------

def _address(name: str) -> bytes:
    return b"\0megatron-resil-standby/" + name.encode()


def _send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    payload = json.dumps(message).encode()
    data = _HEADER.pack(len(payload)) + payload
    if fds:
        rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))
        sent = sock.sendmsg([data], [rights])
        data = data[sent:]
    if data:
        sock.sendall(data)


def _receive(sock: socket.socket, fds_out: list[int] | None = None) -> dict:
    """One message; the descriptors that came with it are appended to `fds_out`."""
    data = b""
    while len(data) < _HEADER.size or len(data) < _HEADER.size + _HEADER.unpack_from(data)[0]:
        if fds_out is not None:
            chunk, ancillary, _flags, _addr = sock.recvmsg(1 << 16, socket.CMSG_SPACE(16 * 4))
            for level, kind, raw in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds_out.extend(struct.unpack(f"{len(raw) // 4}i", raw[:len(raw) - len(raw) % 4]))
        else:
            chunk = sock.recv(1 << 16)
        if not chunk:
            raise ValueError("the connection closed")
        data += chunk
    return json.loads(data[_HEADER.size:])


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
    from megatron_resil.standby_warmup import Warmup

    started = time.monotonic()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(_address(name))
    except OSError as err:
        print(f"[resil] standby: the name {name!r} is taken ({err.strerror}): another standby serves it",
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
        print(f"[resil] standby {name!r}: {unusable}; ranks started with {ENV}={name} import torch "
              "themselves", flush=True)
    print(f"[resil] standby {name!r}: ready in {time.monotonic() - started:.1f} s ({', '.join(preload)} "
          f"imported); ranks started with {ENV}={name} are forked from it", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the workers die with it (parent-death signal)
    served: dict[int, _Served] = {}
    warmup = Warmup(enabled=not torch_only)  # megatron-core too, for the first pretrain.py run's patches
    while listener is not None or served:
        if listener is not None and os.getppid() != parent:
            # No new ranks. The running ones end by themselves: their launcher watch sees the launcher
            # gone and writes the exit record (exit 9), which a standby dying under them would not.
            listener.close()
            listener = None
        waiting = [fd for s in served.values() for fd in (s.client_fd, s.worker_fd)]
        ready, _, _ = select.select(waiting + ([listener] if listener is not None else []), [], [], _TICK)
        if listener is not None and listener in ready:
            _accept(listener, mine, served, warmup, unusable)
        _tend(served)


def _accept(listener: socket.socket, mine: dict, served: dict[int, _Served], warmup,
            unusable: str | None) -> None:
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        conn.settimeout(10)
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            raise ValueError(f"uid {uid} is not the standby's")
        request = _receive(conn, fds)
        if request.get("ping"):
            _send(conn, {"ready": True})
            raise ValueError("ping")
        why = "the rank is the standby's own worker" if pid in served else \
            unusable or _mismatch(mine, request.get("fingerprint", {})) or warmup.refusal(request)
        if why is not None:
            _send(conn, {"refused": why})
            raise ValueError(why)
        if len(fds) != len(request["fds"]) or request["pid"] != pid:
            raise ValueError("the request does not match its connection")
        client_fd = os.pidfd_open(pid)  # before the fork: a client already gone gets no worker
        sys.stdout.flush()
        sys.stderr.flush()
        worker = os.fork()
        if worker == 0:
            _become_worker(listener, conn, served, request, fds)  # never returns
        served[worker] = _Served(conn, pid, client_fd, worker)
        try:
            _send(conn, {"pid": worker})
        except OSError:  # the client will import for itself: it must not have a twin
            _signal(worker, signal.SIGKILL)
            served[worker].killed = True
    except (OSError, ValueError, KeyError, TypeError):
        conn.close()
    finally:
        for fd in fds:
            os.close(fd)


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
            return f"it was started with another {key}: {ours!r}, this rank's: {its!r}"
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
                _send(s.conn, end)
            except OSError:
                pass
            s.close()
            del served[worker]
            continue
        fields = _stat(s.client)
        state = fields[0] if fields else None
        if state is None or state in "ZX":
            if not s.killed:
                _signal(worker, signal.SIGKILL)
                s.killed = True
        elif (state == "T") != s.stopped:
            s.stopped = state == "T"
            _signal(worker, signal.SIGSTOP if s.stopped else signal.SIGCONT)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, parent, ...); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _become_worker(listener, conn, served, request: dict, fds: list[int]) -> None:
    """In the fork: become the client's rank, then run pretrain.py as its __main__. Never returns."""
    global _client
    code = 1
    try:
        listener.close()
        conn.close()
        for s in served.values():
            s.close()
        os.setsid()  # as torchrun starts a rank: a session of its own
        _die_with_parent()
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
        _set_streams(request.get("streams") or {})
        sys.argv[:] = request["argv"]
        sys.path[:] = request["path"]
        _client = int(request["pid"])
        from megatron_resil import restart_phases

        restart_phases.adopt_process_marks(request.get("marks") or {})
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


def ping(name: str) -> bool:
    """Whether the standby `name` answers (for scripts and tests that start one and wait for it)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(_HANDSHAKE_SECS)  # it may still be importing
            sock.connect(_address(name))
            _send(sock, {"ping": True})
            return bool(_receive(sock).get("ready"))
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(prog="python -m megatron_resil.standby", description=(
        "Import torch once and fork each rank started with MEGATRON_RESIL_STANDBY=NAME from it "
        "(docs/standby.md). It ends after its parent, once its ranks have. With `-- LAUNCHER ARGS...`: "
        "start the standby, then run the launcher in this process with MEGATRON_RESIL_STANDBY set; the "
        "standby ends after it."))
    parser.add_argument("--name", help=f"the name ranks find it by (default: ${ENV}; with a launcher: "
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
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)  # written to once it serves
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if "--" in argv and not command:
        parser.error("name the launcher to run after --")
    if command:
        return _serve_then_run(f"{args.name or 'launcher'}-{os.getpid()}", command, bool(args.torch_only))
    args.name = args.name or os.environ.get(ENV)
    if not args.name:
        parser.error(f"--name is required (or set {ENV})")
    serve(args.name, ready_fd=args.ready_fd, torch_only=args.torch_only is not False)
    return 0


def ranks_environment(command: list[str], env: dict[str, str] | None = None) -> dict[str, str]:
    """The import-time environment the launcher `command` gives its ranks, for its standby: torchrun and
    ft_launcher set OMP_NUM_THREADS=1 for more than one rank per node when it is not set."""
    env = dict(os.environ if env is None else env)
    nproc = None
    for i, arg in enumerate(command):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if arg == flag and i + 1 < len(command):
                nproc = command[i + 1]
            elif arg.startswith(flag + "="):
                nproc = arg.split("=", 1)[1]
    if nproc is not None and "OMP_NUM_THREADS" not in env and not (nproc.isdigit() and int(nproc) <= 1):
        env["OMP_NUM_THREADS"] = "1"  # "gpu", "auto": more than one where it matters; one: a mismatch, said
    return env


def _serve_then_run(name: str, command: list[str], torch_only: bool = False) -> int:
    """Start the standby as a process of its own (its command line names no run), wait until its socket is
    bound (its imports go on beside the launcher's start-up; ranks that come before they end wait for
    them), then become the launcher (exec): the standby's parent is then the launcher."""
    ready_r, ready_w = os.pipe()
    subprocess.Popen([sys.executable, "-m", "megatron_resil.standby", "--name", name,
                      "--torch-only" if torch_only else "--import-megatron-core", "--ready-fd", str(ready_w)],
                     pass_fds=(ready_w,), env=ranks_environment(command))
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        started = ready.read(1) == b"1"  # EOF without it: the standby could not bind (its line says why)
    env = dict(os.environ)
    if started:
        env[ENV] = name
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
    from megatron_resil import standby

    sys.exit(standby.main())
