"""Preemption: save and exit on a signal (--exit-signal-handler), never leaving a partial checkpoint.

The handler only records the signal; the loop asks every rank once per iteration (and once before the
first, for a signal during set-up or the load) and, if any rank was signalled, all ranks save together
and exit. A second signal changes nothing. With a grace
deadline, a watchdog (started at install, waiting for the first signal) ends the process if the save
cannot finish in time: publishing is atomic, so
the previous checkpoint and the tracker are then still intact.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time

from megatron_resil import events, exit_codes


class ExitSignalHandler:
    """Installed at the start of pretrain(), so a signal during set-up or the load is honoured too."""

    def __init__(self, signal_name: str, grace_secs: float | None) -> None:
        self.signal_name = signal_name
        self.signum = signal.Signals[signal_name]
        self.grace_secs = grace_secs
        self.count = 0
        self.first_received_at: float | None = None
        self._first = threading.Event()

    @property
    def received(self) -> bool:
        return self.count > 0

    def install(self) -> None:
        signal.signal(self.signum, self._on_signal)
        if self.grace_secs is not None:  # started now: a signal handler should start nothing
            threading.Thread(target=self._deadline, daemon=True, name="exit-signal-deadline").start()

    def _on_signal(self, signum, frame) -> None:
        self.count += 1
        if self.count == 1:
            self.first_received_at = time.monotonic()
            self._first.set()

    def _deadline(self) -> None:
        self._first.wait()
        time.sleep(max(0.0, self.first_received_at + self.grace_secs - time.monotonic()))
        # Still alive: the save did not finish in time. Exit now; nothing partial is ever published.
        try:
            message = (f"{self.signal_name} grace period of {self.grace_secs:g}s elapsed before the save "
                       f"finished; the previous checkpoint is intact; "
                       f"exiting with code {exit_codes.SIGNAL_DEADLINE}")
            sys.stderr.write(f"[resil] exit: {message}\n")
            sys.stderr.flush()
            events.record("exit", message=message, exit_code=exit_codes.SIGNAL_DEADLINE)
            # megatron-core's writer forks a process per file; orphaned mid-write they block forever.
            for child in multiprocessing.active_children():
                with contextlib.suppress(OSError):
                    os.kill(child.pid, signal.SIGKILL)
        finally:  # whatever failed above, the deadline holds
            os._exit(exit_codes.SIGNAL_DEADLINE)


_installed: ExitSignalHandler | None = None


def install_from_args(args) -> ExitSignalHandler | None:
    """--exit-signal-handler: install once per process (an in-process restart keeps the first)."""
    global _installed
    if args.exit_signal_handler and _installed is None:
        _installed = ExitSignalHandler(args.exit_signal, args.exit_signal_grace_secs)
        _installed.install()
    return _installed
