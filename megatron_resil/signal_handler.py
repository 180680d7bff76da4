"""Preemption: save and exit on a signal (--exit-signal-handler), never leaving a partial checkpoint.

The handler only records the signal; the loop asks every rank once per iteration (and once before the
first, for a signal during set-up or the load) and, if any rank was signalled, all ranks save together
and exit. A second signal changes nothing. With a grace
deadline, a watchdog (started at install, waiting for the first signal) ends the process if the save
cannot finish in time: publishing is atomic, so
the previous checkpoint and the tracker are then still intact.

A signal during the checkpoint load ends the process at once: nothing trained can be saved yet, and a
load can block where no Python code runs (a stalled file system, a peer stuck in a collective), so the
watchdog learns of the signal through a wakeup pipe written by the C-level handler, not from the main
thread.

A signal during a training step that then does not end is the launcher stopping a worker group one of
whose ranks is gone (killed, or stopped and killed by its rank monitor): this rank waits in a collective
for a peer that will never answer, its loop never asks whether to save, and its launcher waits out its
stop timeout (30 s for torchrun and ft_launcher) before SIGKILL. A step that outlasts the signal by
STUCK_STEP_FACTOR times the slowest step this process has taken (at least STUCK_STEP_MIN_SECS) is
blocked: the watchdog ends the process with one line and exit code 6 (no save could be agreed; the
previous checkpoint is intact). Saves and evaluation are not steps: a preemption signal mid-save lets it
finish.
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

# Without --exit-signal-grace-secs, how long a load that began after the signal may still take.
LOAD_AFTER_SIGNAL_SECS = 60.0
# A step still running this long after the signal waits for a peer that is gone (see the module's doc).
STUCK_STEP_FACTOR = 5.0
STUCK_STEP_MIN_SECS = 3.0
_WATCH_EVERY_SECS = 0.1


class ExitSignalHandler:
    """Installed at the start of pretrain(), so a signal during set-up or the load is honoured too."""

    def __init__(self, signal_name: str, grace_secs: float | None) -> None:
        self.signal_name = signal_name
        self.signum = signal.Signals[signal_name]
        self.grace_secs = grace_secs
        self.count = 0
        self.first_received_at: float | None = None
        self._first = threading.Event()
        self._step_began: float | None = None  # the step running now, if one is
        self._slowest_step: float | None = None  # of the steps this process has taken

    @property
    def received(self) -> bool:
        return self.count > 0

    def install(self) -> None:
        signal.signal(self.signum, self._on_signal)
        # Started now: a signal handler should start nothing.
        self._wakeup = self._wakeup_pipe()
        threading.Thread(target=self._watch, daemon=True, name="exit-signal-watch").start()

    @staticmethod
    def _wakeup_pipe() -> int | None:
        """The read end of a pipe the interpreter's C-level handler writes each signal's number to, or
        None where something else (an event loop) already owns the wakeup fd."""
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        try:
            previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: the main thread's own handler is all there is
            previous = None
        if previous != -1:
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(read_end)
            os.close(write_end)
            return None
        return read_end

    def _on_signal(self, signum, frame) -> None:
        self.count += 1
        self._noticed()

    def _noticed(self) -> None:
        if not self._first.is_set():
            self.first_received_at = time.monotonic()
            self._first.set()

    def _watch(self) -> None:
        if self._wakeup is not None:
            while self.signum not in os.read(self._wakeup, 64):
                pass
            self._noticed()
        self._first.wait()
        if self._loading:
            self._exit_during_load()
        deadline = None if self.grace_secs is None else self.first_received_at + self.grace_secs
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                # Still alive: the save did not finish in time. Exit now; nothing partial is ever published.
                self._exit(f"{self.signal_name} grace period of {self.grace_secs:g}s elapsed before the save "
                           "finished; the previous checkpoint is intact; "
                           f"exiting with code {exit_codes.SIGNAL_DEADLINE}",
                           exit_codes.SIGNAL_DEADLINE)
            if (blocked := self._blocked_for(now)) is not None:
                self._exit(f"{self.signal_name} received during a training step that has not ended "
                           f"{blocked:.1f}s later (its slowest step: {self._slowest_step:.2f}s): it waits in "
                           "a collective for a rank that is gone, so no save can be agreed; the previous "
                           f"checkpoint is intact; exiting with code {exit_codes.SIGNAL_DEADLINE}",
                           exit_codes.SIGNAL_DEADLINE, requeue=True)
            time.sleep(_WATCH_EVERY_SECS)

    def _blocked_for(self, now: float) -> float | None:
        """Seconds the current step has run since the signal, once that is past the stuck-step bound."""
        began, slowest = self._step_began, self._slowest_step
        if began is None or slowest is None:  # not in a step, or none taken yet to compare with
            return None
        running = now - max(began, self.first_received_at)
        return running if running > max(STUCK_STEP_MIN_SECS, STUCK_STEP_FACTOR * slowest) else None

    @contextlib.contextmanager
    def stepping(self):
        """Wraps a training step: its duration, and whether one is running, for the stuck-step bound."""
        began = self._step_began = time.monotonic()
        try:
            yield
        finally:
            self._step_began = None
            took = time.monotonic() - began
            self._slowest_step = took if self._slowest_step is None else max(self._slowest_step, took)

    _loading = False

    @contextlib.contextmanager
    def loading(self):
        """While the checkpoint is loaded, a signal ends the process at once (see the module's doc). One
        that came during set-up lets the load run, then stops before training, as ever, but bounds it."""
        self._loading = True
        bound = None
        if self._first.is_set():
            bound = threading.Timer(self.grace_secs or LOAD_AFTER_SIGNAL_SECS, self._exit_if_loading)
            bound.daemon = True
            bound.start()
        try:
            yield
        finally:
            self._loading = False
            if bound is not None:
                bound.cancel()

    def _exit_if_loading(self) -> None:
        if self._loading:
            self._exit_during_load()

    def _exit_during_load(self) -> None:
        self._exit(f"{self.signal_name} received while loading the checkpoint; nothing trained since, so "
                   f"nothing to save; the checkpoints on disk are as they were; exiting with code "
                   f"{exit_codes.SIGNAL_SAVED}", exit_codes.SIGNAL_SAVED, requeue=True)

    @staticmethod
    def _exit(message: str, code: int, **fields) -> None:
        try:
            sys.stderr.write(f"[resil] exit: {message}\n")
            sys.stderr.flush()
            events.record("exit", message=message, exit_code=code, **fields)
            # megatron-core's writer forks a process per file; orphaned mid-write they block forever.
            for child in multiprocessing.active_children():
                with contextlib.suppress(OSError):
                    os.kill(child.pid, signal.SIGKILL)
        finally:  # whatever failed above, the process ends here
            os._exit(code)


_installed: ExitSignalHandler | None = None


def install_from_args(args) -> ExitSignalHandler | None:
    """--exit-signal-handler: install once per process (an in-process restart keeps the first)."""
    global _installed
    if args.exit_signal_handler and _installed is None:
        _installed = ExitSignalHandler(args.exit_signal, args.exit_signal_grace_secs)
        _installed.install()
    return _installed


def loading():
    """Wraps the checkpoint load: with --exit-signal-handler, a signal then ends the process at once."""
    return _installed.loading() if _installed is not None else contextlib.nullcontext()


def stepping():
    """Wraps a training step: with --exit-signal-handler, a step blocked after a signal ends the process."""
    return _installed.stepping() if _installed is not None else contextlib.nullcontext()
