"""The processes of a local Ray cluster die with the driver that started them.

`ray.init()` without an address starts the cluster's processes as the driver's children; when the
driver is killed (SIGKILL, OOM), Ray's own clean-up never runs, and some of them (the dashboard and
runtime-env agents) live on. A small watcher process, started next to the driver, keeps the list of
the driver's descendants while it lives and, when the pipe from the driver closes (the driver's end,
however it came), stops every one of them still running.

Run as `python -m chunkgen.scale.reaper DRIVER_PID`, with a pipe from the driver as standard input.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import psutil

REFRESH_S = 1.0  # how often the list of the driver's descendants is read again
GRACE_S = 3.0  # between SIGTERM and SIGKILL


def start_reaper() -> subprocess.Popen:
    """The watcher of this process's descendants; it lives until this process ends. Its own session,
    so a Ctrl-C sent to the terminal's process group does not end it before the driver."""
    return subprocess.Popen(
        [sys.executable, "-m", "chunkgen.scale.reaper", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def _descendants(pid: int, known: dict[int, float]) -> None:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            known.setdefault(child.pid, child.create_time())
        except psutil.Error:
            continue


def _still_ours(known: dict[int, float]) -> list[psutil.Process]:
    alive = []
    for pid, created in known.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.pid != os.getpid():  # not a reused pid
                alive.append(p)
        except psutil.Error:
            continue
    return alive


def reap(driver: int) -> None:
    known: dict[int, float] = {}
    while True:
        _descendants(driver, known)
        ready, _, _ = select.select([sys.stdin], [], [], REFRESH_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # the driver has ended: its end of the pipe is closed
    alive = _still_ours(known)
    for p in alive:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(alive, timeout=GRACE_S)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reap(int(sys.argv[1]))
