"""One writer per output file: an advisory lock (flock) on the output file itself, held for the whole run.

The lock belongs to the file (its inode), not to the name it was reached by: a symlink, a hard link
or `dir/../out.jsonl` all meet the same lock, and there is no sidecar that could be deleted from under
a run. The lock is the kernel's, so it dies with its process: a run killed with SIGKILL never blocks
the next one. When the writer replaces the file (the end-of-run rewrite), it locks the new file before
renaming it into place, so the name is never unguarded; a run that locked a file just replaced sees
that the name now points elsewhere and tries again.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path


class OutputLocked(RuntimeError):
    pass


def holder_pid(st: os.stat_result) -> int | None:
    """The PID holding a flock on this file, from /proc/locks (Linux; None where unknown)."""
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want and parts[4].isdigit():
                    return int(parts[4])
    except OSError:
        pass
    return None


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def lock_copy(fd: int) -> None:
    """Lock a new file (a rewrite's copy, created by this process) before it replaces the locked
    one, so the lock never lapses: another run opening the new name finds it taken."""
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


class OutputLock:
    """An open descriptor of the output file (read-write, appending) with an exclusive flock on it."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = Path(os.path.realpath(out))  # the file the name leads to (symlinks resolved)
        self.fd: int | None = None
        self.created = False  # this lock created the (empty) file

    def acquire(self) -> OutputLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                created = True
            except FileExistsError:
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue  # removed in between: create it
                created = False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                st = os.fstat(fd)
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                pid = holder_pid(st)
                who = f" (PID {pid})" if pid is not None else ""
                raise OutputLocked(
                    f"{self.out} is being written by another chunkgen run{who}; wait for it to end, "
                    "then continue with --resume (or choose another --out)"
                ) from None
            # The holder before us may have replaced or removed the file after we opened it: then our
            # lock is on a file nobody else will see, so lock the one the name leads to now.
            try:
                current = same_file(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                current = False
            if current:
                self.fd, self.created = fd, created
                return self
            os.close(fd)

    def adopt(self, fd: int) -> None:
        """Hold the lock through `fd` (already flocked: the file about to replace the locked one)."""
        old, self.fd = self.fd, fd
        if old is not None:
            os.close(old)

    def still_named(self) -> bool:
        """True while the output's name still leads to the locked file (not deleted, moved or replaced)."""
        try:
            return self.fd is not None and same_file(os.fstat(self.fd), os.stat(self.path))
        except OSError:
            return False

    def release(self) -> None:
        if self.fd is None:
            return
        os.close(self.fd)  # closing drops the lock
        self.fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
