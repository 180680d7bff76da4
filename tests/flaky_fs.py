"""A FUSE passthrough of a directory whose reads fail with a real EIO: the first N read() calls on
files whose path (from the mount's root, e.g. /iter_0000004/__1_0.distcp) contains MATCH fail, later
ones succeed (a transient fault: a flaky network filesystem, a storage server failing over); with N < 0
every such read fails (a persistent one).

    python tests/flaky_fs.py SOURCE MOUNTPOINT --match __1_0.distcp --fail-reads 2

With --stall, such reads never answer (a hung storage server): the reading thread waits in the kernel
until the file system is unmounted.

Read-only unless --writable. Then --stall-writes MATCH holds every write to a file whose path contains
MATCH until the file --release names exists (storage too slow for the saves asked of it, until the test
lets it go), and --record-writers FILE appends one JSON line per file created or written and process that
did it ({"op", "path", "pid", "comm"}: the process's name, e.g. the async checkpoint worker's).

Runs in the foreground until unmounted (`umount MOUNTPOINT`) or killed. Needs /dev/fuse, libfuse2 and
fusepy (the tests skip without them). Each failure is one line on stderr, so a test can count them."""

from __future__ import annotations

import argparse
import ctypes.util
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time

APT_WAITS_FOR_LOCK = ["-o", "DPkg::Lock::Timeout=600"]  # another installer (Slurm's, in a parallel run): wait


