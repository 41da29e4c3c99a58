"""The `chunkgen` command's entry point: an interrupt while the command line's modules are still
being imported (torch takes seconds) ends in one line, as it does once the command runs."""
from __future__ import annotations

import sys


def main() -> None:
    try:
        from chunkgen.cli import app
    except KeyboardInterrupt:
        sys.stderr.write("interrupted (SIGINT) while starting; nothing was done\n")
        sys.exit(130)
    app(prog_name="chunkgen")
