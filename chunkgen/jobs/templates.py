"""Prompt templates (TOML): a long shared system prompt plus a user message with {placeholders}."""

from __future__ import annotations

import functools
import json
import string
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chunkgen.bounded import DuplicateKey, NotText, TooLarge, read_text, unique_keys
from chunkgen.engine.params import KINDS, SAMPLING_NAMES, ParamError, SamplingParams


class TemplateError(ValueError):
    """A template cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class Template:
    name: str
    path: Path
    system: str
    user: str
    fields: tuple[str, ...]  # placeholders of `user`, in order of first appearance
    sampling: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    output: dict[str, Any] = field(default_factory=dict)  # [output]: one constraint (json_schema as loaded)
    # Answers to score instead of generating (each one's logprob after the prompt; the likeliest is
    # the answer); a row's own `choices` list replaces them.
    choices: tuple[str, ...] = ()

    @classmethod
    def from_file(cls, path: str | Path) -> Template:
        """A template file read as `chunkgen run --template` reads it (the same checks, the system
        prompt stripped as the command line strips it), so the Python API builds the same prompts:
        `llm.generate([t.messages(row) for row in rows], t.params())`."""
        return load_template(path)

    def params(self, **overrides: Any) -> SamplingParams:
        """The template's [sampling] and [output] as SamplingParams, with `overrides` on top."""
        return SamplingParams(**{**self.sampling, **self.output, **overrides})

    def messages(self, values: dict[str, str]) -> list[dict[str, str]]:
        """Chat messages for one query. Values are inserted as plain text: braces inside them are
        never expanded, because only the template string is parsed."""
        user = self.user.format_map({k: values[k] for k in self.fields})
        msgs = [{"role": "user", "content": user}]
        if self.system:
            msgs.insert(0, {"role": "system", "content": self.system})
        return msgs

    @functools.cached_property
    def layout(self) -> tuple[tuple[str | int, ...], ...]:
        """Where `messages` puts a row's values: per message, literal text or a value's index in
        `fields` (the order of a row's `data`); control strings are judged against it."""
        parts: list[str | int] = []
        for literal, name, _, _ in string.Formatter().parse(self.user):
            if literal:
                parts.append(literal)
            if name is not None:
                parts.append(self.fields.index(name))
        user = tuple(parts)
        return ((self.system,), user) if self.system else (user,)


def _placeholders(text: str, path: Path) -> tuple[str, ...]:
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise TemplateError(f"{path}: field 'user': {exc} (write literal braces as {{{{ and }}}})") from None
    for _, name, spec, conv in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conv:
            raise TemplateError(
                f"{path}: field 'user': placeholder {{{name}{'!' + conv if conv else ''}"
                f"{':' + spec if spec else ''}}} must be a plain name like {{question}}"
            )
        if name not in names:
            names.append(name)
    return tuple(names)


SAMPLING_KEYS = set(SAMPLING_NAMES) - set(KINDS)  # constraints go in [output]
TOP_LEVEL_KEYS = {"name", "description", "system", "user", "sampling", "output", "choices"}


def check_choices(value: Any) -> tuple[str, ...]:
    """A list of distinct non-empty strings (raises ValueError saying what is wrong)."""
    if not isinstance(value, list):
        raise ValueError(f"must be a list of strings, got {_kind(value)}")
    if not value:
        raise ValueError("must list at least one answer")
    for i, c in enumerate(value):
        if not isinstance(c, str) or not c:
            raise ValueError(f"item {i} must be a non-empty string, got {_kind(c) if c != '' else 'an empty one'}")
    if len(set(value)) < len(value):
        dup = next(c for i, c in enumerate(value) if c in value[:i])
        raise ValueError(f"{dup[:80]!r} is given twice")
    return tuple(value)


def _kind(v: Any) -> str:
    return {dict: "a table", list: "a list", bool: "a boolean"}.get(type(v), type(v).__name__)


