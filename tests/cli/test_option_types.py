"""One declaration per concept: every SamplingParams field is reachable from the command line, a
template and an OpenAI batch row, and every engine option has one default in every command."""

from __future__ import annotations

import dataclasses
import json

import pytest
import typer

from chunkgen.cli import SAMPLING_OPTIONS, app
from chunkgen.cli.option_types import ENGINE_DEFAULTS
from chunkgen.engine.params import SAMPLING_FIELDS, SamplingParams
from chunkgen.jobs.requests import OPENAI_RENAMES, openai_jobs, template_jobs
from chunkgen.jobs.templates import load_template

# A value other than the default for each field, as a row (and a template) writes it.
VALUES = {
    "max_new_tokens": 3,
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 4,
    "seed": 7,
    "stop": ["x"],
    "stop_token_ids": [5],
    "ignore_eos": True,
    "n": 2,
    "logprobs": 2,
    "prompt_logprobs": 2,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "json_schema": {"type": "string"},
    "regex": "a+",
    "grammar": 'start: "a"',
}
NAMES = [f.name for f in SAMPLING_FIELDS]


def _commands(group, prefix: str = ""):
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group (typer may ship its own click)
            yield from _commands(command, f"{prefix}{name} ")
        else:
            yield prefix + name, command


COMMANDS = dict(_commands(typer.main.get_command(app)))


def _field_value(name: str):
    return SamplingParams(**{name: VALUES[name]}).as_dict()[name]


def test_every_field_has_a_value_here():
    assert set(VALUES) == set(NAMES)  # a new field needs a value above, nothing else


@pytest.mark.parametrize("name", NAMES)
def test_field_reachable_from_the_command_line(name):
    options = {o for p in COMMANDS["run"].params for o in p.opts}
    assert SAMPLING_OPTIONS[name] in options
    from chunkgen.cli.options import sampling_defaults

    assert SamplingParams(**sampling_defaults({name: VALUES[name]})).as_dict()[name] == _field_value(name)


@pytest.mark.parametrize("name", NAMES)
def test_field_reachable_from_a_template_and_a_row(name, tmp_path):
    value = VALUES[name]
    table = "output" if name in ("json_schema", "regex", "grammar") else "sampling"
    toml = json.dumps(value) if not isinstance(value, dict) else '{ type = "string" }'
    path = tmp_path / "t.toml"
    path.write_text(f'user = "{{q}}"\n[{table}]\n{name} = {toml}\n')
    template = load_template(path)
    (from_template,) = template_jobs([(1, {"q": "hi"})], {"t": template}, {})
    (from_row,) = template_jobs([(1, {"q": "hi", name: value})], {"t": load_template(_plain(tmp_path))}, {})
    assert from_template.params.as_dict()[name] == _field_value(name)
    assert from_row.params.as_dict()[name] == _field_value(name)


def _plain(tmp_path):
    path = tmp_path / "plain.toml"
    path.write_text('name = "t"\nuser = "{q}"\n')
    return path


@pytest.mark.parametrize("name", NAMES)
def test_field_reachable_from_an_openai_row(name):
    renamed = {field: key for key, field in OPENAI_RENAMES.items()}
    key = renamed.get(name, name)
    body = {"messages": [{"role": "user", "content": "hi"}], key: VALUES[name]}
    if name == "logprobs":
        body["logprobs"] = True
    if name == "json_schema":
        body[key] = {"type": "json_schema", "json_schema": {"name": "s", "schema": VALUES[name]}}
    (job,) = openai_jobs([(1, {"custom_id": "a", "body": body})], {})
    assert job.params.as_dict()[name] == _field_value(name), getattr(job, "message", job)


def test_every_engine_option_has_one_default_across_commands():
    seen = {}
    for command_name, command in COMMANDS.items():
        for param in command.params:
            for opt in param.opts:
                if opt in ENGINE_DEFAULTS:
                    seen[(command_name, opt)] = param.default
                    assert param.default == ENGINE_DEFAULTS[opt], f"{command_name} {opt}: {param.default!r}"
    assert {opt for _, opt in seen} == set(ENGINE_DEFAULTS)  # each is used somewhere
    assert len(seen) >= 12


# Options that several commands take with a default of their own on purpose: each bench describes
# its own workload (run's --max-new-tokens is the template's, else SamplingParams').
WORKLOAD_SHAPE = {"--max-new-tokens", "--n-shared", "--questions", "--rows"}
# run takes a GGUF's weights as shipped (auto); the benches compare engines on the same token ids,
# in floats unless asked (docs/quantized.md).
FLOAT_BENCHES = {"--quantize"}


def test_an_option_of_several_commands_has_one_default_everywhere():
    """Over every option of every command, not only the engine's: one name, one default (a command
    that means another thing takes another name: --kv-dtype, --weights-seed, --data-seed)."""
    defaults: dict[str, dict[str, object]] = {}
    for command_name, command in COMMANDS.items():
        for param in command.params:
            for opt in param.opts:
                if opt.startswith("--"):
                    defaults.setdefault(opt, {})[command_name] = param.default
    differing = {opt: by for opt, by in defaults.items() if len({repr(d) for d in by.values()}) > 1}
    assert set(differing) == WORKLOAD_SHAPE | FLOAT_BENCHES, differing
    assert {by["run"] for opt, by in differing.items() if opt in FLOAT_BENCHES} == {"auto"}
    assert {d for opt in FLOAT_BENCHES for c, d in defaults[opt].items() if c != "run"} == {"none"}
    assert sum(len(by) > 1 for by in defaults.values()) >= 10  # the check covers shared options


def test_sampling_params_fields_declare_their_command_line():
    for f in dataclasses.fields(SamplingParams):
        assert f.metadata["help"] and f.metadata["metavar"]
