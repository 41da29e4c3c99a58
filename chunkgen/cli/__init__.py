"""The command line: one module per command (run, inspect_tree, bench, bench_e2e) on one frame
(boundary.py: the typer app, exit codes, every error in one line). Importing the package registers
every command on `app`."""

# Each module registers its commands on import, in the order `chunkgen --help` lists them.
from chunkgen.cli import run  # noqa: F401  # isort: skip
from chunkgen.cli import inspect_tree  # noqa: F401  # isort: skip
from chunkgen.cli import bench, bench_e2e, bench_score  # noqa: F401  # isort: skip
from chunkgen.cli import evaluate  # noqa: F401  # isort: skip
from chunkgen.cli.boundary import EXIT_BAD_INPUT_LINES, EXIT_ERROR, app
from chunkgen.cli.option_types import SAMPLING_OPTIONS

__all__ = ["EXIT_BAD_INPUT_LINES", "EXIT_ERROR", "SAMPLING_OPTIONS", "app", "main"]


def main() -> None:  # pragma: no cover
    app()
