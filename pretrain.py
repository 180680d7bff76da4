"""Pretrain a megatron-core GPT with crash-safe checkpoints. Launch with torchrun (see README)."""

import atexit
import os
import signal
import sys
import threading

from megatron_resil import phase_marks
from megatron_resil.launch import standby

phase_marks.interpreter_started()  # first: when the interpreter reached our code
standby.set_import_time_defaults(sys.argv[1:], os.environ)  # before torch: its C++ log level, for one
if __name__ == "__main__":  # not in a spawned helper that imports this module
    standby.hand_over()  # with MEGATRON_RESIL_STANDBY: this process only mirrors a worker forked from it

from megatron_resil.arguments import parse_args  # noqa: E402 - after the log level above
from megatron_resil.checkpointing import take_from_checkpoint  # noqa: E402


def main() -> int:
    args = parse_args(saved_args=take_from_checkpoint)  # --use-checkpoint-args between parsing and checks
    if args.check_args_only:
        print("pretrain.py: arguments are valid")
        return 0
    from megatron_resil import patches

    patches.install(args)  # before megatron-core is imported; a mismatch exits 2 with one line
    from megatron_resil.training import pretrain  # heavy imports only after the arguments are good

    if args.inprocess_restart:  # NVRx's inprocess is imported only then
        from megatron_resil.resilience import inprocess_restart

        return inprocess_restart.run(pretrain, args)
    return pretrain(args)


THREADS_AT_EXIT_SECS = 30.0


def _exit_anyway_after(limit_secs: float, code: int) -> threading.Timer:
    """A decided exit never turns into a hang: if the threads are not finished after `limit_secs`, the ones
    left are named in one line and the process exits with its code without them."""
    def expire() -> None:
        running = [t.name for t in threading.enumerate()
                   if t is not threading.current_thread() and not t.daemon]
        print(f"[resil] exit: {len(running)} thread(s) still running after {limit_secs:.0f} s "
              f"({', '.join(running[:4])}); exiting with code {code} without them",
              file=sys.stderr, flush=True)
        os._exit(code)

    timer = threading.Timer(limit_secs, expire)
    timer.daemon = True
    timer.start()
    return timer


def exit_without_teardown(code: int) -> None:
    """Exit as Python would, minus the interpreter's teardown of torch and megatron-core: about a second
    per rank that decides nothing (every file we write is closed by then, the event log and exit record
    included). Non-daemon threads are joined and atexit handlers run first, as at a normal exit. The code
    is decided: a launcher's SIGTERM, sent because a peer rank exited a moment earlier, would only replace
    it with "killed by SIGTERM" on the launcher's report."""
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


def _code_of(stop: SystemExit) -> int:
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)  # what Python prints for sys.exit("message")
    return 1


if __name__ == "__main__":  # a spawned helper (async save's Manager) re-imports this module: keep it light
    try:
        code = main()
    except SystemExit as stop:  # a decided exit (2, 3): no teardown either, where gloo could abort
        code = _code_of(stop)
    except Exception:  # noqa: BLE001 - a bug, or a collective failed by a peer's death: Python's report
        # and code, without the teardown, which a restart otherwise waits for (its detection phase).
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_without_teardown(code)
