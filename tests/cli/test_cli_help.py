"""What --help and a mistyped command line look like: every option explained, values named plainly,
usage errors in the same one-line form as run errors."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from chunkgen.cli import app
from tests.helpers import PROMPTS

runner = CliRunner()


def _commands(group, prefix=()):
    """Every command of the app, so a new one cannot skip these checks."""
    import typer.main

    click_group = typer.main.get_command(group)
    for name, cmd in click_group.commands.items():
        if hasattr(cmd, "commands"):
            yield from ([*prefix, name, sub] for sub in cmd.commands)
        elif cmd.context_settings.get("ignore_unknown_options"):
            PASS_THROUGH.append([*prefix, name])  # its options are another program's
        else:
            yield [*prefix, name]


PASS_THROUGH: list[list[str]] = []
COMMANDS = list(_commands(app))


@pytest.mark.parametrize("command", PASS_THROUGH, ids=" ".join)
def test_a_command_that_passes_its_options_on_shows_that_programs_help(command):
    pytest.importorskip("lm_eval")
    res = runner.invoke(app, [*command, "--help"], terminal_width=240)
    assert res.exit_code == 0, res.output
    assert "--model" in res.output and "--tasks" in res.output, res.output


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_option_has_help_and_a_plain_metavar(command):
    res = runner.invoke(app, [*command, "--help"], terminal_width=240)
    assert res.exit_code == 0, res.output
    assert "<" not in res.output and "list[" not in res.output, res.output  # no <int range>, <list[str]>
    options = res.output.split("Options:", 1)[1]
    for line in options.splitlines():
        m = re.match(r"^  (-\w, )?(--[\w-]+)( [A-Z/\[\],.]+)?(\s{2,}(.*))?$", line)
        if m:
            assert m.group(5), f"{' '.join(command)} {m.group(2)} has no help"


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "-q", "x", "-o", "y", "--max-batch", "0"], "error: --max-batch: must be at least 1 (or auto), not 0"),
        (["run", "-q", "x", "-o", "y", "--temperature", "warm"], "error: --temperature: must be a number, not 'warm'"),
        (
            ["run", "-q", str(PROMPTS / "arithmetic_cot.queries.jsonl"), "-o", "y", "--chunk-size", "17"],
            "error: --chunk-size: must be a multiple of 16",
        ),
        (["run", "-q", "absent.jsonl", "-o", "y"], "error: --queries: absent.jsonl: queries file not found"),
        (
            ["run", "-q", "x", "-o", "y", "--output-order", "sorted"],
            "error: --output-order: must be completion or input, not 'sorted'",
        ),
        (["run", "-o", "y"], "error: missing option '--queries'"),
        (["run", "-q", "x", "-o", "y", "--bogus"], "error: no such option: --bogus"),
        (["bench", "e2e", "--n-queries", "many"], "error: --n-queries: must be an integer, not 'many'"),
        (["nope"], "error: no such command 'nope'"),
    ],
)
def test_usage_errors_are_one_line_like_run_errors(args, message):
    res = runner.invoke(app, args)
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), res.output
    assert lines[0].endswith("--help)")  # where the options are listed


def test_a_run_error_has_the_same_form(tmp_path):
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"id": "a", "question": "q"}\n')
    res = runner.invoke(app, ["run", "-q", str(queries), "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 1 and res.output.startswith("error: ") and "--template" in res.output
