"""`python -m megatron_resil.launch.ft_launcher <ft_launcher's arguments>`: NVRx's ft_launcher, run unchanged,
that also reads torch's rendezvous keep-alive keys from `--rdzv-conf`, as torchrun does:

    --rdzv-conf keep_alive_interval=S,keep_alive_max_attempt=N

S seconds between a node's heartbeats, a node dropped from the rendezvous after N missed ones (whole
numbers, at least 1; torch's and NVRx's default: 5 s and 3). After a node is lost, the surviving nodes'
launchers cannot form the next round with its replacement until the lost node is dropped: S x N after its
last heartbeat, 10-15 s with the defaults (issue 26's drill). Shorter values drop it sooner; a live node
whose launcher cannot send a heartbeat for S x N seconds (a loaded or swapping host, a slow store, clocks
apart by a second or more: each node stamps its own heartbeat) is dropped too, which restarts the job.

NVRx 0.4.1 hard-codes the defaults; with either key given, this installs the one patch record that makes
its rendezvous read them (patches/nvrx.py), in this process only, then runs NVRx's launcher `main` with the
same arguments. NVRx 0.5 and later (its barrier rendezvous) drop no node by heartbeat: the keys change
nothing there, which one line says. Without the keys nothing is installed and nothing is said. Bad values:
one line and exit code 2. The `ft_launcher` command keeps NVRx's behaviour as it always had.

With `--inprocess-restart` among the training script's arguments, two more things, for warm reserves to take
a lost rank's place: the agent does not end the other workers when one is killed (the patch record
"ft_launcher leaves a lost rank's survivors to in-process restart"), and the workers are told the
rendezvous store's address (MEGATRON_RESIL_AGENT_STORE), to keep their stores there rather than on rank 0.

NVRx's launcher and its rank monitors talk over Unix sockets named `<temp dir>/_ft_launcher<pid>...socket`,
and unpickle what they read there. In a shared temporary directory (/tmp) any local user can take those
names first: the launcher then cannot start (it may not remove another user's socket), or a process of
the job connects to a socket someone else holds. So this launcher gives NVRx a directory of its own, made
afresh (mode 0700) in the temporary directory, and removes it at exit; the ranks' own TMPDIR is unchanged.

Once NVRx's launcher has decided its exit code, the process ends without the interpreter's teardown of
torch (process_exit.py): the next job step waits for this exit (benchmarks/bench_launcher_exit.py)."""

from __future__ import annotations

import os
import sys

from megatron_resil import exit_codes, process_exit
from megatron_resil.rank_process import AGENT_STORE_ENV


def _rdzv_conf(argv: list[str]) -> dict[str, str]:
    """The `--rdzv-conf` of ft_launcher's command line `argv`, as NVRx's own parser reads it."""
    from nvidia_resiliency_ext.fault_tolerance import launcher

    conf: dict[str, str] = {}
    for pair in (launcher.parse_args(argv).rdzv_conf or "").split(","):  # torch's format: k1=v1,k2=v2
        key, _, value = pair.partition("=")
        if key.strip():
            conf[key.strip()] = value.strip()
    return conf


def keep_alive(argv: list[str]) -> dict[str, int]:
    """The keep-alive keys `argv` names, checked; raises ValueError with the line to print."""
    from megatron_resil.patches.nvrx import KEEP_ALIVE_KEYS

    meaning = dict(zip(KEEP_ALIVE_KEYS, ("seconds between a node's heartbeats",
                                         "heartbeats missed before a node is dropped"), strict=True))
    conf = _rdzv_conf(argv)
    found = {}
    for key in KEEP_ALIVE_KEYS:
        if key in conf:
            value = conf[key]
            if not (value.isascii() and value.isdigit()) or int(value) < 1:
                raise ValueError(f"[resil] ft_launcher: --rdzv-conf {key}={value}: give a whole number, at "
                                 f"least 1, of {meaning[key]} (NVRx's default: keep_alive_interval=5,"
                                 "keep_alive_max_attempt=3)")
            found[key] = int(value)
    return found


def _under_inprocess_restart(argv: list[str]) -> str | None:
    """With --inprocess-restart among the script's arguments: the rendezvous store's host:port to give the
    workers for their stores ("" where there is none to give), else None."""
    from nvidia_resiliency_ext.fault_tolerance import launcher

    parsed = launcher.parse_args(argv)
    if "--inprocess-restart" not in (parsed.training_script_args or []):
        return None
    host, _, port = (parsed.rdzv_endpoint or "").rpartition(":")
    return f"{host}:{port}" if parsed.rdzv_backend == "c10d" and host and port.isdigit() else ""


_SUN_PATH_MAX = 107  # bytes of a Unix socket's path, Linux
_LONGEST_NVRX_SOCKET = "_ft_launcher4194304_rmon999.socket"  # the longest pid, a 3-digit local rank