def unavailable() -> str | None:
    """Why a FUSE filesystem cannot be mounted here (None: it can); installs Debian's libfuse2 when
    it is missing and this is root."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if ctypes.util.find_library("fuse") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            return "libfuse2 is not installed (apt-get install libfuse2)"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", *APT_WAITS_FOR_LOCK, "install", "-y", "-qq", "--no-install-recommends",
                   "libfuse2"]
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            subprocess.run(["apt-get", *APT_WAITS_FOR_LOCK, "update", "-qq"], env=env, capture_output=True,
                           timeout=900)
            done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            return f"could not install libfuse2: {done.stderr.strip()[-200:]}"
    try:
        import fuse  # noqa: F401 - fusepy
    except (ImportError, OSError) as err:
        return f"fusepy: {err}"
    return None


try:
    from fuse import FUSE, FuseOSError, Operations, fuse_get_context  # fusepy
except (ImportError, OSError):  # the tests ask unavailable() first
    Operations = object

_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class FlakyPassthrough(Operations):
    def __init__(self, source: str, match: str, fail_reads: int, stall: bool = False) -> None:
        self.source, self.match, self.left = os.path.realpath(source), match, fail_reads
        self.stall, self._unmounted = stall, threading.Event()
        self._mutex = threading.Lock()  # not `lock`: that name is a FUSE operation

    def destroy(self, path):
        self._unmounted.set()

    def _real(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip("/"))

    def getattr(self, path, fh=None):
        st = os.lstat(self._real(path))
        return {key: getattr(st, key) for key in ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime",
                                                   "st_nlink", "st_size", "st_uid")}

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._real(path))]

    def readlink(self, path):
        return os.readlink(self._real(path))

    def statfs(self, path):
        st = os.statvfs(self._real(path))
        return {key: getattr(st, key) for key in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                                   "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

    def open(self, path, flags):
        if flags & _WRITING:
            raise FuseOSError(errno.EROFS)
        return os.open(self._real(path), os.O_RDONLY)

    def read(self, path, size, offset, fh):
        if self.stall and self.match in path:
            print(f"flaky_fs: stalling a read of {path}", file=sys.stderr, flush=True)
            self._unmounted.wait()
            raise FuseOSError(errno.EIO)
        if self.match in path:
            with self._mutex:
                fail = self.left != 0
                if self.left > 0:
                    self.left -= 1
            if fail:
                print(f"flaky_fs: EIO on read of {path}", file=sys.stderr, flush=True)
                raise FuseOSError(errno.EIO)
        return os.pread(fh, size, offset)

    def release(self, path, fh):
        os.close(fh)


def mount(source, mountpoint, options: list[str], log) -> subprocess.Popen:
    """Mount this file system of `source` at `mountpoint` (created), served by a child process."""
    os.makedirs(mountpoint)
    proc = subprocess.Popen([sys.executable, __file__, str(source), str(mountpoint), *options],
                            stderr=open(log, "w"))
    deadline = time.monotonic() + 30
    while not os.path.ismount(mountpoint):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"flaky_fs did not mount {mountpoint}: {open(log).read()[-2000:]}")
        time.sleep(0.1)
    return proc


def unmount(proc: subprocess.Popen, mountpoint) -> None:
    subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


class WritablePassthrough(FlakyPassthrough):
    """The same, writable, recording who writes and holding the writes asked to stall."""

    def __init__(self, source: str, match: str, fail_reads: int, stall: bool, stall_writes: str | None,
                 release: str | None, record: str | None) -> None:
        super().__init__(source, match, fail_reads, stall)
        self.stall_writes, self.release_path, self.record = stall_writes, release, record
        self._seen: set[tuple[str, str, int]] = set()
        self._said_stalling: set[str] = set()

    def _note(self, op: str, path: str) -> None:
        if self.record is None:
            return
        pid = fuse_get_context()[2]
        try:
            with open(f"/proc/{pid}/status") as f:  # the caller may be a thread: its process's name
                tgid = int(next(line.split()[1] for line in f if line.startswith("Tgid:")))
            with open(f"/proc/{tgid}/comm") as f:
                comm = f.read().strip()
        except (OSError, StopIteration, ValueError):
            tgid, comm = pid, "?"
        with self._mutex:
            if (op, path, tgid) in self._seen:
                return
            self._seen.add((op, path, tgid))
            with open(self.record, "a") as f:
                f.write(json.dumps({"op": op, "path": path, "pid": tgid, "comm": comm}) + "\n")

    def open(self, path, flags):
        if flags & _WRITING:
            self._note("open", path)
        return os.open(self._real(path), flags)

    def create(self, path, mode, fi=None):
        self._note("create", path)
        return os.open(self._real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def write(self, path, data, offset, fh):
        self._note("write", path)
        if self.stall_writes and self.stall_writes in path:
            with self._mutex:
                first = path not in self._said_stalling
                self._said_stalling.add(path)
            if first:
                print(f"flaky_fs: stalling writes of {path}", file=sys.stderr, flush=True)
            while not os.path.exists(self.release_path) and not self._unmounted.is_set():
                self._unmounted.wait(0.05)
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        self._note("truncate", path)
        with open(self._real(path), "r+b") as f:
            f.truncate(length)

    def fsync(self, path, datasync, fh):
        os.fsync(fh)
        return 0

    def mkdir(self, path, mode):
        return os.mkdir(self._real(path), mode)

    def rmdir(self, path):
        return os.rmdir(self._real(path))

    def unlink(self, path):
        return os.unlink(self._real(path))

    def rename(self, old, new):
        self._note("rename", new)
        return os.rename(self._real(old), self._real(new))

    def chmod(self, path, mode):
        return os.chmod(self._real(path), mode)

    def chown(self, path, uid, gid):
        return os.chown(self._real(path), uid, gid)

    def utimens(self, path, times=None):
        return os.utime(self._real(path), times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("--match", default="", help="fail reads of files whose name contains this")
    parser.add_argument("--fail-reads", type=int, default=0, help="how many reads fail; < 0: all")
    parser.add_argument("--stall", action="store_true", help="reads never answer")
    parser.add_argument("--writable", action="store_true")
    parser.add_argument("--stall-writes", default=None, help="hold writes of files whose path contains this")
    parser.add_argument("--release", default=None, help="until this file exists")
    parser.add_argument("--record-writers", default=None, help="JSON lines of who created and wrote what")
    args = parser.parse_args()
    if args.stall_writes and not args.release:
        parser.error("--stall-writes needs --release FILE")
    if args.writable:
        operations = WritablePassthrough(args.source, args.match, args.fail_reads, args.stall,
                                         args.stall_writes, args.release, args.record_writers)
    else:
        operations = FlakyPassthrough(args.source, args.match, args.fail_reads, args.stall)
    # direct_io: every read() and write() of a test reaches us (no page cache hiding a retry from the fault).
    FUSE(operations, args.mountpoint, foreground=True, ro=not args.writable, direct_io=True)


if __name__ == "__main__":
    main()
