"""Workers die with their launcher.

torchrun and ft_launcher start each rank in a session of its own, so a launcher killed with SIGKILL (an
OOM kill, a node agent's cleanup, `kill -9`) leaves its ranks running as orphans: they keep training and
keep writing the checkpoint directory, next to the restarted job. Under a launcher (torchrun and
ft_launcher both set TORCHELASTIC_RUN_ID) a thread watches this rank's parent; once it is gone the rank
writes its exit record and ends at once with exit code 9, never finishing a save (a staged one is
never published; the next run removes it). A parent-death signal would be quicker, but the kernel
ties it to the thread that started the child, not to the launcher's life.

ft_launcher also forks one rank monitor per rank (NVRx's), which nothing ends when the launcher is killed;
being forks of the launcher, they share its command line. The watch notes those siblings while the
launcher lives and ends them with the rank.

Without a launcher (plain `python pretrain.py`) the parent is a shell and nothing is watched. That the
processes a rank forks die with it is a process-wide hook, installed with the patches (patches/stdlib.py).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from megatron_resil import events, exit_codes, rank_process

POLL_SECS = 0.5


_launcher: int | None = None
_forks: set[int] = set()
_stopping = threading.Lock()


def watch() -> None:
    global _launcher
    if "TORCHELASTIC_RUN_ID" not in os.environ or _launcher is not None:
        return
    _launcher = rank_process.launcher_pid()  # a standby worker's is its client's
    threading.Thread(target=_watch, name="launcher-watch", daemon=True).start()


def launcher_alive() -> bool:
    """False once the launcher this rank watches is gone, though the watch thread may not have noticed
    yet: the checkpointer asks before it publishes a save (GlobalTier's `may_publish`)."""
    return _launcher is None or rank_process.launcher_pid() == _launcher


def stop_if_orphaned() -> None:
    """For the main thread's error path: a rank whose peer noticed first fails in a collective before
    its own watch does, and a save finished after the launcher died is withheld (PublishWithheld); the
    launcher's death is the cause to report, not that error."""
    if not launcher_alive():
        _stop()


def _watch() -> None:
    global _forks
    polls = 0
    while rank_process.launcher_pid() == _launcher:
        if polls % 20 == 0:  # every 10 s: rank monitors are restarted with the workers
            _forks = _forks_of(_launcher) or _forks
        polls += 1
        time.sleep(POLL_SECS)
    _stop()


def _stop() -> None:
    _stopping.acquire()  # once per process; a second caller waits here for the exit
    message = (f"the launcher (pid {_launcher}) is gone; this rank stops without saving, so nothing "
               f"half-done is published and a restarted job has the directory to itself; exiting with code "
               f"{exit_codes.LAUNCHER_GONE}")
    events.record("exit", message=message, exit_code=exit_codes.LAUNCHER_GONE)  # first: the line may fail
    try:  # our stdout may be a pipe the dead launcher was reading
        events.print_rank_0(f"[resil] exit: {message}")
    except OSError:
        pass
    for pid in _forks | rank_process.children_of(os.getpid()):  # the launcher's rank monitors, our writers
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    os._exit(exit_codes.LAUNCHER_GONE)


def _forks_of(launcher: int) -> set[int]:
    """The launcher's other children that are forks of it (same command line): ft_launcher's rank
    monitors. Never the ranks (their command line is pretrain.py's)."""
    try:
        command = Path(f"/proc/{launcher}/cmdline").read_bytes()
    except OSError:
        return set()
    found = set()
    for pid in rank_process.children_of(launcher) - {rank_process.launched_pid()}:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes() == command:
                found.add(pid)
        except OSError:
            continue
    return found

