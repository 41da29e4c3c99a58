"""The `chunkgen` command's entry point: an interrupt while the command line's modules are still
being imported (torch takes seconds) ends in one line, as it does once the command runs, and one
that comes while the process exits changes nothing."""

from __future__ import annotations

import signal
import sys


def main() -> None:
    try:
        from chunkgen import cli
    except KeyboardInterrupt:
        sys.stderr.write("interrupted (SIGINT) while starting; nothing was done\n")
        sys.exit(130)
    cli.boundary._PROCESS_EXITS_AFTER = True
    try:
        cli.app(prog_name="chunkgen")
    finally:
        # The command is over and its exit code decided. Python puts the default handlers back
        # while it shuts down (torch's teardown takes a moment), so a signal then would kill the
        # process by that signal instead of its exit code: ignored from here.
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
