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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
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

    launcher.main(argv)  # NVRx's own exit: sys.exit with the agent's code
    return 0


if __name__ == "__main__":
    # NVRx's launcher ends with sys.exit; without the interpreter's teardown of torch (0.5 s) after it:
    # the next job step waits for this exit.
    process_exit.run(main)
