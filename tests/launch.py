"""Starting real pretrain.py runs under torchrun on loopback, and reading their Megatron-format logs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

# Processes are read through the project's one /proc/PID/stat reader.
from megatron_resil.launch.ports import free_loopback_port
from megatron_resil.rank_process import alive, children_of, descendants_of, proc_stat, processes  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = str(REPO / "pretrain.py")

TINY_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "32", "--max-position-embeddings", "32",
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
# Test jobs often resume with another --train-iters than they were saved with: as Megatron-LM requires of
# a resume whose schedule differs, they say which one wins (tests/test_resume_semantics.py drops it).
TINY_TRAINING = ["--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4",
                 "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
                 "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
                 "--use-checkpoint-opt_param-scheduler"]

_LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")


def env(standby: bool = True) -> dict[str, str]:
    """The environment of every process the tests start. `standby=False`: without the tests' standby
    (tests/conftest.py), for a process that changes what it imports before pretrain.py runs."""
    e = dict(os.environ)
    if not standby:
        e.pop("MEGATRON_RESIL_STANDBY", None)
    e.update({"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
              "MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1"})
    return e


def torchrun_cmd(args: list[str], nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), PRETRAIN, *args]


def run(args: list[str], nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run to completion; stdout and stderr together in .stdout."""
    return subprocess.run(torchrun_cmd(args, nproc), env=env(), cwd=REPO, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start(args: list[str], nproc: int = 2, log_path: Path | None = None) -> subprocess.Popen:
    """Start torchrun in its own session, output to a file. Signalling that group reaches only the
    agent (torchrun puts each rank in a session of its own); the agent forwards SIGTERM to the ranks.
    To kill the ranks too, kill them by pid (see test_crash_consistency._kill_run)."""
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    return subprocess.Popen(torchrun_cmd(args, nproc), env=env(), cwd=REPO, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def standby_pid(value: str | None = None) -> int | None:
    """The pid of the standby `value` names (NAME@PID; by default the tests' standby of this test process,
    tests/conftest.py), None without one: the ranks it forks, and what they start, descend from it, not
    from their launcher."""
    value = os.environ.get("MEGATRON_RESIL_STANDBY") if value is None else value
    return int(value.rpartition("@")[2]) if value and "@" in value else None


def signals_go_to(pid: int) -> int:
    """The process whose signal handling a signal to rank process `pid` meets: the worker a standby's
    client hands each signal to, as it handles it then (the one process the client holds a pidfd of,
    /proc's fdinfo naming it), or `pid` itself."""
    standby = standby_pid()
    try:
        for fd in os.listdir(f"/proc/{pid}/fdinfo"):
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                held = [int(line.split()[1]) for line in f if line.startswith("Pid:")]
            found = proc_stat(held[0]) if held and standby is not None else None
            if found is not None and found.parent == standby:
                return held[0]
    except (OSError, ValueError):
        pass
    return pid


def processes_named(standby: str) -> list[int]:
    """The live standby process called `standby` (python -m megatron_resil.launch.standby --name ...), not the
    ranks forked from it, which have its command line too: their parent has it as well."""
    needle = f"--name\0{standby}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            command = Path(f"/proc/{entry}/cmdline").read_bytes() if entry.isdigit() else b""
            if needle not in command or not alive(int(entry)):
                continue
            if Path(f"/proc/{proc_stat(int(entry)).parent}/cmdline").read_bytes() != command:
                found.append(int(entry))
        except (OSError, TypeError):
            continue
    return found


def ckpt_tool(*args, encoding: str | None = None) -> subprocess.CompletedProcess:
    """`python -m megatron_resil.tools.ckpt ARGS`, its main() run in this process (a process of its own
    costs seconds of imports; tests/test_install.py and tests/test_untrusted_checkpoint.py start the
    tool as users do). Returns its exit code and what it printed, as subprocess.run would. `encoding`: its
    stdout encodes strictly in that encoding, as under `PYTHONIOENCODING=<encoding>:strict`."""
    import contextlib
    import io

    from megatron_resil.tools import ckpt

    argv = [str(a) for a in args]
    raw = io.BytesIO()
    out = io.StringIO() if encoding is None else io.TextIOWrapper(raw, encoding=encoding, errors="strict")
    err = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = ckpt.main(argv)
        except SystemExit as stop:  # argparse's exit 2 for bad arguments
            code = stop.code if isinstance(stop.code, int) else 1
    out.flush()
    printed = out.getvalue() if encoding is None else raw.getvalue().decode(encoding)
    return subprocess.CompletedProcess(["megatron_resil.tools.ckpt", *argv], code, printed, err.getvalue())


# Run in a process of its own by ckpt_tool_measured: the tool's main() after its imports, then how far its
# peak resident memory (VmHWM) rose above what the imports took.
_MEASURED_TOOL = """
import sys
from megatron_resil import patches
patches.install_import_speedups()
from megatron_resil.tools import ckpt, ckpt_commands
def peak_kib():
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmHWM:")).split()[1])
before = peak_kib()
code = ckpt.main(sys.argv[1:])
print(f"peak memory grew by {peak_kib() - before} KiB", file=sys.stderr)
sys.exit(code)
"""


def ckpt_tool_measured(*args, timeout: float = 300) -> tuple[subprocess.CompletedProcess, int]:
    """The checkpoint tool with ARGS in a fresh process, and by how many KiB its peak resident memory grew
    while the command ran (past its imports): what reading the checkpoint cost, in a process where nothing
    else ran before."""
    done = subprocess.run([sys.executable, "-c", _MEASURED_TOOL, *[str(a) for a in args]], env=env(),
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    grew = re.search(r"peak memory grew by (\d+) KiB", done.stderr)
    assert grew is not None, done.stdout + done.stderr
    return done, int(grew.group(1))


def run_single(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """pretrain.py as a plain process (argument errors are caught before torch.distributed starts)."""
    return subprocess.run([sys.executable, PRETRAIN, *args], env=env(), cwd=REPO, timeout=timeout,
                          capture_output=True, text=True)


def ft_launcher_cmd(args: list[str], nproc: int = 2, max_restarts: int = 0,
                    ft_args: tuple[str, ...] = ()) -> list[str]:
    """NVRx's ft_launcher (`ft_launcher ...` where installed) on loopback: c10d rendezvous (the only
    backend it supports), --max-restarts always given (its default is 0: no restart at all), and the
    NIC monitor off (its command-line default, true, overrides a YAML's enable_nic_monitor: false).
    `ft_args`: the --ft-* options, e.g. ("--ft-rank-section-timeouts", "setup:600,step:180,...")."""
    port = free_loopback_port()  # for the rendezvous store
    return [sys.executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher",
            "--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1",
            "--max-restarts", str(max_restarts), "--ft-enable-nic-monitor", "false", *ft_args,
            PRETRAIN, *args]


def run_ft(args: list[str], nproc: int = 2, max_restarts: int = 0, ft_args: tuple[str, ...] = (),
           timeout: float = 240) -> subprocess.CompletedProcess:
    """ft_launcher to completion; stdout and stderr together in .stdout."""
    return subprocess.run(ft_launcher_cmd(args, nproc, max_restarts, ft_args), env=env(), cwd=REPO,
                          timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start_ft(args: list[str], log_path: Path, nproc: int = 2, max_restarts: int = 0,
             ft_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """ft_launcher in its own session, output to `log_path`; its workers are its direct children."""
    return subprocess.Popen(ft_launcher_cmd(args, nproc, max_restarts, ft_args), env=env(), cwd=REPO,
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def failure_codes(output: str) -> tuple[int | None, set[int]]:
    """torchrun's report of a failed run: (the root cause's exit code, the codes of every rank it names).
    Once one rank has exited, torchrun ends the others with SIGTERM: a rank that had not exited yet by
    then, though about to exit with the same code, is reported as -15."""
    root = re.search(r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d+)", output, re.DOTALL)
    return (int(root.group(1)) if root else None,
            {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", output)})


def losses(output: str) -> dict[int, tuple[str, str]]:
    """iteration -> (lm loss, grad norm) as printed, so comparisons are exact to the printed digits."""
    return {int(m.group(1)): (m.group(2), m.group(3)) for m in _LOSS_LINE.finditer(output)}


def mount_tmpfs(directory: Path, options: str) -> None:
    """Mount a real tmpfs (e.g. options "size=16m,nr_inodes=400") at `directory`, which is created, or
    skip the test where that is impossible (it needs root). Unmount with `umount -l`."""
    import pytest

    directory.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")


def refused_line(argv: list[str], capsys, world_size: int = 1) -> str:
    """The one line pretrain.py's argument checks refuse `argv` with (exit 2), parsed in this process."""
    import pytest

    from megatron_resil.arguments import parse_args

    with pytest.raises(SystemExit) as stop:
        parse_args(argv, world_size=world_size)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain.py: error: "), lines
    return lines[0]


def checkpoint_tensors(checkpoint: Path, scratch: Path, weights_only: bool = True) -> dict:
    """The tensors of a torch_dist checkpoint directory (iter_NNNNNNN), converted through DCP into `scratch`:
    the weights keyed by the model's own names, or with `weights_only=False` the optimizer's and the RNG's
    too."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from megatron_resil import patches

    patches.install(quiet=True)  # megatron-core 0.19 reads the common state through DCP, as pretrain.py does
    out = scratch / f"{checkpoint.parent.name}_{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint), str(out))
    skipped = ("optimizer.", "chained_", "rng_state", "common_state") if weights_only else ()
    tensors = {k: v for k, v in torch.load(out, weights_only=False).items()
               if isinstance(v, torch.Tensor) and not k.startswith(skipped)}
    assert "embedding.word_embeddings.weight" in tensors
    return tensors


def differing_tensors(a: Path, b: Path, scratch: Path, weights_only: bool = True) -> list[str]:
    """The names of the tensors two checkpoints hold with different values (bit for bit)."""
    import torch

    (scratch / "a").mkdir(exist_ok=True)
    (scratch / "b").mkdir(exist_ok=True)
    ta = checkpoint_tensors(a, scratch / "a", weights_only)
    tb = checkpoint_tensors(b, scratch / "b", weights_only)
    assert ta.keys() == tb.keys()
    return sorted(k for k in ta if not torch.equal(ta[k], tb[k]))
