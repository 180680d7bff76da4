"""A read-only FUSE passthrough of a directory whose reads fail with a real EIO: the first N read() calls
on files whose path (from the mount's root, e.g. /iter_0000004/__1_0.distcp) contains MATCH fail, later ones succeed (a transient fault: a flaky network
filesystem, a storage server failing over); with N < 0 every such read fails (a persistent one).

    python tests/flaky_fs.py SOURCE MOUNTPOINT --match __1_0.distcp --fail-reads 2

With --stall, such reads never answer (a hung storage server): the reading thread waits in the kernel
until the file system is unmounted.

Runs in the foreground until unmounted (`umount MOUNTPOINT`) or killed. Needs /dev/fuse, libfuse2 and
fusepy (the tests skip without them). Each failure is one line on stderr, so a test can count them."""

from __future__ import annotations

import argparse
import ctypes.util
import errno
import os
import shutil
import subprocess
import sys
import threading

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
    from fuse import FUSE, FuseOSError, Operations  # fusepy
except (ImportError, OSError):  # the tests ask unavailable() first
    Operations = object


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
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND):
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("--match", required=True, help="fail reads of files whose name contains this")
    parser.add_argument("--fail-reads", type=int, default=0, help="how many reads fail; < 0: all")
    parser.add_argument("--stall", action="store_true", help="reads never answer")
    args = parser.parse_args()
    # direct_io: every read() of a test reaches us (no page cache hiding a retry from the fault).
    FUSE(FlakyPassthrough(args.source, args.match, args.fail_reads, args.stall), args.mountpoint,
         foreground=True, ro=True, direct_io=True)


if __name__ == "__main__":
    main()
