"""A free TCP port on loopback for a rendezvous store, a MASTER_PORT, or a local daemon.

Why not bind to port 0: the kernel then hands out a port from the ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range), the same range every outgoing connection's local port is
drawn from. The port is free when we ask, but the launcher binds it seconds later, and in between any
process's outgoing connection (a gloo pair, a TCPStore client) may take it as its local port. The
launcher's store then fails to bind, torch's c10d backend falls back to being a client of whatever holds
the port, and the job waits out its join timeout. A port below the ephemeral range is only ever taken by
an explicit bind, so the same pick is safe unless another picker draws the same number. The draw is
random over the range, and the pick is checked by binding it.

`python -m megatron_resil.launch.ports` prints one port (scripts/run_local.sh).
"""
from __future__ import annotations

import random
import socket

LOWEST = 20000                 # pretrain.sbatch derives its ports from 20000 up, too
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _first_ephemeral_port() -> int:
    try:
        with open(EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768           # Linux's default


def free_loopback_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A port on `host` that binds now and lies below the ephemeral range (see the module's docstring)."""
    top = _first_ephemeral_port()
    low = LOWEST if top - LOWEST >= 1000 else 1024
    for _ in range(tries):
        port = random.randrange(low, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    raise OSError(f"no free port on {host} below the ephemeral range ({low}-{top - 1}) after {tries} tries")


if __name__ == "__main__":
    print(free_loopback_port())