def _output(data: Any, path: Path) -> dict[str, Any]:
    """The [output] table: exactly one of json_schema (an inline table, or a .json file relative to
    the template), regex, grammar (Lark text); compiled now, so a bad one stops the run before the
    model loads."""
    if not isinstance(data, dict):
        raise TemplateError(f"{path}: [output] must be a table")
    unknown = set(data) - set(KINDS)
    if unknown:
        raise TemplateError(f"{path}: [output] has unknown keys {sorted(unknown)[:5]}; allowed: {list(KINDS)}")
    if len(data) != 1:
        raise TemplateError(f"{path}: [output] takes exactly one of {list(KINDS)}, got {sorted(data) or 'none'}")
    ((key, value),) = data.items()
    if key == "json_schema" and isinstance(value, str):  # a file next to the template
        schema_path = path.parent / value
        try:
            value = json.loads(read_text(schema_path, what="JSON schema"), object_pairs_hook=unique_keys)
        except OSError as exc:
            raise TemplateError(
                f"{path}: [output] json_schema: cannot read {schema_path} ({exc.strerror or exc})"
            ) from None
        except (TooLarge, NotText, DuplicateKey) as exc:
            raise TemplateError(f"{path}: [output] json_schema: {schema_path}: {exc}") from None
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
            raise TemplateError(f"{path}: [output] json_schema: {schema_path} is not valid JSON: {exc}") from None
    try:
        SamplingParams(**{key: value})
    except ParamError as exc:
        raise TemplateError(f"{path}: [output] {key}: {exc.message}") from None
    return {key: value}


def load_template(path: str | Path) -> Template:
    path = Path(path)
    try:
        data = tomllib.loads(read_text(path, what="template"))
    except (TooLarge, NotText) as exc:
        raise TemplateError(str(exc)) from None
    except FileNotFoundError:
        raise TemplateError(f"{path}: template file not found") from None
    except IsADirectoryError:
        raise TemplateError(f"{path}: is a directory with no *.toml templates") from None
    except OSError as exc:
        raise TemplateError(f"{path}: cannot read the template ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise TemplateError(f"{path}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise TemplateError(f"{path}: not valid TOML: {exc}") from None
    unknown = set(data) - TOP_LEVEL_KEYS
    if unknown:
        raise TemplateError(f"{path}: unknown keys {sorted(unknown)[:5]}; allowed: {sorted(TOP_LEVEL_KEYS)}")
    for key in ("name", "description", "system", "user"):
        if key in data and not isinstance(data[key], str):
            raise TemplateError(f"{path}: field '{key}' must be a string, got {type(data[key]).__name__}")
    if "user" not in data:
        raise TemplateError(f"{path}: missing field 'user' (the per-query message, with {{placeholders}})")
    sampling = data.get("sampling", {})
    if not isinstance(sampling, dict):
        raise TemplateError(f"{path}: [sampling] must be a table")
    unknown = set(sampling) - SAMPLING_KEYS
    if unknown:
        raise TemplateError(
            f"{path}: [sampling] has unknown keys {sorted(unknown)[:5]}; allowed: {sorted(SAMPLING_KEYS)}"
        )
    try:  # types and ranges now, not after the model has loaded
        SamplingParams(**sampling)
    except ParamError as exc:
        raise TemplateError(f"{path}: [sampling] {exc.field}: {exc.message}") from None
    output = _output(data["output"], path) if "output" in data else {}
    choices: tuple[str, ...] = ()
    if "choices" in data:
        try:
            choices = check_choices(data["choices"])
        except ValueError as exc:
            raise TemplateError(f"{path}: field 'choices' {exc}") from None
        if output:
            raise TemplateError(f"{path}: 'choices' scores fixed answers, [output] constrains generated ones; give one")
        if "choices" in _placeholders(data["user"], path):
            raise TemplateError(
                f"{path}: 'choices' is both a field and a placeholder {{choices}} of 'user'; rename one"
            )
    name = data.get("name", path.stem)
    if not name.strip():
        raise TemplateError(f"{path}: field 'name' must not be empty")
    return Template(
        name=name,
        path=path,
        system=data.get("system", "").strip(),
        user=data["user"],
        fields=_placeholders(data["user"], path),
        sampling=dict(sampling),
        description=data.get("description", ""),
        output=output,
        choices=choices,
    )


def load_templates(path: str | Path) -> dict[str, Template]:
    """One template file, or every *.toml in a directory, keyed by template name."""
    path = Path(path)
    files = sorted(path.glob("*.toml")) if path.is_dir() else [path]
    if not files:
        raise TemplateError(f"{path}: no *.toml templates in this directory")
    templates: dict[str, Template] = {}
    for f in files:
        t = load_template(f)
        if t.name in templates:
            raise TemplateError(f"{f}: template name {t.name!r} is already used by {templates[t.name].path}")
        templates[t.name] = t
    return templates
