"""What runs in the writer's queue server (a spawned multiprocessing Manager, see dcp_writer.py) before it
serves: this module imports nothing heavy, because the spawned interpreter imports it, and every import
here is seconds of start-up on every rank."""

from __future__ import annotations

import os
import signal
import threading
import time


def ignore_termination_signals() -> None:
    """Survive the job-wide SIGTERM, but not the trainer itself. Deaf to SIGTERM it would outlive a
    trainer killed with SIGKILL (and hold its stdout open), so it exits as soon as it is orphaned."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def exit_when_orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=exit_when_orphaned, name="exit-when-orphaned", daemon=True).start()
