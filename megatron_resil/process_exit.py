"""Ending a process whose exit code is decided, without the interpreter's teardown.

A process that imported torch (and megatron-core) spends about half a second after its atexit handlers
tearing down modules and objects, deciding nothing: every file we write is closed by then. pretrain.py's
ranks, the launcher (megatron_resil.launch.ft_launcher) and the standby all end this way. A launcher's end is
in every job step's end, and the next job step waits for it (measured: 0.5 s of a preemption's 1.6 s from the
signal to the launcher's exit).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable

THREADS_AT_EXIT_SECS = 30.0


def _exit_anyway_after(limit_secs: float, code: int) -> threading.Timer:
    """A decided exit never turns into a hang: if the threads are not finished after `limit_secs`, the ones
    left are named in one line and the process exits with its code without them."""
    def expire() -> None:
        # This runs in the timer's thread: the main thread, waiting in a join, is not one of them.
        running = [t.name for t in threading.enumerate() if not t.daemon
                   and t not in (threading.current_thread(), threading.main_thread())]
        print(f"[resil] exit: {len(running)} thread(s) still running after {limit_secs:g} s "
              f"({', '.join(running[:4])}); exiting with code {code} without them",
              file=sys.stderr, flush=True)
        os._exit(code)

    timer = threading.Timer(limit_secs, expire)
    timer.daemon = True
    timer.start()
    return timer


def exit_without_teardown(code: int | None) -> None:
    """Exit as Python would, minus the interpreter's teardown. Non-daemon threads are joined and atexit
    handlers run first, as at a normal exit. The code is decided: a launcher's SIGTERM, sent because a
    peer rank exited a moment earlier, would only replace it with "killed by SIGTERM" on the launcher's
    report."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = int(code or 0)
    deadline = _exit_anyway_after(THREADS_AT_EXIT_SECS, code)
    # What the interpreter does first at exit: the threading module's exit hooks (they stop the idle
    # workers of concurrent.futures executors nobody shut down, such as torch.compile's, used by
    # --muon-scalar-optimizer lion: joining those alone waits forever), then the joins.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    deadline.cancel()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(main: Callable[[], int | None]) -> None:
    """An entry point's end: run `main`, then exit with its code without the teardown. A SystemExit is a
    decided exit (2, 3, NVRx's launcher's own code): no teardown either, where gloo could abort. Any other
    exception is a bug, or a collective failed by a peer's death: Python's report and code (1), without
    the teardown, which a restart otherwise waits for (its detection phase)."""
    try:
        code = main()
    except SystemExit as stop:
        code = _code_of(stop)
    except Exception:  # noqa: BLE001 - reported as Python reports it
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_without_teardown(code)


def _code_of(stop: SystemExit) -> int:
    """The exit code `stop` (sys.exit's) stands for; a message is printed, as Python prints it."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)  # what Python prints for sys.exit("message")
    return 1
