"""A throwaway single-node Slurm on this machine, for the tests and for trying scripts/pretrain.sbatch on
a laptop: Debian's slurmctld and slurmd with a generated slurm.conf in one directory, started and
stopped by their PIDs.

    python -m megatron_resil.tools.local_slurm start DIR [--install]   # prints `export SLURM_CONF=...`
    python -m megatron_resil.tools.local_slurm stop DIR

Everything Slurm writes (state, spool, logs, pid files) stays under DIR; the daemons listen on two free
ports, so two of these can run side by side. No munge: `AuthType=auth/none` with `CredType=cred/none`,
which is only acceptable on a machine nobody else can reach. `--install` installs the Debian packages
(`slurmctld slurmd slurm-client`, no recommends) when they are missing and this process may (root).

Why each setting (all measured on Slurm 22.05 here):
- `ProctrackType=proctrack/linuxproc`, `TaskPlugin=task/none`: no cgroups in a container.
- `AuthInfo=cred_expire=10`: a requeued job waits for the credential lifetime before it may start again
  (`Reason=BeginTime`, about 121 s by default); 10 s makes a requeue round trip take seconds.
- `SchedulerParameters=sched_interval=2`, `JobRequeue=1`, `ReturnToService=2`, `MailProg=/bin/true`.
- `KillWait=30`: the grace between Slurm's SIGTERM and its SIGKILL at the time limit or `scancel`.
- `OverSubscribe=FORCE` on the partition: the test jobs are tiny; several may share the node's CPUs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client")
DAEMONS = ("slurmctld", "slurmd")


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed here and cannot be installed (the reason is the message)."""


def missing_binaries() -> list[str]:
    return [b for b in ("slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")
            if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def install() -> None:
    """Install Debian's Slurm packages when they are missing; SlurmUnavailable when that is impossible."""
    if not missing_binaries():
        return
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("Slurm is not installed and there is no apt-get to install it")
    if os.geteuid() != 0:
        raise SlurmUnavailable("Slurm is not installed and installing it needs root "
                               f"(apt-get install {' '.join(PACKAGES)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed: {(done.stderr or done.stdout).strip()[-300:]}")
    if missing_binaries():
        raise SlurmUnavailable(f"installed {' '.join(PACKAGES)}, still missing {missing_binaries()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(directory: Path, cpus: int | None = None) -> Path:
    """slurm.conf for one node named after this host, everything under `directory`."""
    directory = directory.resolve()
    for sub in ("state", "spool"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().split(".")[0]
    cpus = cpus or os.cpu_count() or 1
    conf = directory / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=resil",
        f"SlurmctldHost={host}(127.0.0.1)",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/none",
        "CredType=cred/none",
        "AuthInfo=cred_expire=10",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        f"StateSaveLocation={directory / 'state'}",
        f"SlurmdSpoolDir={directory / 'spool'}",
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}",
        f"SlurmdPidFile={directory / 'slurmd.pid'}",
        f"SlurmctldLogFile={directory / 'slurmctld.log'}",
        f"SlurmdLogFile={directory / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "JobRequeue=1",
        "ReturnToService=2",
        "MailProg=/bin/true",
        "SchedulerParameters=sched_interval=2",
        "KillWait=30",
        "MinJobAge=3600",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
        "",
    ]))
    return conf


def client_env(directory: Path) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(directory.resolve() / "slurm.conf")}


def _pid(directory: Path, daemon: str) -> int | None:
    try:
        return int((directory / f"{daemon}.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start(directory: Path, cpus: int | None = None, timeout: float = 30.0) -> dict[str, str]:
    """Start slurmctld and slurmd for `directory` and wait until the node takes jobs; the clients' env."""
    directory = directory.resolve()
    conf = write_config(directory, cpus)
    env = client_env(directory)
    # -c: start from a clean state (no jobs of an earlier cluster in this directory).
    for daemon, extra in (("slurmctld", ["-c", "-i"]), ("slurmd", ["-c"])):
        done = subprocess.run([daemon, "-f", str(conf), *extra], env=env, capture_output=True, text=True,
                              timeout=60)
        if done.returncode != 0:
            stop(directory)
            raise SlurmUnavailable(f"{daemon} did not start: {(done.stderr or done.stdout).strip()[-300:]}")
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        got = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
        state = got.stdout.strip()
        if got.returncode == 0 and state.startswith("idle"):
            return env
        time.sleep(0.3)
    logs = "".join((directory / f"{d}.log").read_text(errors="replace")[-400:]
                   for d in DAEMONS if (directory / f"{d}.log").exists())
    stop(directory)
    raise SlurmUnavailable(f"the node did not become idle within {timeout:.0f} s (state {state!r}): {logs}")


def stop(directory: Path, timeout: float = 15.0) -> None:
    """Stop the daemons of `directory` by their PIDs (SIGTERM, then SIGKILL)."""
    directory = directory.resolve()
    pids = [p for p in (_pid(directory, d) for d in DAEMONS) if _alive(p)]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_resil.tools.local_slurm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("start", "stop"))
    parser.add_argument("dir", type=Path, help="where slurm.conf, state, spool and logs go")
    parser.add_argument("--install", action="store_true", help="apt-get install Slurm when it is missing")
    parser.add_argument("--cpus", type=int, default=None, help="CPUs of the node (default: this machine's)")
    args = parser.parse_args(argv)
    try:
        if args.action == "stop":
            stop(args.dir)
            return 0
        if args.install:
            install()
        elif missing_binaries():
            raise SlurmUnavailable(f"Slurm is not installed (missing {missing_binaries()}); pass --install")
        env = start(args.dir, args.cpus)
    except SlurmUnavailable as e:
        print(f"local_slurm: {e}", file=sys.stderr)
        return 1
    print(f"export SLURM_CONF={env['SLURM_CONF']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
