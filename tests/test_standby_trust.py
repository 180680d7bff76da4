"""Trust between a rank and its standby (issue 35, docs/standby.md "Who may connect"), each case built for
real: another user binds the standby's name first, a process of this user holds it under another pid or
answers with a process it did not fork, a client runs under taskset, nice, prlimit and a NUMA policy, a
standby cannot give a client its limits, and malformed or trickling requests come while a served rank is
stopped, continued and killed. The ranks here are tests/standby_client.py (a process that hands itself
over as pretrain.py does, without torch), except where a rank must train: then pretrain.py under torchrun.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

import pytest

from megatron_resil.launch import standby, standby_settings
from megatron_resil.launch import standby_wire as wire
from tests import launch

CLIENT = str(Path(__file__).with_name("standby_client.py"))
SERVE = "import sys; from megatron_resil.launch import standby; standby.serve(sys.argv[1], preload=())"
NOBODY = 65534


def story(test):
    """A case of issue 35: it starts processes (slow) and runs on both lanes (compat)."""
    return pytest.mark.slow(pytest.mark.compat(test))


def _wait(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)


def _start_standby(directory: Path, name: str, prefix: tuple[str, ...] = ()):
    """A standby that imports nothing ahead (serve() itself, as `python -m megatron_resil.launch.standby` runs
    it): its value (NAME@PID), process and log."""
    log = directory / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*prefix, sys.executable, "-c", SERVE, name], env=launch.env(standby=False),
                                cwd=launch.REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    value = f"{name}@{proc.pid}"
    deadline = time.monotonic() + 60
    while not standby.ping(value):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the standby did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return value, proc, log


@pytest.fixture(scope="module")
def own_standby(tmp_path_factory):
    value, proc, log = _start_standby(tmp_path_factory.mktemp("standby"), f"trust-{os.getpid()}")
    yield value, proc, log
    proc.terminate()
    proc.wait(timeout=30)


def _client(value: str, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, CLIENT, *args],
                            env={**launch.env(standby=False), standby.ENV: value}, cwd=launch.REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _first_line(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, int]:
    """The client's `forked PID` or `cold PID`."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the client said nothing within {timeout} s"
    line = proc.stdout.readline().split()
    assert len(line) == 2, (line, proc.stderr.read() if proc.poll() is not None else "")
    return line[0], int(line[1])


def _finish(proc: subprocess.Popen) -> tuple[str, str]:
    """What the client wrote (stdout, stderr), once it has ended."""
    return proc.communicate(timeout=60)


def _resil_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[resil]")]


def _unrelated() -> subprocess.Popen:
    """A process of this test's own, which no standby forked: nothing may signal it."""
    return subprocess.Popen(["sleep", "600"])


def _hold_name(name: str, answer: int, uid: int | None = None) -> tuple[int, TextIO]:
    """A process (this test's fork, as `uid` if given) that binds `name` first, as anyone may. It takes
    one connection, reads a whole request if one comes, answers it with `answer` as the pid of its
    "worker" (what a listener did to a root rank: it then SIGKILLed that pid) and closes; then it
    reports what it received on the pipe returned with its pid."""
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the other process
        try:
            os.close(ready_r)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(wire.address(name))
            server.listen(8)
            os.write(ready_w, b"listening\n")
            server.settimeout(120)
            conn, _ = server.accept()
            conn.settimeout(60)
            data, fds = b"", 0
            while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
                chunk, ancillary, _flags, _addr = conn.recvmsg(1 << 16, socket.CMSG_SPACE(16 * 4))
                for _level, _kind, raw in ancillary:
                    fds += len(raw) // 4
                if not chunk:
                    break
                data += chunk
            if data:
                payload = json.dumps({"pid": answer}).encode()
                conn.sendall(struct.pack("!I", len(payload)) + payload)
            conn.close()
            os.write(ready_w, json.dumps({"bytes": len(data), "fds": fds}).encode() + b"\n")
        finally:
            os._exit(0)
    os.close(ready_w)
    reader = os.fdopen(ready_r)
    assert reader.readline() == "listening\n"
    return child, reader


