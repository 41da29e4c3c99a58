"""One rule for every sampling option and constraint, checked through the command line: a row's own
value wins, then the command line's, then the template's, then chunkgen's defaults."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chunkgen.cli import SAMPLING_OPTIONS, app
from chunkgen.engine.params import SamplingParams
from tests.helpers import base_args

runner = CliRunner()

# option: (template's value, command line's value, row's value); all differ from the default.
VALUES = {
    "max_new_tokens": (4, 3, 2),
    "temperature": (0.5, 0.7, 0.9),
    "top_p": (0.5, 0.7, 0.9),
    "top_k": (5, 7, 9),
    "seed": (5, 7, 9),
    "stop": (["tpl"], ["cli"], ["row"]),
    "stop_token_ids": ([5], [6], [7]),
    "ignore_eos": (True, True, False),  # one value differs from the default: the row's says no
    "n": (2, 3, 4),
    "logprobs": (1, 2, 3),
    "prompt_logprobs": (1, 2, 3),
    "presence_penalty": (0.5, 0.75, 1.0),
    "frequency_penalty": (0.5, 0.75, 1.0),
    "json_schema": ({"type": "string"}, {"type": "integer"}, {"type": "boolean"}),
    "regex": ("a+", "b+", "c+"),
    "grammar": ('start: "a"', 'start: "b"', 'start: "c"'),
}
CONSTRAINTS = ("json_schema", "regex", "grammar")


def _toml(value) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def _template(tmp_path: Path, option: str | None, value=None) -> Path:
    lines = ['name = "p"', 'system = "You answer."', 'user = "{question}"']
    if option in CONSTRAINTS:
        lines += ["[output]", f"{option} = {_toml(value)}"]
    elif option is not None:
        lines += ["[sampling]", f"{option} = {_toml(value)}"]
    path = tmp_path / "p.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _cli_args(tmp_path: Path, option: str, value) -> list[str]:
    flag = SAMPLING_OPTIONS[option]
    if isinstance(value, list):
        return [a for v in value for a in (flag, str(v))]
    if isinstance(value, bool):
        return [flag]
    if option in ("json_schema", "grammar"):
        path = tmp_path / f"cli.{option}"
        path.write_text(json.dumps(value) if option == "json_schema" else value)
        return [flag, str(path)]
    return [flag, str(value)]


def _expected(option: str, value):
    """The value as a record's `sampling` field shows it."""
    if option in CONSTRAINTS:
        text = SamplingParams(**{option: value}).as_dict()[option]
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return value


def _run(tiny_model, tmp_path: Path, template: Path, row_value, option: str, extra: list[str]) -> dict[str, dict]:
    queries = tmp_path / "q.jsonl"
    own = {"id": "own", "question": "hello", option: row_value}
    queries.write_text(json.dumps(own) + "\n" + json.dumps({"id": "plain", "question": "hello"}) + "\n")
    out = tmp_path / "out.jsonl"
    out.unlink(missing_ok=True)
    if option != "max_new_tokens" and "--max-new-tokens" not in extra:
        extra = [*extra, "--max-new-tokens", "2"]  # short runs; its own precedence is tested on its own
    argv = base_args(tiny_model, out, queries, template, max_new_tokens=None, dtype=None)
    res = runner.invoke(app, [*argv, *extra], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    return {rid: r["sampling"] for rid, r in recs.items()}


@pytest.mark.parametrize("option", list(VALUES))
def test_row_then_command_line_then_template_then_default(option, tiny_model, tmp_path):
    assert set(VALUES) == set(SAMPLING_OPTIONS)  # every option the command line has is covered
    tpl_value, cli_value, row_value = VALUES[option]
    template = _template(tmp_path, option, tpl_value)
    # the template and the command line both set it: a row's own value wins, the others take the command line's
    got = _run(tiny_model, tmp_path, template, row_value, option, _cli_args(tmp_path, option, cli_value))
    assert got["own"][option] == _expected(option, row_value)
    assert got["plain"][option] == _expected(option, cli_value)
    # only the template sets it
    got = _run(tiny_model, tmp_path, template, row_value, option, [])
    assert got["own"][option] == _expected(option, row_value)
    assert got["plain"][option] == _expected(option, tpl_value)
    # nobody but the row sets it: chunkgen's default
    got = _run(tiny_model, tmp_path, _template(tmp_path, None), row_value, option, [])
    assert got["own"][option] == _expected(option, row_value)
    default = SamplingParams().as_dict().get(option)
    assert got["plain"].get(option) == (list(default) if isinstance(default, tuple) else default)


def test_a_constraint_of_another_kind_replaces_the_lower_layers_one(tiny_model, tmp_path):
    """The constraint is one setting whatever its kind: a command-line regex replaces a template's
    JSON schema (no clash), and a row's grammar replaces both."""
    template = _template(tmp_path, "json_schema", {"type": "string"})
    got = _run(tiny_model, tmp_path, template, 'start: "c"', "grammar", ["--regex", "b+"])
    assert set(got["own"]) & set(CONSTRAINTS) == {"grammar"}
    assert set(got["plain"]) & set(CONSTRAINTS) == {"regex"}
    assert got["plain"]["regex"] == _expected("regex", "b+")


def test_openai_rows_body_then_command_line_then_default(tiny_model, tmp_path):
    queries = tmp_path / "batch.jsonl"
    body = {"messages": [{"role": "user", "content": "hello"}]}
    queries.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {
                    "custom_id": "own",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {**body, "max_tokens": 2, "temperature": 0.9, "response_format": {"type": "json_object"}},
                },
                {"custom_id": "plain", "method": "POST", "url": "/v1/chat/completions", "body": body},
            ]
        )
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    argv = base_args(
        tiny_model, out, queries, None, max_new_tokens=3, dtype=None, regex="b+", temperature=0.7, format="openai"
    )
    res = runner.invoke(app, argv, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    recs = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["own"]["response"]["body"]["usage"]["completion_tokens"] <= 2
    assert (
        recs["plain"]["response"]["body"]["usage"]["completion_tokens"] == 3
        or recs["plain"]["response"]["body"]["choices"][0]["finish_reason"] == "stop"
    )


def test_help_states_the_rule_once():
    res = runner.invoke(app, ["run", "--help"], terminal_width=200)
    text = " ".join(res.output.split())
    assert text.count("a row's own value wins, then the command line's, then the template's") == 1
    assert "for rows and templates that" not in text  # the old, wrong wording
