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

A signal after which the training loop does not move on is the launcher stopping a worker group one of
whose ranks is gone (killed, or stopped and killed by its rank monitor): this rank waits in a collective
(the step's, or the agreement on whether to save) for a peer that will never answer, and its launcher
waits out its stop timeout (30 s for torchrun and ft_launcher) before SIGKILL. When, since the signal, the
loop has passed no point of progress (a step's start or end, the end of a save or an evaluation) for
STUCK_STEP_FACTOR times the slowest step this process has taken (at least STUCK_STEP_MIN_SECS), it is
blocked: the watchdog ends the process with one line and exit code 6 (no save could be agreed; the
previous checkpoint is intact). A save or an evaluation that was running when the signal came is judged
by its own kind instead: blocked once it has run, since the signal, STUCK_STEP_FACTOR times the slowest
of its kind this process has finished (a preemption signal mid-save lets a save that is merely slow
finish; one waiting in its collectives for a stopped or killed peer held its launcher for the whole stop
timeout, issue 26's chaos run); the first of its kind, with nothing to compare with, is not judged. Once
the ranks have agreed to stop, the save that follows has only the grace deadline: from this rank's own
signal, or from the agreement on a rank the signal has not reached.
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


class Waited:
    """What `waiting` yields: a save that turned out not to be due sets `happened = False`, so that its
    instant return is not taken for how long a save takes."""

    happened = True


class ExitSignalHandler:
    """Installed at the start of pretrain(), so a signal during set-up or the load is honoured too."""

    def __init__(self, signal_name: str, grace_secs: float | None) -> None:
        self.signal_name = signal_name
        self.signum = signal.Signals[signal_name]
        self.grace_secs = grace_secs
        self.count = 0
        self.first_received_at: float | None = None
        self._first = threading.Event()
        self._progress_at: float | None = None  # the loop's last point of progress
        self._slowest_step: float | None = None  # of the steps this process has taken
        self._waiting = 0  # inside a save or an evaluation: judged by its own kind
        self._waiting_kind: str | None = None  # the outermost one's
        self._waiting_since: float | None = None
        self._slowest_wait: dict[str, float] = {}  # of the saves, evaluations this process has finished
        self._agreed = False  # the ranks agreed to stop: the watchdog no longer judges progress

    @property
    def received(self) -> bool:
        return self.count > 0

    def install(self) -> None:
        signal.signal(self.signum, self._on_signal)
        # Started now: a signal handler should start nothing.
        self._wakeup = self._wakeup_pipe()
        if self._wakeup is not None:
            threading.Thread(target=self._listen, daemon=True, name="exit-signal-listen").start()
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

    def _listen(self) -> None:
        """Notices the signal while the main thread is blocked where no Python code runs."""
        while self.signum not in os.read(self._wakeup, 64):
            pass
        self._noticed()

    def _watch(self) -> None:
        self._first.wait()  # this rank's own signal, or the ranks' agreement to stop on another's
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
                still, what, slowest = blocked
                self._exit(f"{self.signal_name} received, and the training loop has not moved on "
                           f"{still:.1f}s later (in a {what}; its slowest {what}: {slowest:.2f}s): it waits "
                           "in a collective for a rank that is gone, so no save can be agreed; the previous "
                           f"checkpoint is intact; exiting with code {exit_codes.SIGNAL_DEADLINE}",
                           exit_codes.SIGNAL_DEADLINE, requeue=True)
            time.sleep(_WATCH_EVERY_SECS)

    def _blocked_for(self, now: float) -> tuple[float, str, float] | None:
        """(seconds without progress since the signal, in what, its slowest), once past the stuck bound."""
        if self._agreed:
            return None
        if self._waiting:  # a save or an evaluation: by the slowest of its kind
            what, since = self._waiting_kind or "save", self._waiting_since
            slowest = self._slowest_wait.get(what)
        else:
            what, since, slowest = "step", self._progress_at, self._slowest_step
        if since is None or slowest is None:
            return None  # nothing of its kind finished yet to compare with
        still = now - max(since, self.first_received_at)
        bound = max(STUCK_STEP_MIN_SECS, STUCK_STEP_FACTOR * slowest)
        return (still, what, slowest) if still > bound else None

    @contextlib.contextmanager
    def stepping(self):
        """Wraps a training step: its start and end are progress, its duration the stuck bound's unit."""
        began = self._progress_at = time.monotonic()
        try:
            yield
        finally:
            self._progress_at = time.monotonic()
            took = self._progress_at - began
            self._slowest_step = took if self._slowest_step is None else max(self._slowest_step, took)

    @contextlib.contextmanager
    def waiting(self, kind: str = "save"):
        """Wraps a save ("save") or an evaluation ("evaluation"): judged by the slowest of its kind."""
        outermost = self._waiting == 0
        began = time.monotonic()
        if outermost:
            self._waiting_kind, self._waiting_since = kind, began
        self._waiting += 1
        wait = Waited()
        try:
            yield wait
        finally:
            self._waiting -= 1
            self._progress_at = time.monotonic()
            if outermost and wait.happened:
                took = self._progress_at - began
                self._slowest_wait[kind] = max(self._slowest_wait.get(kind, 0.0), took)

    def agreed(self) -> None:
        """The ranks agreed to stop on the signal: what follows is the save, under the grace deadline. A
        rank that learns of the signal only from its peers (it reached this rank later, or never: one rank
        killed by hand, signals that reach a job's nodes at different times) starts its deadline now; it
        would otherwise save with none, and exit 5 after its peers exited 6."""
        self._agreed = True
        self._noticed()

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


def caught() -> signal.Signals | None:
    """The exit signal this process caught (--exit-signal-handler), if it did."""
    return _installed.signum if _installed is not None and _installed.received else None


def die_of(signum: signal.Signals) -> None:
    """End this process as `signum` would have without the handler (its default action)."""
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default is not to end the process


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
    """Wraps a training step: with --exit-signal-handler, a loop blocked after a signal ends the process."""
    return _installed.stepping() if _installed is not None else contextlib.nullcontext()


def waiting(kind: str = "save"):
    """Wraps a save or an evaluation (`kind`): judged by the slowest of its kind while it runs."""
    return _installed.waiting(kind) if _installed is not None else contextlib.nullcontext(Waited())