def _report(child: int, reader: TextIO) -> dict:
    ready, _, _ = select.select([reader], [], [], 60)
    assert ready, "the name's holder reported nothing"
    report = json.loads(reader.readline())
    reader.close()
    os.waitpid(child, 0)
    return report


# ---- 1. the client authenticates the server before it sends anything ------------------------------

@story
@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user")
def test_a_name_bound_first_by_another_user_gets_nothing_and_the_rank_trains_cold(tmp_path):
    name = f"taken-{os.getpid()}"
    bystander = _unrelated()
    holder, report = _hold_name(name, answer=bystander.pid, uid=NOBODY)
    try:
        env = {**launch.env(), standby.ENV: name}  # a bare name: its holder's uid is checked
        args = [*launch.TINY_MODEL, *launch.TINY_TRAINING, "--train-iters", "3"]
        command = launch.torchrun_cmd(args, nproc=1)
        out = subprocess.run(command, env=env, cwd=launch.REPO, capture_output=True, text=True, timeout=240)
        got = _report(holder, report)
        assert got == {"bytes": 0, "fds": 0}, got  # no environment, command line or descriptor
        assert out.returncode == 0, out.stderr[-3000:]
        assert "iteration        3/" in out.stdout  # trained cold
        assert [ln for ln in out.stderr.splitlines() if ln.startswith("[resil] standby")] == [
            f"[resil] standby: {standby.ENV}={name} not used: the process holding that name (pid {holder}) "
            f"runs as uid {NOBODY}, this rank as 0; nothing was sent to it; this rank imports torch itself"]
        assert bystander.poll() is None  # never killed
    finally:
        bystander.kill()
        bystander.wait()


@story
@pytest.mark.parametrize("recorded", ["another pid", "its own pid"])
def test_a_process_of_this_user_that_is_not_the_recorded_standby_is_never_handed_a_rank(recorded):
    """NAME@PID: the name's holder must be PID (else nothing is sent), and the worker it answers with a
    process it forked (else the rank imports for itself, and nothing is signalled)."""
    name = f"fake-{os.getpid()}-{recorded.split()[0]}"
    bystander = _unrelated()
    holder, report = _hold_name(name, answer=bystander.pid)
    try:
        pid = bystander.pid if recorded == "another pid" else holder
        client = _client(f"{name}@{pid}")
        kind, _ = _first_line(client)
        out, err = _finish(client)
        got = _report(holder, report)
        assert kind == "cold" and client.returncode == 0, err
        if recorded == "another pid":
            assert got == {"bytes": 0, "fds": 0}, got
            why = (f"the process holding that name is pid {holder}, not the standby's pid {pid}; nothing "
                   "was sent to it")
        else:
            why = (f"the standby (pid {holder}) answered with pid {bystander.pid}, which is not a process "
                   "it forked")
        assert _resil_lines(err) == [f"[resil] standby: {standby.ENV}={name}@{pid} not used: {why}; this "
                                     "rank imports torch itself"], err
        assert bystander.poll() is None  # never signalled
    finally:
        bystander.kill()
        bystander.wait()


@story
def test_a_malformed_value_is_said_and_the_rank_imports_for_itself(own_standby):
    value, _proc, _log = own_standby
    client = _client(value + "x")  # NAME@PIDx
    kind, pid = _first_line(client)
    _out, err = _finish(client)
    assert (kind, pid) == ("cold", client.pid)
    assert _resil_lines(err) == [f"[resil] standby: {standby.ENV}={value}x not used: not NAME or NAME@PID "
                                 "(the standby's pid, as `python -m megatron_resil.launch.standby --name "
                                 "NAME` prints it); this rank imports torch itself"]


# ---- 2. a forked rank keeps its affinity, nice value, rlimits and NUMA policy -------------------------

def _proc_field(pid: int, name: str, key: str) -> str:
    for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
        if line.startswith(key):
            return line[len(key):].strip()
    raise AssertionError(f"no {key} in /proc/{pid}/{name}")


