"""megatron_resil/process_exit.py: a process whose exit code is decided (a rank, the launcher, the standby)
ends as Python would, its non-daemon threads joined and its atexit handlers run, minus the interpreter's
teardown of what it imported; and a thread that never ends cannot turn the exit into a hang."""

from __future__ import annotations

import subprocess
import sys

from tests import launch

_PROGRAM = """
import atexit, sys, threading
from megatron_resil import process_exit

class Torn:
    def __del__(self):
        print("torn down", flush=True)

kept = Torn()  # a module global: only the interpreter's teardown would finalize it
release = threading.Event()
threading.Thread(target=lambda: (release.wait(), print("thread joined", flush=True))).start()
atexit.register(lambda: print("atexit ran", flush=True))
release.set()
process_exit.exit_without_teardown(int(sys.argv[1]))
"""


def _run(code: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PROGRAM, str(code)], env=launch.env(), cwd=launch.REPO,
                          capture_output=True, text=True, timeout=120)


def test_the_code_stands_threads_are_joined_atexit_runs_and_nothing_is_torn_down():
    done = _run(7)
    assert done.returncode == 7, done.stderr
    assert done.stdout.splitlines() == ["thread joined", "atexit ran"], done.stdout


def test_the_same_program_exiting_as_python_does_is_torn_down():
    """The check above can fail: with sys.exit instead, the global is finalized at teardown."""
    done = subprocess.run([sys.executable, "-c", _PROGRAM.replace("process_exit.exit_without_teardown",
                                                                  "sys.exit"), "0"],
                          env=launch.env(), cwd=launch.REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "torn down" in done.stdout.splitlines(), done.stdout


def test_a_thread_that_never_ends_is_named_and_the_code_still_stands():
    """Before stop 49 the line also named the main thread, waiting in the join, as still running."""
    program = _PROGRAM.replace("release.set()", "")
    limit = "from megatron_resil import process_exit\nprocess_exit.THREADS_AT_EXIT_SECS = 0.5"
    program = program.replace("from megatron_resil import process_exit", limit)
    done = subprocess.run([sys.executable, "-c", program, "4"], env=launch.env(), cwd=launch.REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 4, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "[resil] exit: 1 thread(s) still running after 0.5 s (Thread-1 (<lambda>)); exiting with code 4 "
        "without them"), done.stderr
    assert "atexit ran" not in done.stdout  # it runs after the joins, which never ended
