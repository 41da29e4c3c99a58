"""One writer per output file: an advisory lock on a sidecar `OUT.lock`, held for the whole run.

The lock is the kernel's (flock), so it dies with its process: a run killed with SIGKILL never
blocks the next one, and a sidecar left on disk is not an error. The sidecar holds the holder's PID
and host so a refused run can say who has the file.
"""
from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path


class OutputLocked(RuntimeError):
    pass


class OutputLock:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = out.with_name(out.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> "OutputLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
                os.close(fd)
                who = f" (PID {holder.split()[0]} on {holder.split()[1]})" if len(holder.split()) == 2 else ""
                raise OutputLocked(
                    f"{self.out} is being written by another chunkgen run{who}; wait for it to end, "
                    "then continue with --resume (or choose another --out)"
                ) from None
            # The holder before us may have removed the sidecar after we opened it: then our lock is on
            # a file nobody else will see, so take the lock again on the current one.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()
        except OSError:
            pass  # a sidecar left behind is harmless: the lock, not the file, is what excludes
        os.close(self._fd)  # closing drops the lock
        self._fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
