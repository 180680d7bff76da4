"""Who this process is: its rank, the process its launcher started for it, that launcher, and when each
began; and the one reader of /proc/PID/stat, which every part of the project (tests, benchmarks and tools
included) reads processes through.

A rank forked from a standby (launch/standby.py) is not the process its launcher started: that one, the
standby's client, stays, and is the rank to everyone outside. So what the launcher watch, the restart
phases and the time budget ask about is the client (`launched_pid`, `launcher_pid`), which the standby's
worker records here before it runs pretrain.py.

Imports nothing heavy: the launch scripts' tools, the standby and pretrain.py's first lines use it before
torch is imported.
"""

from __future__ import annotations

import os
import sys
import time
from typing import NamedTuple

# Set by our ft_launcher (launch/ft_launcher.py) for its workers under in-process restart: host:port of its
# rendezvous store, where the workers keep their stores rather than on rank 0
# (resilience/inprocess_restart.py).
AGENT_STORE_ENV = "MEGATRON_RESIL_AGENT_STORE"

# In a worker forked from a standby: the pid of the process the launcher started (its client).
_client: int | None = None


def rank() -> int:
    """This process's global rank; before (or between) process groups, the launcher's RANK, so rank-0-only
    output stays on rank 0 then too."""
    dist = sys.modules.get("torch.distributed")  # not imported: no process group can exist yet
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    raw = os.environ.get("RANK", "0")
    return int(raw) if raw.isdigit() else -1  # NVRx's "None": a warm reserve of in-process restart, no rank


def is_rank0() -> bool:
    return rank() == 0


# ---- the process the launcher started, and its launcher -------------------------------------------------

def became_worker_of(client: int) -> None:
    """In a standby's worker, before it runs pretrain.py: `client` is the process the launcher started."""
    global _client
    _client = client


def in_standby_worker() -> bool:
    return _client is not None


def launched_pid() -> int:
    """The process the launcher started for this rank: this one, or a standby worker's client."""
    return _client if _client is not None else os.getpid()


def launcher_pid() -> int:
    """The parent of the process the launcher started (0 once that process is gone)."""
    if _client is None:
        return os.getppid()
    found = proc_stat(_client)
    return 0 if found is None or found.state in ("Z", "X") else found.parent


# ---- /proc/PID/stat ---------------------------------------------------------------------------------------

class ProcessStat(NamedTuple):
    """The fields of /proc/PID/stat this project reads (proc(5) numbers them from 1)."""

    state: str  # 3: R running, S sleeping, D disk, T stopped, Z zombie, X dead, ...
    parent: int  # 4
    group: int  # 5: its process group
    children_cpu_ticks: int  # 16 + 17: user and system time of its reaped children, in clock ticks
    nice: int  # 19
    start_ticks: int  # 22: when it started, in clock ticks after boot


def proc_stat(pid: int | str = "self") -> ProcessStat | None:
    """Process `pid`'s /proc/PID/stat, None once it is gone. The command name (field 2) is whatever the
    process calls itself, spaces and parentheses included: the fields are read after its last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return ProcessStat(state=fields[0].decode(), parent=int(fields[1]), group=int(fields[2]),
                           children_cpu_ticks=int(fields[13]) + int(fields[14]), nice=int(fields[16]),
                           start_ticks=int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    """Running, stopped or sleeping: not gone and not a zombie."""
    found = proc_stat(pid)
    return found is not None and found.state not in ("Z", "X")


def processes() -> dict[int, ProcessStat]:
    """Every process this one can see, by pid."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := proc_stat(entry)) is not None:
            found[int(entry)] = stat
    return found


def children_of(parent: int) -> set[int]:
    return {pid for pid, stat in processes().items() if stat.parent == parent}


def descendants_of(root: int) -> set[int]:
    """Its children, their children, and so on."""
    table = processes()
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, stat in table.items() if stat.parent in frontier} - found
        found |= frontier
    return found


def started_unix(pid: int | str = "self") -> float | None:
    """When process `pid` was created, as a Unix time (10 ms resolution); None if /proc cannot say."""
    found = proc_stat(pid)
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if found is None:
        return None
    return time.time() - uptime + found.start_ticks / os.sysconf("SC_CLK_TCK")
