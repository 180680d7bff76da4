"""The grace deadline of --exit-signal-grace-secs on a rank that learns of the signal only from its peers:
the signal reached another rank first, or only another rank (signals reach a job's nodes at different
times; a user kills one rank). Its deadline starts when the ranks agree to stop; without that it saved with
no deadline at all, and exited 5 after its signalled peers had exited 6."""

from __future__ import annotations

import subprocess
import sys

from tests import launch

_AGREED_WITHOUT_A_SIGNAL = """
import threading
from megatron_resil.resilience.signal_handler import ExitSignalHandler

handler = ExitSignalHandler("SIGTERM", 0.05)
handler.install()
assert not handler.received
handler.agreed()  # another rank was signalled; this one's save now never ends
threading.Event().wait()
"""


def test_a_rank_told_of_the_signal_only_by_its_peers_exits_6_at_the_deadline():
    done = subprocess.run([sys.executable, "-c", _AGREED_WITHOUT_A_SIGNAL], env=launch.env(), cwd=launch.REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 6, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == (
        "[resil] exit: SIGTERM grace period of 0.05s elapsed before the save finished; the previous "
        "checkpoint is intact; exiting with code 6")