def test_what_the_standby_imported_is_out_of_a_forked_ranks_collector_sight(own_standby):
    """gc.freeze() before each fork: a worker's collections walk only what it made itself. Walking the rest
    would write every object's header and so copy each page the worker shares with the standby (a second
    of nine ranks' start on two cores, BENCHMARKS.md)."""
    value, _proc, _log = own_standby
    forked, cold = _client(value, "frozen"), _client("", "frozen")
    try:
        assert _first_line(forked)[0] == "forked" and _first_line(cold)[0] == "cold"
        frozen = {name: int(proc.stdout.readline().split()[1]) for name, proc in (("forked", forked),
                                                                                   ("cold", cold))}
        # torch's objects, at least (Python 3.12 starts with a few hundred frozen of its own)
        assert frozen["forked"] > frozen["cold"] + 10_000, frozen
    finally:
        for proc in (forked, cold):
            proc.kill()
            proc.wait()


@story
@pytest.mark.skipif(1 not in os.sched_getaffinity(0) or not shutil.which("prlimit"),
                    reason="needs CPU 1 and util-linux's prlimit")
def test_a_forked_rank_keeps_its_cpus_nice_value_limits_and_numa_policy(own_standby):
    value, proc, _log = own_standby
    numa = Path("/proc/self/numa_maps").exists()  # a kernel with NUMA (one node is enough)
    prefix = ("taskset", "-c", "1", "nice", "-n", "5", "prlimit", "--nofile=200", "--core=0")
    client = _client(value.partition("@")[0], "wait", *(["--prefer-node", "0"] if numa else []),
                     prefix=prefix)  # a bare name: the uid is checked, and this is the standby
    try:
        kind, worker = _first_line(client)
        assert kind == "forked" and launch.proc_stat(worker).parent == proc.pid
        assert _proc_field(worker, "status", "Cpus_allowed_list:") == "1"
        assert launch.proc_stat(worker).nice == 5
        limits = Path(f"/proc/{worker}/limits").read_text()
        assert limits == Path(f"/proc/{client.pid}/limits").read_text()  # every limit, soft and hard
        assert "Max open files            200                  200" in limits
        assert "Max core file size        0                    0" in limits
        if numa:  # the task's policy shows on the mappings that have none of their own
            maps = Path(f"/proc/{worker}/numa_maps").read_text().splitlines()
            policies = {line.split()[1] for line in maps}
            assert "prefer:0" in policies and "default" not in policies, policies
    finally:
        client.kill()
        client.wait()


@story
@pytest.mark.skipif(not shutil.which("setpriv") or not shutil.which("prlimit"),
                    reason="needs util-linux's setpriv and prlimit")
def test_a_client_whose_limits_the_standby_cannot_give_is_refused_and_imports_for_itself(tmp_path):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # the client's, as this process's
    if hard != resource.RLIM_INFINITY and hard <= 512:
        pytest.skip("needs a hard limit of open files above 512")
    # The standby's hard limit of open files is below the client's, and it may not raise it.
    prefix = ("prlimit", "--nofile=256:512", "setpriv", "--bounding-set", "-sys_resource", "--")
    value, proc, log = _start_standby(tmp_path, f"limited-{os.getpid()}", prefix)
    try:
        client = _client(value)
        kind, pid = _first_line(client)
        _out, err = _finish(client)
        assert (kind, pid) == ("cold", client.pid), err
        (line,) = _resil_lines(err)
        assert line.startswith(f"[resil] standby: {standby.ENV}={value} not used: its RLIMIT_NOFILE ") and \
            "cannot be given here (the standby has 256:512; not allowed to raise maximum limit)" in line, line
        assert f"[resil] standby: refused pid {client.pid}: its RLIMIT_NOFILE" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---- 3. no request can stall the standby or end it ----------------------------------------------------

