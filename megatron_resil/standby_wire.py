"""How a rank and its standby talk (standby.py): what a message is, and what a request must be.

A message is JSON behind a 4-byte length, over a Unix stream socket, with descriptors (SCM_RIGHTS) beside
a request. Every message is bounded in size and nesting before it is parsed, and a request is checked
field by field against a schema before anything reads it (issue 35: `[]` and `"[" * 100000` ended the
standby, and every rank it ran, with an AttributeError and a RecursionError). The standby reads requests
as they come, never waiting on one (`Pending`): a connection that sends slowly, or never, is dropped at
its deadline while the standby goes on tending its ranks.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import time

from megatron_resil import standby_settings

HEADER = struct.Struct("!I")
# A request is a few KiB to a few hundred (the environment and command line: Linux's ARG_MAX is 2 MiB with
# an 8 MiB stack), arrives at once, and is three levels deep (fingerprint -> env -> value).
MAX_MESSAGE = 8 << 20
MAX_DEPTH = 6
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
    """One message, read until it is whole (a blocking socket, with its timeout for each read)."""
    data = b""
    while len(data) < HEADER.size or len(data) < HEADER.size + _size(data):
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ValueError("the connection closed")
        data += chunk
    return decode(data[HEADER.size:])


def _size(data: bytes | bytearray) -> int:
    size = HEADER.unpack_from(data)[0]
    if size > MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes (at most {MAX_MESSAGE})")
    return size


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


def decode(payload: bytes | bytearray) -> object:
    """The JSON value of a message, its nesting bounded before the parser sees it."""
    depth = 0
    for bracket in _JSON_BRACKET.finditer(_JSON_STRING.sub(b"", payload)):
        depth += 1 if bracket.group() in b"[{" else -1
        if depth > MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} deep")
    return json.loads(payload)


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
    "fingerprint": lambda v: isinstance(v, dict) and _environment(v.get("env", {})),
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
