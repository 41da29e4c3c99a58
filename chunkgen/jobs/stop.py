"""Stopping a job between steps: the first SIGINT / SIGTERM asks the run to stop once the current
step is over (every answer so far written, the run resumable); a second stops at once."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

# The exit code of a run stopped by a signal (resumable): the shell's 128 + the signal's number.
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(BaseException):
    """A signal during a phase with nothing to finish (the model load): the run ends at once. A
    BaseException, so that no library's `except Exception` around its own work swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopFlag:
    """SIGINT / SIGTERM ask the run to stop after the current step; a second one stops at once.

    Stopping at once raises KeyboardInterrupt in the main thread, so the writer closes without the
    final rewrite. Raised wherever the main thread happens to be, it can land in a generator's cleanup
    or a finaliser (a weakref callback) and be swallowed; so the second signal also arms a timer
    that, unless the run has stopped by then (`settle`), exits the process, and such a swallowed
    KeyboardInterrupt is not printed as "Exception ignored ... Traceback" (sys.unraisablehook, while
    the flag is armed). Nothing is lost by that exit: every record was written whole by one system
    call, the lock goes with the process, and a rewrite's copy left behind is removed by the next
    --resume."""

    GRACE_S = 3.0

    def __init__(self, out: Path | None = None) -> None:
        self.signum: int | None = None
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
