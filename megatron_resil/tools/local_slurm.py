"""A throwaway single-node Slurm on this machine, for the tests and for trying scripts/pretrain.sbatch on
a laptop: Debian's slurmctld and slurmd with a generated slurm.conf in one directory, started and
stopped by their PIDs.

    python -m megatron_resil.tools.local_slurm start DIR [--install]   # prints `export SLURM_CONF=...`
    python -m megatron_resil.tools.local_slurm stop DIR

Everything Slurm writes (state, spool, logs, pid files) stays under DIR; the daemons listen on free
ports, so two of these can run side by side. `--nodes N` starts N slurmd on this host (node1..nodeN,
each with its own port and spool): enough for a multi-node job's srun, one launcher per "node". No munge:
`AuthType=auth/none` with `CredType=cred/none`, which is only acceptable on a machine nobody else can
reach. `--install` installs the Debian packages (`slurmctld slurmd slurm-client`, no recommends) when
they are missing and this process may (root).

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

from megatron_resil.launch.ports import free_loopback_port

# Another apt-get or dpkg (a second installer in a parallel test run, unattended upgrades) holds the lock:
# wait for it rather than fail.
APT_WAITS_FOR_LOCK = ["-o", "DPkg::Lock::Timeout=600"]
PACKAGES = ("slurmctld", "slurmd", "slurm-client")


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
    for cmd in (["apt-get", *APT_WAITS_FOR_LOCK, "update", "-qq"],
                ["apt-get", *APT_WAITS_FOR_LOCK, "install", "-y", "-qq", "--no-install-recommends",
                 *PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed: {(done.stderr or done.stdout).strip()[-300:]}")
    if missing_binaries():
        raise SlurmUnavailable(f"installed {' '.join(PACKAGES)}, still missing {missing_binaries()}")



def node_names(nodes: int) -> list[str]:
    """One node: this host's name. More: node1..nodeN, each its own slurmd on this host (`slurmd -N`)."""
    if nodes == 1:
        return [socket.gethostname().split(".")[0]]
    return [f"node{i}" for i in range(1, nodes + 1)]


def write_config(directory: Path, cpus: int | None = None, nodes: int = 1) -> Path:
    """slurm.conf for `nodes` nodes on this host, everything under `directory`."""
    directory = directory.resolve()
    (directory / "state").mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().split(".")[0]
    cpus = cpus or os.cpu_count() or 1
    names = node_names(nodes)
    for name in names:
        (directory / f"spool-{name}").mkdir(exist_ok=True)
    # Several slurmd on one host tell themselves apart by node name (%n) and port.
    node_lines = [f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_loopback_port()} "
                  f"CPUs={cpus} State=UNKNOWN" for name in names]
    conf = directory / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=resil",
        f"SlurmctldHost={host}(127.0.0.1)",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/none",
        "CredType=cred/none",
        "AuthInfo=cred_expire=10",
        f"SlurmctldPort={free_loopback_port()}",
        f"StateSaveLocation={directory / 'state'}",
        f"SlurmdSpoolDir={directory / 'spool-%n'}",
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}",
        f"SlurmdPidFile={directory / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={directory / 'slurmctld.log'}",
        f"SlurmdLogFile={directory / 'slurmd-%n.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "JobRequeue=1",
        # Job ids of two throwaway clusters on one host never coincide: pretrain.sbatch derives its
        # rendezvous port from the job id, and a cluster's ids would otherwise start at 1 every time.
        f"FirstJobId={100 + (os.getpid() * 97 + int(time.time())) % 2400}",
        "ReturnToService=2",
        "MailProg=/bin/true",
        "SchedulerParameters=sched_interval=2",
        "KillWait=30",
        "MinJobAge=3600",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        *node_lines,
        f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=FORCE:4",
        "",
    ]))
    return conf


def client_env(directory: Path) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(directory.resolve() / "slurm.conf")}


def _pid_files(directory: Path) -> list[Path]:
    return [directory / "slurmctld.pid", *sorted(directory.glob("slurmd-*.pid"))]


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
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


def start(directory: Path, cpus: int | None = None, nodes: int = 1, timeout: float = 30.0) -> dict[str, str]:
    """Start slurmctld and one slurmd per node for `directory` and wait until every node takes jobs;
    the clients' environment."""
    directory = directory.resolve()
    conf = write_config(directory, cpus, nodes)
    env = client_env(directory)
    # -c: start from a clean state (no jobs of an earlier cluster in this directory).
    commands = [["slurmctld", "-c", "-i"], *(["slurmd", "-c", "-N", name] for name in node_names(nodes))]
    for command in commands:
        done = subprocess.run([command[0], "-f", str(conf), *command[1:]], env=env, capture_output=True,
                              text=True, timeout=60)
        if done.returncode != 0:
            stop(directory)
            said = (done.stderr or done.stdout).strip()[-300:]
            raise SlurmUnavailable(f"{command[0]} did not start: {said}")
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        got = subprocess.run(["sinfo", "-h", "-o", "%D %T"], env=env, capture_output=True, text=True)
        state = got.stdout.strip()
        if got.returncode == 0 and state == f"{nodes} idle":
            return env
        time.sleep(0.3)
    logs = "".join(p.read_text(errors="replace")[-400:] for p in sorted(directory.glob("slurm*.log")))
    stop(directory)
    raise SlurmUnavailable(f"the node did not become idle within {timeout:.0f} s (state {state!r}): {logs}")


def stop(directory: Path, timeout: float = 15.0) -> None:
    """Stop the daemons of `directory` by their PIDs (SIGTERM, then SIGKILL)."""
    directory = directory.resolve()
    pids = [p for p in map(_pid, _pid_files(directory)) if _alive(p)]
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
    parser.add_argument("--cpus", type=int, default=None, help="CPUs of each node (default: this machine's)")
    parser.add_argument("--nodes", type=int, default=1,
                        help="nodes, each its own slurmd on this host (more than 1: named node1..nodeN)")
    args = parser.parse_args(argv)
    try:
        if args.action == "stop":
            stop(args.dir)
            return 0
        if args.install:
            install()
        elif missing_binaries():
            raise SlurmUnavailable(f"Slurm is not installed (missing {missing_binaries()}); pass --install")
        env = start(args.dir, args.cpus, args.nodes)
    except SlurmUnavailable as e:
        print(f"local_slurm: {e}", file=sys.stderr)
        return 1
    print(f"export SLURM_CONF={env['SLURM_CONF']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
