"""How a rank and its standby talk (standby.py): what a message is, and what a request must be.

A message is JSON behind a 4-byte length, over a Unix stream socket, with descriptors (SCM_RIGHTS) beside
a request. Every message is bounded before it is parsed, in bytes and in how many arrays, objects and
items it can make the parser build (counted at C speed);
the parser's recursion guard bounds its nesting, and a request is checked field by field against a
schema, three levels deep, before anything reads it (issue 35: `[]` and `"[" * 100000` ended the
standby, and every rank it ran, with an AttributeError and a RecursionError). The standby reads requests
as they come, never waiting on one (`Pending`): a connection that sends slowly, or never, is dropped at
its deadline while the standby goes on tending its ranks.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time

from megatron_resil.launch import standby_settings

HEADER = struct.Struct("!I")
# A request is a few KiB to a few hundred (the environment and command line: Linux allows them 6 MiB at
# most), arrives at once, and holds about 40 arrays and objects ("[" and "{") and a few hundred to a few
# thousand commas, strings' own included. The bounds below are far above that, and keep what the largest
# message can cost to parse to a fraction of a second (65536 floats: 0.15 s on a core shared 12 ways).
MAX_MESSAGE = 8 << 20
MAX_CONTAINERS = 4096
MAX_ITEMS = 1 << 16
REQUEST_SECS = 10.0  # from accept() to a request's last byte: the whole request, not each read


def address(name: str) -> bytes:
    """The abstract socket address of the standby `name` (nothing on disk; anyone may bind it)."""
    return b"\0megatron-resil-standby/" + name.encode()


def send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    payload = json.dumps(message).encode()
    data = HEADER.pack(len(payload)) + payload
    if fds:
        rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))
        sent = sock.sendmsg([data], [rights])
        data = data[sent:]
    if data:
        sock.sendall(data)


def receive(sock: socket.socket) -> object:
    """One message, read until it is whole and no further (a blocking socket, with its timeout for each
    read): the next message may already be on its way (a worker's refusal, then the standby's word of that
    worker's end), and stays in the socket for the next call."""
    header = _read_exactly(sock, HEADER.size)
    return decode(_read_exactly(sock, _size(header)))


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(min(count - len(data), 1 << 16))
        if not chunk:
            raise ValueError("the connection closed")
        data += chunk
    return bytes(data)


def _size(data: bytes | bytearray) -> int:
    size = HEADER.unpack_from(data)[0]
    if size > MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes (at most {MAX_MESSAGE})")
    return size


def decode(payload: bytes | bytearray) -> object:
    """The JSON value of a message, once what it can make the parser build is known to be bounded."""
    containers = payload.count(b"[") + payload.count(b"{")
    if containers > MAX_CONTAINERS:
        raise ValueError(f"{containers} arrays or objects (at most {MAX_CONTAINERS})")
    if payload.count(b",") > MAX_ITEMS:
        raise ValueError(f"over {MAX_ITEMS} items")
    try:
        return json.loads(payload)
    except RecursionError:  # the parser's own guard, at the interpreter's recursion limit
        raise ValueError("nested deeper than the parser allows") from None


def short(value: object, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters: for a line that quotes a message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class Pending:
    """A connection whose request is still arriving, from the process `pid`: read as it comes, never
    waited for; whole, too big or past its deadline."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        conn.setblocking(False)
        self.conn, self.pid = conn, pid
        self.deadline = time.monotonic() + REQUEST_SECS
        self.data = bytearray()
        self.fds: list[int] = []

    def read(self) -> bool:
        """Take all that has arrived; True once the request is whole. Raises ValueError for a bad one."""
        while True:
            try:
                chunk, ancillary, flags, _addr = self.conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * 4))
            except BlockingIOError:
                return False
            for level, kind, raw in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    self.fds.extend(struct.unpack(f"{len(raw) // 4}i", raw[:len(raw) - len(raw) % 4]))
            if flags & socket.MSG_CTRUNC or len(self.fds) > 3:
                raise ValueError("it passed more descriptors than stdin, stdout and stderr")
            if not chunk:
                raise ValueError(f"the connection closed after {len(self.data)} bytes of a request")
            self.data += chunk
            if len(self.data) >= HEADER.size:
                size = _size(self.data)
                if len(self.data) > HEADER.size + size:
                    raise ValueError("it sent more than one request")
                if len(self.data) == HEADER.size + size:
                    return True

    def message(self) -> object:
        return decode(self.data[HEADER.size:])

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self.conn.close()


# ---- what a request is ---------------------------------------------------------------------------------

def _string(value: object) -> bool:
    return isinstance(value, str) and "\0" not in value


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(map(_string, value))


def _integer(value: object, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _environment(value: object) -> bool:
    return isinstance(value, dict) and all(_string(k) and k and "=" not in k and _string(v)
                                           for k, v in value.items())


_STREAM = {"encoding": str, "errors": str, "line_buffering": bool, "write_through": bool, "buffered": bool}
_REQUEST = {  # field: whether a value fits
    "argv": lambda v: _strings(v) and len(v) > 0,
    "env": _environment,
    "cwd": _string,
    "path": _strings,
    "umask": lambda v: _integer(v, 0, 0o777),
    "pid": lambda v: _integer(v, 1, 1 << 22),  # pid_max is at most 2^22
    "fds": lambda v: isinstance(v, list) and len(set(v)) == len(v) and all(_integer(fd, 0, 2) for fd in v),
    "streams": lambda v: isinstance(v, dict) and set(v) <= {"stdout", "stderr"} and all(
        isinstance(how, dict) and how.keys() == _STREAM.keys()
        and all(type(how[k]) is t for k, t in _STREAM.items()) for how in v.values()),
    "marks": lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and type(t) in (int, float) for k, t in v.items()),
    "fingerprint": lambda v: isinstance(v, dict) and _environment(v.get("env")) and all(  # fingerprint()
        _string(x) or isinstance(x, list) and all(_string(i) or type(i) in (int, bool) for i in x)
        for key, x in v.items() if key != "env"),
    # standby_settings.current()'s
    "affinity": lambda v: isinstance(v, list) and 0 < len(v) == len(set(v))
    and all(_integer(cpu, 0, (1 << 16) - 1) for cpu in v),
    "nice": lambda v: _integer(v, -20, 19),
    "rlimits": lambda v: isinstance(v, dict) and v.keys() == standby_settings.RLIMITS.keys() and all(
        isinstance(pair, list) and len(pair) == 2 and all(_integer(x, -1, (1 << 63) - 1) for x in pair)
        for pair in v.values()),
    "mempolicy": lambda v: v is None or isinstance(v, dict) and v.keys() == {"mode", "nodes"}
    and _integer(v["mode"], 0, 0xFFFF) and isinstance(v["nodes"], list)
    and all(_integer(node, 0, standby_settings.MAX_NUMA_NODES - 1) for node in v["nodes"]),
}


def invalid(message: object, fds: int) -> str | None:
    """Why `message`, which came with `fds` descriptors, is neither a request nor a ping; None when it is
    one of them."""
    if not isinstance(message, dict):
        return f"a JSON {type(message).__name__}, not an object"
    if message == {"ping": True}:
        return None if fds == 0 else "a ping with descriptors"
    if message.keys() != _REQUEST.keys():
        return f"missing or unknown fields: {short(sorted(message.keys() ^ _REQUEST.keys()))}"
    bad = [field for field, fits in _REQUEST.items() if not fits(message[field])]
    if bad:
        return f"fields of the wrong type: {', '.join(bad)}"
    if len(message["fds"]) != fds:
        return f"it names {len(message['fds'])} descriptors and passed {fds}"
    return None
