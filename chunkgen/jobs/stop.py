"""Stopping a job between steps: the first SIGINT / SIGTERM asks the run to take no new rows and
to stop once the rows in flight have finished or a grace period is over, whichever comes first
(every answer so far written, the run resumable); a second stops at once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

# The exit code of a run stopped by a signal (resumable): the shell's 128 + the signal's number.
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}

# How long the rows in flight may run on after the first signal. A row stopped short is answered
# again from its start by --resume, so the decode steps it already took are lost; most rows in
# flight are a few seconds from their answer (SIGTERM's senders wait longer: Kubernetes 30 s,
# systemd 90 s, Slurm's KillWait 30 s).
DEFAULT_STOP_GRACE_S = 10.0


class Interrupted(BaseException):
    """A signal during a phase with nothing to finish (the model load): the run ends at once. A
    BaseException, so that no library's `except Exception` around its own work swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopFlag:
    """SIGINT / SIGTERM ask the run to stop: true from then on (`__call__`: take no new rows), and
    `overdue` once grace_s has passed since (stop stepping: the rows in flight are given up, to be
    answered again by --resume). A second signal stops at once.

    Stopping at once raises KeyboardInterrupt in the main thread, so the writer closes without the
    final rewrite. Raised wherever the main thread happens to be, it can land in a generator's cleanup
    or a finaliser (a weakref callback) and be swallowed; so the second signal also arms a timer
    that, unless the run has stopped by then (`settle`), exits the process, and such a swallowed
    KeyboardInterrupt is not printed as "Exception ignored ... Traceback" (sys.unraisablehook, while
    the flag is armed). Nothing is lost by that exit: every record was written whole by one system
    call, the lock goes with the process, and a rewrite's copy left behind is removed by the next
    --resume."""

    GRACE_S = 3.0

    def __init__(self, out: Path | None = None, grace_s: float = DEFAULT_STOP_GRACE_S, announce: str = "none") -> None:
        """announce: how the first signal is told on stderr: "line", "json" (a `stopping` event,
        as --json-log writes its events) or "none"."""
        self.signum: int | None = None
        self.grace_s = grace_s
        self._asked_at = 0.0
        self._announce = announce
        self._out = out
        self._timer: threading.Timer | None = None
        self._at_once = False
        self._old = {s: signal.signal(s, self._handle) for s in EXIT_SIGNAL}
        self._old_unraisable = sys.unraisablehook
        sys.unraisablehook = self._unraisable

    def _unraisable(self, unraisable) -> None:
        # our own second signal, raised inside a finaliser: the timer stops the run, nothing to print
        if self.signum is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            return
        self._old_unraisable(unraisable)

    @contextlib.contextmanager
    def at_once(self):
        """While the block runs (the model load: no answer to finish, nothing to keep), a signal
        raises Interrupted at once instead of waiting for a step to end."""
        self._at_once = True
        try:
            yield
        finally:
            self._at_once = False

    def _handle(self, signum, frame) -> None:
        if self._at_once and self.signum is None:
            self.signum = signum
            raise Interrupted(signum)
        if self.signum is None:
            self.signum = signum
            self._asked_at = time.monotonic()
            name = signal.Signals(signum).name
            if self._announce == "json":
                event = {"event": "stopping", "signal": name, "grace_s": self.grace_s}
                os.write(2, (json.dumps(event) + "\n").encode())
            elif self._announce == "line" and self.grace_s > 0:
                os.write(
                    2,
                    f"\n{name}: taking no new rows; the rows in flight finish within {self.grace_s:g} s, "
                    "then the run stops (a second signal stops it at once)\n".encode(),
                )
            return
        if self._timer is None:
            self._timer = threading.Timer(self.GRACE_S, self._exit_now)
            self._timer.daemon = True
            self._timer.start()
        raise KeyboardInterrupt

    def _exit_now(self) -> None:
        where = f" to {self._out}" if self._out is not None else ""
        message = (
            f"stopped at once by a second signal: every record written{where} is whole; run the "
            "same command with --resume to continue\n"
        )
        try:
            os.write(2, message.encode())
        finally:
            os._exit(EXIT_SIGNAL[self.signum or signal.SIGINT])

    def settle(self) -> None:
        """The run has stopped: no exit from the timer."""
        if self._timer is not None:
            self._timer.cancel()

    def __call__(self) -> bool:
        return self.signum is not None

    def overdue(self) -> bool:
        """Asked to stop grace_s ago or more: no more steps, even for the rows in flight."""
        return self.signum is not None and time.monotonic() - self._asked_at >= self.grace_s

    def restore(self) -> None:
        """The run is over: a signal from now on (while the summary prints, while the process exits)
        has nothing left to stop; it is noted, never raised. The boundary puts the handlers that were
        there before back when the command returns (in a process that goes on, e.g. a test's)."""
        self.settle()
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._old_unraisable
        for s in self._old:
            signal.signal(s, self._late)

    def _late(self, signum, frame) -> None:
        self.signum = self.signum or signum
