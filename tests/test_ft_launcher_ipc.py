"""NVRx's IPC sockets are names another local user could take first (docs/failures.md, "Hangs and
in-job restarts").

NVRx's ft_launcher and its rank monitors talk over Unix sockets named `<temp dir>/_ft_launcher<pid>...socket`
and unpickle what they read. In a shared /tmp another user can bind such a name before the launcher does:
NVRx's launcher then cannot start (it may not remove another user's socket), and a rank given such a name
would send to, and unpickle the answer of, whoever holds it. `python -m megatron_resil.launch.ft_launcher`
(what our scripts run) gives NVRx a directory of its own; a rank refuses a socket that is not its user's.
Real launchers, real sockets, and the other user a real uid.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_resil.resilience import fault_tolerance

try:
    from tests import launch  # tests/ is a package
except ImportError:  # tests/ on sys.path instead
    import launch

OURS = "megatron_resil.launch.ft_launcher"
NVRX = "nvidia_resiliency_ext.fault_tolerance.launcher"  # what the `ft_launcher` command runs
OTHER_UID = 1  # the user who takes the names first ("daemon"): it needs no account to own a file
VICTIM_UID = 65534  # "nobody": the job's user where the test switches users

# The job's one rank: says where its IPC sockets are, and what holds their directory.
RANK = """
import json, os, stat
where = {}
for var in ("FT_RANK_MONITOR_IPC_SOCKET", "FT_LAUNCHER_IPC_SOCKET"):
    path = os.environ[var]
    d = os.stat(os.path.dirname(path))
    where[var] = [path, stat.S_IMODE(d.st_mode), d.st_uid, stat.S_ISSOCK(os.lstat(path).st_mode)]
print("IPC " + json.dumps(where), flush=True)
"""

# Runs as the job's user: says its pid, waits for the other user to take the names, then runs the launcher
# module in this process (so with this pid, which NVRx names its sockets after), as `python -m` would.
SHIM = """
import os, runpy, sys
print(os.getpid(), flush=True)
sys.stdin.readline()
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory like /tmp: anyone may write, only an entry's owner may remove it (sticky). Made in the
    system's temporary directory, not pytest's: a Unix socket's path has at most 107 bytes."""
    shared = Path(tempfile.mkdtemp(prefix="ipc-"))
    shared.chmod(0o1777)
    (shared / "rank.py").write_text(RANK)
    (shared / "shim.py").write_text(SHIM)
    yield shared
    shutil.rmtree(shared)


def _launcher(module: str, shared: Path, rank: tuple[str, ...] = ()) -> list[str]:
    """`module` launching one rank: rank.py with this interpreter, or the command `rank`."""
    return [sys.executable, "-m", module, "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{launch.free_loopback_port()}", "--local-addr", "127.0.0.1",
            "--max-restarts", "0", "--ft-enable-nic-monitor", "false",
            *(("--no-python", *rank) if rank else (str(shared / "rank.py"),))]


def _env(shared: Path) -> dict[str, str]:
    return {**launch.env(standby=False), "TMPDIR": str(shared), "HOME": str(shared)}


def _where(output: str) -> dict[str, list]:
    lines = [line for line in output.splitlines() if line.startswith("IPC ")]
    assert len(lines) == 1, output[-3000:]
    return json.loads(lines[0][4:])


def _take(path: Path, uid: int) -> socket.socket:
    """Bind `path` and give it to `uid`: a socket another user holds."""
    held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    held.bind(str(path))
    held.listen(1)
    os.chown(path, uid, uid)
    return held