def _framed(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


def _state(pid: int) -> str:
    found = launch.proc_stat(pid)
    return found.state if found else "gone"


class _Trickle(threading.Thread):
    """A connection that sends a plausible request one byte every 2 s, for as long as it is let."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(daemon=True)
        self.sock, self.stop = sock, threading.Event()

    def run(self) -> None:
        for byte in _framed(b'{"argv": ["pretrain.py"]}'):
            try:
                self.sock.send(bytes([byte]))
            except OSError:
                return  # dropped
            if self.stop.wait(2.0):
                return


BAD = {
    "an array": _framed(b"[]"),
    "deep nesting": _framed(b"[" * 100000),
    "an oversized length": struct.pack("!I", 0xFFFFFFFF),
    "a trickle": None,
}
DROPPED = {
    "an array": "not a request: a JSON list, not an object",
    "deep nesting": f"100000 arrays or objects (at most {wire.MAX_CONTAINERS})",
    "an oversized length": f"a message of {0xFFFFFFFF} bytes (at most {wire.MAX_MESSAGE})",
    "a trickle": f"not whole {wire.REQUEST_SECS:.0f} s after it came",
}


@story
@pytest.mark.parametrize("bad", list(BAD))
def test_a_bad_or_slow_request_neither_stalls_nor_ends_the_standby(own_standby, bad):
    value, proc, log = own_standby
    served = _client(value, "wait")  # a rank the standby runs all along
    kind, worker = _first_line(served)
    assert kind == "forked"
    said = log.read_text().count("dropped a connection")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    trickle = None
    try:
        sock.connect(wire.address(value.partition("@")[0]))
        if BAD[bad] is None:
            trickle = _Trickle(sock)
            trickle.start()
        else:
            sock.sendall(BAD[bad])  # and the connection stays open
        # Meanwhile the served rank is stopped, continued and killed with its client.
        os.kill(served.pid, signal.SIGSTOP)
        _wait(lambda: _state(worker) == "T", "the worker stopped with its client", timeout=5)
        os.kill(served.pid, signal.SIGCONT)
        _wait(lambda: _state(worker) in ("R", "S"), "the worker continued with its client", timeout=5)
        another = _client(value)  # and a new rank is served
        assert _first_line(another)[0] == "forked"
        _finish(another)
        assert another.returncode == 0
        os.kill(served.pid, signal.SIGKILL)
        _wait(lambda: not launch.alive(worker), "the worker killed with its client", timeout=5)
        # The bad connection is dropped with one line (a trickle at its deadline).
        _wait(lambda: log.read_text().count("dropped a connection") > said, "the bad connection dropped",
              timeout=wire.REQUEST_SECS + 20)
        lines = [ln for ln in log.read_text().splitlines() if "dropped a connection" in ln][said:]
        assert lines == [f"[resil] standby: dropped a connection from pid {os.getpid()}: {DROPPED[bad]}"] \
            or bad == "a trickle" and len(lines) == 1 and lines[0].startswith(
                f"[resil] standby: dropped a connection from pid {os.getpid()}: {DROPPED[bad]} ("), lines
        assert proc.poll() is None and standby.ping(value)
    finally:
        if trickle is not None:
            trickle.stop.set()
        sock.close()
        served.kill()
        served.wait()


@story
def test_sigterm_ends_the_standby_only_once_its_ranks_have_ended(tmp_path):
    """Slurm's scancel, requeue and time limit signal every process of the job step: the standby's
    SIGTERM must leave its ranks the time to save (tests/test_slurm.py runs that story)."""
    value, proc, log = _start_standby(tmp_path, f"term-{os.getpid()}")
    served = _client(value, "wait")
    try:
        kind, worker = _first_line(served)
        assert kind == "forked"
        proc.terminate()
        _wait(lambda: "SIGTERM: no new ranks" in log.read_text() or proc.poll() is not None, "its line")
        assert proc.poll() is None and launch.alive(worker), "the standby ended under its running rank"
        late = _client(value)  # no new ranks: it imports for itself
        assert _first_line(late)[0] == "cold"
        _finish(late)
        assert launch.alive(worker) and proc.poll() is None
        served.stdin.close()  # the rank ends
        assert served.wait(timeout=30) == 0
        assert proc.wait(timeout=30) == 0  # and then the standby
    finally:
        served.kill()
        proc.kill()
        proc.wait()


# ---- what a message may be ----------------------------------------------------------------------------

def _request() -> dict:
    """A request as a client builds it (standby.hand_over)."""
    return {"argv": ["pretrain.py", "--lr", "1e-3"], "env": {"PATH": "/usr/bin"}, "cwd": "/", "path": ["/x"],
            "umask": 0o22, "pid": os.getpid(), "fds": [0, 1, 2],
            "streams": {"stdout": {"encoding": "utf-8", "errors": "strict", "line_buffering": False,
                                   "write_through": False, "buffered": True}},
            "marks": {"interpreter": time.time()}, "fingerprint": standby.fingerprint(),
            **standby_settings.current()}


@pytest.mark.parametrize("field,value", [
    ("argv", 5), ("argv", []), ("argv", ["pretrain.py", 3]), ("env", {"A": 1}), ("env", {"A=B": "c"}),
    ("env", {"A": "nul\0"}), ("cwd", None), ("path", "/x"), ("umask", 0o1000), ("umask", True), ("pid", 0),
    ("pid", "1"), ("fds", [0, 0, 1]), ("fds", [3]), ("streams", {"stdin": {}}),
    ("streams", {"stdout": {"encoding": "utf-8"}}), ("marks", {"a": "b"}), ("fingerprint", []),
    ("fingerprint", {"env": {"A": 1}}), ("fingerprint", {"path": "/x"}),
    ("fingerprint", {"env": {}, "path": [["/x"]]}), ("affinity", []), ("affinity", [-1]), ("nice", 20),
    ("nice", 1.5),
    ("rlimits", {}), ("rlimits", {**standby_settings.current()["rlimits"], "RLIMIT_NOFILE": [1]}),
    ("mempolicy", {"mode": 1}), ("mempolicy", {"mode": 1, "nodes": [standby_settings.MAX_NUMA_NODES]}),
])
def test_a_request_whose_field_has_the_wrong_type_is_not_one(field, value):
    assert wire.invalid(_request(), 3) is None
    assert wire.invalid({**_request(), field: value}, 3) == f"fields of the wrong type: {field}"


def test_what_is_not_a_request():
    assert wire.invalid([], 0) == "a JSON list, not an object"
    assert wire.invalid({"ping": True}, 0) is None
    assert wire.invalid({"ping": True}, 1) == "a ping with descriptors"
    assert wire.invalid({**_request(), "extra": 1}, 3) == "missing or unknown fields: ['extra']"
    assert wire.invalid(_request(), 2) == "it names 3 descriptors and passed 2"
    # What a message can make the parser build is bounded before it parses: millions of arrays, or of
    # items, within the 8 MiB (seconds of the standby's time, and memory), and depth beyond its guard.
    for message, why in ((b"[" * 100000, "100000 arrays or objects"), (b"[]," * 2_000_000, "arrays or"),
                         (b"[" + b"0," * 2_000_000 + b"0]", "over 65536 items")):
        with pytest.raises(ValueError, match=why):
            wire.decode(message)
    try:  # as deep as the bounds let through: the parser's guard stops it, or the schema refuses it
        deep = wire.decode(b"[" * wire.MAX_CONTAINERS + b"]" * wire.MAX_CONTAINERS)
    except ValueError as err:
        assert str(err) == "nested deeper than the parser allows"
    else:
        assert wire.invalid(deep, 0) == "a JSON list, not an object"
    request = json.dumps(_request())
    assert wire.decode(request.encode()) == json.loads(request)


def test_two_messages_that_arrive_together_are_read_one_at_a_time():
    """A worker that refuses its client sends {"refused": ...} and ends, and the standby then sends the
    client that worker's end: both can be in the socket before the client reads. A read of more than one
    message made the client's JSON parser fail on the second ("Extra data"), and the refusal's reason was
    lost (CI, stop 46)."""
    left, right = socket.socketpair()
    with left, right:
        wire.send(left, {"refused": "its RLIMIT_NOFILE 1024:1048576 cannot be given here"})
        wire.send(left, {"exit": 0})
        assert wire.receive(right) == {"refused": "its RLIMIT_NOFILE 1024:1048576 cannot be given here"}
        assert wire.receive(right) == {"exit": 0}
        left.close()
        with pytest.raises(ValueError, match="the connection closed"):
            wire.receive(right)
