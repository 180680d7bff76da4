"""An abort for gloo: the TCP connections of this process's groups, ended on demand.

NVRx's abort calls `abort()` on each group's NCCL communicator, which ends a collective waiting for a peer
that is stopped or dead. Gloo has no abort: its `abort()` and `shutdown()` return and leave the collective
waiting (tools/abort_drill.py, `--peer stopped`). A rank blocked with a hung peer (a SIGSTOP, a deadlock)
then stays blocked until the peer is killed or `--distributed-timeout-minutes` passes, and NVRx's hard
timeout may end the blocked rank too, with its state.

So the connections the groups open are noted while `parallel.initialize` creates them (`tracking`), and
`end()` shuts them down (`shutdown(SHUT_RDWR)` on the socket: the blocked read returns, and gloo raises
"Connection closed by peer" in the collective, as when a peer dies). Only established connections are
noted: gloo's listening socket is not (its accept thread would end the process), nor the store's client
(NVRx's restart goes on through the store). A group made later goes through `new_group`, which notes its
connections the same way (the local tier's replication groups).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

from megatron_resil.rank_process import AGENT_STORE_ENV

_ESTABLISHED = "01"  # the `st` column of /proc/net/tcp (include/net/tcp_states.h: TCP_ESTABLISHED)

_noted: set[int] = set()  # socket inodes of the groups' connections


def _established(excluding_ports: frozenset[int]) -> set[int]:
    """Inodes of this network namespace's established TCP connections, but those with either end at one of
    `excluding_ports`."""
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as rows:
                lines = rows.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()  # sl local_address rem_address st ... uid timeout inode
            if len(fields) < 10 or fields[3] != _ESTABLISHED:
                continue
            ports = {int(address.rpartition(":")[2], 16) for address in fields[1:3]}
            if not ports & excluding_ports:
                found.add(int(fields[9]))
    return found


def _sockets() -> dict[int, int]:
    """This process's open sockets: inode -> file descriptor."""
    found = {}
    for entry in os.scandir("/proc/self/fd"):
        try:
            target = os.readlink(entry.path)
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            found[int(target[8:-1])] = int(entry.name)
    return found


def _store_ports() -> frozenset[int]:
    """The ports of the launcher's stores: MASTER_PORT, and our ft_launcher's agent store."""
    ports = set()
    for value in (os.environ.get("MASTER_PORT", ""), os.environ.get(AGENT_STORE_ENV, "").rpartition(":")[2]):
        if value.isdigit():
            ports.add(int(value))
    return frozenset(ports)


@contextlib.contextmanager
def tracking() -> Iterator[None]:
    """Note the connections opened inside this block, but those to the launcher's store (torch.distributed's
    client of it is made here on the first attempt; any other store's client exists before)."""
    if not os.path.isdir("/proc/self/fd"):  # not Linux: nothing noted, `end` ends nothing
        yield
        return
    before = set(_sockets())
    try:
        yield
    finally:
        _noted.update((set(_sockets()) - before) & _established(_store_ports()))


def new_group(ranks: list[int]):
    """torch.distributed's new_group (collective: every rank calls it), its connections noted as
    initialize's are: a collective in it blocked with a hung peer ends at an in-process restart too,
    instead of holding its rank until --distributed-timeout-minutes."""
    import torch.distributed as dist
    with tracking():
        return dist.new_group(ranks)


def end() -> int:
    """Shut down every noted connection still open; returns how many were. A collective blocked in one
    raises, on this rank and on its peers."""
    ended = 0
    for inode, fd in _sockets().items():
        if inode not in _noted:
            continue
        try:
            duplicate = os.dup(fd)
            if os.fstat(duplicate).st_ino != inode:  # the descriptor was closed and reused meanwhile
                os.close(duplicate)
                continue
            connection = socket.socket(fileno=duplicate)  # owns the duplicate from here
        except OSError:
            continue
        try:
            connection.shutdown(socket.SHUT_RDWR)
            ended += 1
        except OSError:  # already shut down, by the peer
            pass
        finally:
            connection.close()  # the duplicate only: the group's own descriptor stays open
    _noted.clear()
    return ended


def forget() -> None:
    """The groups are gone (released): nothing noted is theirs any more."""
    _noted.clear()