def private_ipc_dir() -> str:
    """A directory of this process's own, made afresh, where NVRx's launcher names its IPC sockets (it names
    them from `tempfile.gettempdir()`, the launcher's when its module is imported, and the rank monitors'
    when they are forked from it); removed at exit. Raises ValueError (the line to print) where the temporary
    directory's path leaves no room for NVRx's socket names, OSError where no directory can be made there."""
    import atexit
    import shutil
    import tempfile

    if "nvidia_resiliency_ext.fault_tolerance.launcher" in sys.modules:  # its socket's name is made already
        raise RuntimeError("NVRx's launcher module was imported before its private IPC directory was made")
    base = tempfile.gettempdir()
    longest = len(os.fsencode(os.path.join(base, "resil-12345678", _LONGEST_NVRX_SOCKET)))
    if longest > _SUN_PATH_MAX:
        raise ValueError(f"TMPDIR={base} is too long for NVRx's socket names in a directory under it "
                         f"({longest} bytes, at most {_SUN_PATH_MAX}); set TMPDIR to a shorter path")
    path = tempfile.mkdtemp(prefix="resil-")  # mode 0700, under a name no one held
    tempfile.tempdir = path
    atexit.register(shutil.rmtree, path, True)  # process_exit runs atexit; rmtree follows no symlink
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        ipc_dir = private_ipc_dir()
    except ValueError as err:
        print(f"[resil] ft_launcher: {err}", file=sys.stderr, flush=True)
        return exit_codes.BAD_ARGUMENTS
    except OSError as err:
        print(f"[resil] ft_launcher: cannot make a private directory for NVRx's IPC sockets ({err}); set "
              "TMPDIR to a directory you can write", file=sys.stderr, flush=True)
        return exit_codes.BAD_ARGUMENTS
    try:
        asked = keep_alive(argv)
    except ValueError as err:
        print(err, file=sys.stderr, flush=True)
        return exit_codes.BAD_ARGUMENTS
    from megatron_resil import patches
    from megatron_resil.patches import nvrx

    records = []
    agent_store = _under_inprocess_restart(argv)
    if agent_store is not None:
        records.append(nvrx.KEEP_SURVIVORS)
        if agent_store:  # the workers host no store: the loss of any rank, rank 0's included, leaves them up
            os.environ[AGENT_STORE_ENV] = agent_store
    if asked:
        reason = nvrx.keep_alive_not_needed()
        if reason is None:
            records.append(nvrx.KEEP_ALIVE)
        else:
            print(f"[resil] ft_launcher: --rdzv-conf {','.join(f'{k}={v}' for k, v in asked.items())} has no "
                  f"effect on nvidia-resiliency-ext {patches.installed_version(nvrx.PACKAGE)}: {reason}",
                  file=sys.stderr, flush=True)
    if records:
        try:
            patches.install(only=tuple(records))  # a mismatch: its one line, exit 2
        except patches.UpstreamMismatch as mismatch:
            return mismatch.code
    from nvidia_resiliency_ext.fault_tolerance import launcher

    if os.path.dirname(launcher.FT_LAUNCHER_IPC_SOCKET) != ipc_dir:  # NVRx names its sockets otherwise now
        raise RuntimeError(f"NVRx's launcher socket {launcher.FT_LAUNCHER_IPC_SOCKET} is not in {ipc_dir}")
    launcher.main(argv)  # NVRx's own exit: sys.exit with the agent's code
    return 0


FROM_STANDBY_ENV = "MEGATRON_RESIL_LAUNCHER_FROM_STANDBY"


def hand_over_to_the_standby() -> None:
    """With MEGATRON_RESIL_LAUNCHER_FROM_STANDBY=1 (run_local.sh sets it from a run's second job step on,
    when the run's standby has torch imported): this launcher is forked from the standby that
    MEGATRON_RESIL_STANDBY names, as a rank is, and this process only mirrors it; NVRx's launcher imports
    torch, about 2 s of a new job step's start on our machines. It takes the import-time environment its
    ranks get (OMP_NUM_THREADS=1 for more than one rank per node, TORCH_CPP_LOG_LEVEL=error under
    --inprocess-restart, each unless set), which the standby imported torch in; its ranks get the same as
    before. Where the standby does not serve it, it says why in one line and runs here."""
    if os.environ.pop(FROM_STANDBY_ENV, None) != "1":  # read once: its ranks are not launchers
        return
    from megatron_resil.launch import standby

    os.environ.update(standby.ranks_environment(sys.argv))
    standby.hand_over(who="the launcher")


if __name__ == "__main__":
    hand_over_to_the_standby()
    # NVRx's launcher ends with sys.exit; without the interpreter's teardown of torch (0.5 s) after it:
    # the next job step waits for this exit.
    process_exit.run(main)
