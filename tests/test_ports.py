"""megatron_resil.launch.ports: rendezvous ports are drawn where no outgoing connection takes them first."""
from __future__ import annotations

import socket
import subprocess
import sys

from megatron_resil.launch import ports

try:
    from tests import launch  # tests/ is a package
except ImportError:  # pragma: no cover - tests/ on sys.path instead
    import launch


def test_the_port_lies_below_the_ephemeral_range_and_binds():
    top = ports._first_ephemeral_port()
    for _ in range(20):
        port = ports.free_loopback_port()
        assert ports.LOWEST <= port < top
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_passed_over(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        draws = iter([taken, taken, 0])
        real = ports.random.randrange
        monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(draws) or real(a, b))
        port = ports.free_loopback_port()
        assert port != taken and ports.LOWEST <= port


def test_run_local_sh_gets_its_port_from_the_module():
    printed = subprocess.run([sys.executable, "-m", "megatron_resil.launch.ports"], env=launch.env(),
                             cwd=launch.REPO, capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert ports.LOWEST <= int(printed.stdout) < ports._first_ephemeral_port()
    assert "-m megatron_resil.launch.ports" in (launch.REPO / "scripts" / "run_local.sh").read_text()