@pytest.mark.slow
@pytest.mark.compat
def test_our_launcher_keeps_nvrx_sockets_in_a_private_directory_and_removes_it(shared) -> None:
    before = set(shared.iterdir())
    result = subprocess.run(_launcher(OURS, shared), env=_env(shared), cwd=launch.REPO, timeout=120,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    for var, (path, mode, uid, is_socket) in _where(result.stdout).items():
        private = Path(path).parent
        assert private.parent == shared and private.name.startswith("resil-"), (var, path)
        assert (mode, uid, is_socket) == (0o700, os.geteuid(), True), (var, path, oct(mode), uid)
    assert set(shared.iterdir()) == before  # the private directory is gone, and nothing else was left


@pytest.mark.slow
def test_nvrx_launcher_names_its_sockets_in_the_shared_directory(shared) -> None:
    """The control: what the test above guards against is NVRx's behaviour."""
    result = subprocess.run(_launcher(NVRX, shared), env=_env(shared), cwd=launch.REPO, timeout=120,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    for path, _, _, _ in _where(result.stdout).values():
        assert Path(path).parent == shared and Path(path).name.startswith("_ft_launcher"), path


def _launch_as_victim_after_names_are_taken(module: str, shared: Path) -> tuple[subprocess.CompletedProcess,
                                                                                 list[Path]]:
    """The job's user starts `module`; before it runs, the other user binds the names NVRx will use."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("switching to another user needs root and setpriv")
    probe = subprocess.run(["setpriv", f"--reuid={VICTIM_UID}", f"--regid={VICTIM_UID}", "--clear-groups",
                            sys.executable, "-c", "import megatron_resil, nvidia_resiliency_ext"],
                           cwd=launch.REPO, env=_env(shared), capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"uid {VICTIM_UID} cannot run this checkout's interpreter: {probe.stderr.strip()[-300:]}")
    # The rank under the system's interpreter: a process of that user may not be able to start this one (it
    # may sit under a directory only root can search, which setpriv's own start may pass as root).
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if system_python is None:
        pytest.skip("no python3 in /usr/bin or /bin for the rank")
    proc = subprocess.Popen(["setpriv", f"--reuid={VICTIM_UID}", f"--regid={VICTIM_UID}", "--clear-groups",
                             sys.executable, str(shared / "shim.py"),
                             *_launcher(module, shared, rank=(system_python, str(shared / "rank.py")))[1:]],
                            cwd=launch.REPO, env=_env(shared), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        pid = int(proc.stdout.readline())
        taken = [shared / f"_ft_launcher{pid}.socket", shared / f"_ft_launcher{pid}_rmon0.socket"]
        held = [_take(path, OTHER_UID) for path in taken]
        proc.stdin.write("go\n")
        proc.stdin.close()
        out = proc.stdout.read()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    for sock in held:
        sock.close()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out), taken


@pytest.mark.slow
def test_names_taken_by_another_user_stop_nvrx_launcher_but_not_ours(shared) -> None:
    theirs, taken = _launch_as_victim_after_names_are_taken(NVRX, shared)
    assert theirs.returncode != 0 and "IPC " not in theirs.stdout, theirs.stdout[-3000:]
    # It stops where it may not remove the other user's socket to bind its own.
    assert "PermissionError(1, 'Operation not permitted')" in theirs.stdout, theirs.stdout[-3000:]
    assert all(path.stat().st_uid == OTHER_UID for path in taken)  # the other user's, untouched

    ours, taken = _launch_as_victim_after_names_are_taken(OURS, shared)
    assert ours.returncode == 0, ours.stdout[-3000:]
    for path, mode, uid, _ in _where(ours.stdout).values():
        assert Path(path).parent.parent == shared, path
        assert (mode, uid) == (0o700, VICTIM_UID), (path, oct(mode), uid)
    assert all(path.stat().st_uid == OTHER_UID for path in taken)


# ---- the rank's side: a socket it was given that is not its user's ------------------------------------

def _own_socket(path: Path) -> socket.socket:
    own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    own.bind(str(path))
    return own


def test_a_rank_trusts_its_own_socket_in_a_private_or_sticky_directory(tmp_path, shared, monkeypatch) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    held = [_own_socket(private / "rmon.socket"), _own_socket(shared / "launcher.socket")]
    monkeypatch.setenv("FT_RANK_MONITOR_IPC_SOCKET", str(private / "rmon.socket"))
    monkeypatch.setenv("FT_LAUNCHER_IPC_SOCKET", str(shared / "launcher.socket"))
    assert fault_tolerance.foreign_ipc_socket() is None
    for sock in held:
        sock.close()


def test_a_rank_refuses_a_socket_in_a_directory_others_may_change(tmp_path, monkeypatch) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # not sticky: anyone may rename this user's socket and put theirs in its place
    held = _own_socket(open_dir / "rmon.socket")
    monkeypatch.setenv("FT_RANK_MONITOR_IPC_SOCKET", str(open_dir / "rmon.socket"))
    monkeypatch.delenv("FT_LAUNCHER_IPC_SOCKET", raising=False)
    why = fault_tolerance.foreign_ipc_socket()
    assert why and "FT_RANK_MONITOR_IPC_SOCKET=" in why and "mode 777" in why, why
    held.close()


def test_a_rank_refuses_a_symlink_where_its_socket_should_be(tmp_path, monkeypatch) -> None:
    held = _own_socket(tmp_path / "real.socket")
    (tmp_path / "link.socket").symlink_to(tmp_path / "real.socket")
    monkeypatch.setenv("FT_LAUNCHER_IPC_SOCKET", str(tmp_path / "link.socket"))
    monkeypatch.delenv("FT_RANK_MONITOR_IPC_SOCKET", raising=False)
    why = fault_tolerance.foreign_ipc_socket()
    assert why and why.startswith(f"FT_LAUNCHER_IPC_SOCKET={tmp_path / 'link.socket'} is not a socket"), why
    held.close()


def test_pretrain_refuses_a_rank_monitor_socket_another_user_holds(tmp_path, shared) -> None:
    """One line, exit code 2, nothing sent, nothing saved."""
    if os.geteuid() != 0:
        pytest.skip("giving a socket to another user needs root")
    path = shared / "_ft_launcher4242_rmon0.socket"
    held = _take(path, OTHER_UID)
    save = tmp_path / "ckpt"
    result = subprocess.run([sys.executable, launch.PRETRAIN, *launch.TINY_MODEL, *launch.TINY_TRAINING,
                             "--enable-ft-package", "--train-iters", "10", "--save", str(save)],
                            env={**launch.env(), "FT_RANK_MONITOR_IPC_SOCKET": str(path)}, cwd=launch.REPO,
                            timeout=120, capture_output=True, text=True)
    held.settimeout(0)
    with pytest.raises(BlockingIOError):
        held.accept()  # no connection was made to it
    held.close()
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, lines
    assert f"FT_RANK_MONITOR_IPC_SOCKET={path} is held by uid {OTHER_UID}" in lines[0], lines
    assert "--enable-ft-package" in lines[0] and "megatron_resil.launch.ft_launcher" in lines[0], lines
    assert not save.exists()
    assert stat.S_ISSOCK(os.lstat(path).st_mode) and os.lstat(path).st_uid == OTHER_UID


def test_a_tmpdir_too_long_for_the_socket_names_is_one_line_and_exit_code_2(tmp_path) -> None:
    """NVRx's socket names under a private directory in TMPDIR must fit a Unix socket's 107 bytes: a TMPDIR
    that leaves no room is said in one line, before NVRx's launcher starts, rather than as NVRx's
    `OSError('AF_UNIX path too long')` once the workers are being started."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    result = subprocess.run([sys.executable, "-m", OURS, "--nnodes", "1", "--nproc-per-node", "1",
                             "--rdzv-backend", "c10d", launch.PRETRAIN, "--train-iters", "1"],
                            env={**launch.env(), "TMPDIR": str(deep)}, cwd=launch.REPO, timeout=60,
                            capture_output=True, text=True)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"[resil] ft_launcher: TMPDIR={deep} is too long"), lines
    assert "at most 107" in lines[0] and "set TMPDIR to a shorter path" in lines[0], lines
    assert list(deep.iterdir()) == []  # nothing made there
