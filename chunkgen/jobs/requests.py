"""Query files -> validated jobs or error records, line by line.

Two formats: template rows (JSONL objects with an id and the template's placeholder fields) and
OpenAI Batch API request files (custom_id / method / url / body.messages), detected from the
first object. A bad line becomes an ErrorRecord naming its line, id and field; the rest go on.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from chunkgen.engine.sampler import SamplingParams
from chunkgen.jobs.templates import Template

OPENAI_URL = "/v1/chat/completions"


@dataclass
class Job:
    id: str
    line: int
    messages: list[dict[str, str]]
    params: SamplingParams
    template: str | None = None  # template name, or None for OpenAI batch rows


@dataclass
class ErrorRecord:
    id: str | None
    line: int
    field: str | None
    message: str


class _RowError(Exception):
    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


def _read_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object or _RowError) for each non-blank line; bytes decoded per line so
    one bad line cannot spoil the file."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield number, _RowError(None, f"invalid UTF-8 at byte {exc.start}")
                continue
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                yield number, _RowError(None, f"not valid JSON: {exc.msg} (column {exc.colno})")
                continue
            if not isinstance(obj, dict):
                yield number, _RowError(None, f"expected a JSON object, got {type(obj).__name__}")
                continue
            yield number, obj


def detect_format(path: Path) -> str:
    """'openai' if the first object looks like an OpenAI batch request, else 'template'."""
    for _, obj in _read_lines(path):
        if isinstance(obj, dict):
            return "openai" if "custom_id" in obj and "body" in obj else "template"
    return "template"


def _params(base: dict[str, Any], row: dict[str, Any], names: dict[str, str]) -> SamplingParams:
    """SamplingParams from defaults plus the row's overrides; `names` maps row keys to fields."""
    values = dict(base)
    for key, target in names.items():
        if key not in row or row[key] is None:
            continue
        v = row[key]
        if target == "stop":
            if isinstance(v, str):
                v = [v]
            if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
                raise _RowError(key, "must be a non-empty string or a list of them")
        elif target in ("max_new_tokens", "top_k", "seed", "n"):
            if isinstance(v, bool) or not isinstance(v, int):
                raise _RowError(key, f"must be an integer, got {json.dumps(v)}")
        elif target in ("temperature", "top_p"):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise _RowError(key, f"must be a number, got {json.dumps(v)}")
        values[target] = v
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        bad = next((k for k, t in names.items() if t in str(exc) and k in row), None)
        raise _RowError(bad, str(exc)) from None


TEMPLATE_OVERRIDES = {k: k for k in ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")}
OPENAI_OVERRIDES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                    "temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop", "n": "n"}


def read_template_jobs(
    path: Path, templates: dict[str, Template], defaults: dict[str, Any], id_field: str = "id"
) -> Iterator[Job | ErrorRecord]:
    """Rows of a template query file. With several templates, each row names one in `template`."""
    seen: set[str] = set()
    only = next(iter(templates.values())) if len(templates) == 1 else None
    for number, obj in _read_lines(path):
        if isinstance(obj, _RowError):
            yield ErrorRecord(None, number, obj.field, obj.message)
            continue
        raw_id = obj.get(id_field)
        rid = f"line-{number}" if raw_id is None else raw_id
        try:
            if not isinstance(rid, (str, int)) or isinstance(rid, bool):
                rid = None
                raise _RowError(id_field, "must be a string or an integer")
            rid = str(rid)
            if rid in seen:
                raise _RowError(id_field, f"duplicate id {rid!r}")
            seen.add(rid)
            template = only
            if "template" in obj or template is None:
                name = obj.get("template")
                if name not in templates:
                    raise _RowError("template", f"unknown template {name!r}; known: {sorted(templates)}")
                template = templates[name]
            values: dict[str, str] = {}
            for name in template.fields:
                if name not in obj:
                    raise _RowError(name, f"missing (template {template.name!r} needs {list(template.fields)})")
                v = obj[name]
                if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                    raise _RowError(name, f"must be a string or a number, got {type(v).__name__}")
                values[name] = str(v)
            params = _params({**template.sampling, **defaults}, obj, TEMPLATE_OVERRIDES)
            yield Job(rid, number, template.messages(values), params, template.name)
        except _RowError as err:
            yield ErrorRecord(rid, number, err.field, err.message)


def read_openai_jobs(path: Path, defaults: dict[str, Any]) -> Iterator[Job | ErrorRecord]:
    seen: set[str] = set()
    for number, obj in _read_lines(path):
        if isinstance(obj, _RowError):
            yield ErrorRecord(None, number, obj.field, obj.message)
            continue
        rid = obj.get("custom_id")
        try:
            if not isinstance(rid, str) or not rid:
                rid = None
                raise _RowError("custom_id", "must be a non-empty string")
            if rid in seen:
                raise _RowError("custom_id", f"duplicate custom_id {rid!r}")
            seen.add(rid)
            if obj.get("method", "POST") != "POST":
                raise _RowError("method", "must be POST")
            if obj.get("url", OPENAI_URL) != OPENAI_URL:
                raise _RowError("url", f"only {OPENAI_URL} is supported, got {obj.get('url')!r}")
            body = obj.get("body")
            if not isinstance(body, dict):
                raise _RowError("body", "must be an object")
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _RowError("body.messages", "must be a non-empty list")
            clean = []
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise _RowError(f"body.messages[{i}]", "must be an object with string 'role' and 'content'")
                clean.append({"role": m["role"], "content": m["content"]})
            params = _params(defaults, body, {k: v for k, v in OPENAI_OVERRIDES.items()})
            yield Job(rid, number, clean, params, None)
        except _RowError as err:
            field = err.field if err.field is None or err.field.startswith(("body", "custom_id", "method", "url")) else f"body.{err.field}"
            yield ErrorRecord(rid, number, field, err.message)
