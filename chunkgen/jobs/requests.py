"""Query files -> validated jobs or error records, one line at a time.

Two formats: template rows (JSONL objects with an id and the template's placeholder fields) and
OpenAI Batch API request files (custom_id / method / url / body). Rows are read as a stream, so a
file of any length (or standard input) costs memory for one line at a time. A bad line becomes an
ErrorRecord naming its line, id and field; the rest go on.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from chunkgen.bounded import ROW_BYTES, DuplicateKey, Overlong, encoding_name, lines, unique_keys
from chunkgen.device import human_bytes
from chunkgen.engine.params import KINDS, SAMPLING_NAMES, SCORE_ONLY, ParamError, SamplingParams
from chunkgen.jobs.templates import Template, check_choices

OPENAI_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"  # a plain prompt, scored (echo, logprobs) and/or continued
OPENAI_URLS = (OPENAI_URL, COMPLETIONS_URL)
STDIN = "-"


@dataclass
class Job:
    id: str
    line: int
    messages: list[dict[str, str]]
    params: SamplingParams
    template: str | None = None  # template name, or None for OpenAI batch rows
    data: tuple[str, ...] = ()  # user-supplied text inside `messages`: tokenized as text, never as control tokens
    layout: tuple[tuple[str | int, ...], ...] | None = None  # where `messages` holds `data` (prompt.Layout)
    constraint_field: str | None = None  # what set the constraint (a row's field, "template", an option's kind)
    # For a row without an id: how many earlier id-less rows of the file ask the same request. Its
    # `line-N` id moves when lines are inserted above it; (request, occurrence) does not.
    occurrence: int | None = None
    # A /v1/completions row: its prompt (text, or token ids) instead of messages, and whether the
    # answer repeats the prompt (with its tokens' logprobs when logprobs are asked).
    prompt: str | list[int] | None = None
    echo: bool = False
    # Answers to score after the prompt instead of generating one (a template's or the row's `choices`).
    choices: tuple[str, ...] | None = None

    @property
    def source(self) -> str | list[int] | list[dict[str, str]]:
        """What is tokenized: the prompt of a completions row, else the messages."""
        return self.messages if self.prompt is None else self.prompt

    @functools.cached_property
    def request_hash(self) -> str:
        """What the answer depends on; resume compares it to tell a changed request from an answered
        one: the sha256 of `json.dumps({"messages", "params", "template"}, sort_keys=True,
        ensure_ascii=False)`, assembled from the JSON of its parts, since every row of a template
        repeats the same long system prompt and parameters (see _long_message_json)."""
        if self.prompt is not None:  # a completions row: short enough to hash whole
            text = json.dumps(
                {"prompt": self.prompt, "echo": self.echo, "params": self.params.as_dict(), "template": None},
                sort_keys=True,
                ensure_ascii=False,
            )
            return hashlib.sha256(text.encode()).hexdigest()[:16]
        parts = [_message_json(m) for m in self.messages]
        # The digest of the text up to the first message's end, kept while the next rows repeat it.
        head = _hash_of_head(parts[0]).copy() if parts else hashlib.sha256(b'{"messages": [')
        rest = "".join(", " + p for p in parts[1:])
        # Choices only where a row has them: a generating row's hash is what it always was.
        choices = "" if self.choices is None else f', "choices": {json.dumps(self.choices, ensure_ascii=False)}'
        head.update(
            (
                f'{rest}], "params": {_params_json(self.params)}, '
                f'"template": {json.dumps(self.template, ensure_ascii=False)}{choices}}}'
            ).encode()
        )
        return head.hexdigest()[:16]

    @property
    def key(self) -> str:
        """What an answer is matched to its row by on --resume: the row's own id, or for a row
        without one its request and occurrence (`line-N` is only what the record shows)."""
        if self.occurrence is None:
            return id_key(self.id)
        return row_key(self.request_hash, self.occurrence)


def _message_json(message: dict[str, Any]) -> str:
    if (
        len(message) == 2
        and isinstance(message.get("content"), str)
        and isinstance(message.get("role"), str)
        and len(message["content"]) >= 512
    ):
        return _long_message_json(message["role"], message["content"])
    return json.dumps(message, sort_keys=True, ensure_ascii=False)


@functools.lru_cache(maxsize=64)
def _long_message_json(role: str, content: str) -> str:
    """A long message's JSON (a system prompt shared by many rows), serialised once."""
    return json.dumps({"content": content, "role": role}, ensure_ascii=False)


@functools.lru_cache(maxsize=16)
def _hash_of_head(first_message_json: str) -> hashlib._Hash:
    return hashlib.sha256(('{"messages": [' + first_message_json).encode())


@functools.lru_cache(maxsize=64)
def _params_json(params: SamplingParams) -> str:
    return json.dumps(params.as_dict(), sort_keys=True, ensure_ascii=False)


def row_key(request_hash: str, occurrence: int) -> str:
    """The key of a row without an id: in a namespace of its own, apart from `id_key`'s."""
    return f"request:{request_hash}#{occurrence}"


def id_key(rid: str) -> str:
    """The key of a row with an id: whatever the id spells (even `request:...#0`), it cannot equal
    a generated row_key."""
    return f"id:{rid}"


@dataclass
class ErrorRecord:
    id: str | None
    line: int
    field: str | None
    message: str


# The key under which a CSV row converted to JSON (whole_file.csv_rows) carries its mistake, which
# the row reader makes the row's error record.
CSV_ERROR = "chunkgen:csv_row_error"


class RowError(Exception):
    def __init__(self, field: str | None, message: str, row: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.field, self.message = field, message
        self.row = row  # the parsed row when it is JSON but not usable, to read its id from


class LongInt(str):
    """An integer literal longer than Python converts to int (sys.get_int_max_str_digits): kept as
    its digits. A template field takes it as text, an id as a string; a sampling field refuses it
    as out of range."""


def _parse_int(literal: str) -> int | LongInt:
    try:
        return int(literal)
    except ValueError:
        return LongInt(literal)


def readable_id(row: dict[str, Any] | None, field: str) -> str | None:
    """The id of a row that failed, when it is plain text (or an integer): error records name it."""
    raw = row.get(field) if isinstance(row, dict) else None
    if isinstance(raw, bool) or not isinstance(raw, (str, int)) or (isinstance(raw, str) and not raw):
        return None
    rid = str(raw)
    try:
        rid.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return rid


# -- reading ---------------------------------------------------------------------------------------
def open_queries(path: str | Path) -> BinaryIO:
    """The query file, or standard input for '-' (and /dev/stdin, which is read the same way)."""
    if str(path) == STDIN:
        return sys.stdin.buffer
    return Path(path).open("rb")


def _parse(number: int, raw: bytes) -> dict[str, Any] | RowError:
    if isinstance(raw, Overlong):
        return RowError(
            None,
            f"the row is {human_bytes(raw.size)} long; rows are read up to {human_bytes(ROW_BYTES)} "
            "(far more than any model's context holds), and this one was skipped unread",
        )
    if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark, as some editors write
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        kind = encoding_name(raw)
        if kind is not None and not kind.startswith("binary"):
            return RowError(None, f"is {kind} text, not UTF-8; save the file as UTF-8")
        message = f"not UTF-8 text (the byte {raw[exc.start]:#04x} at column {exc.start + 1}); save the file as UTF-8"
        try:  # the row read with its bad bytes kept aside: the record can name its id and the field
            obj = json.loads(
                raw.decode("utf-8", "surrogateescape"), parse_int=_parse_int, object_pairs_hook=unique_keys
            )
        except (ValueError, RecursionError):
            return RowError(None, message)
        if not isinstance(obj, dict):
            return RowError(None, message)
        field = _unencodable(obj)
        return RowError(field if isinstance(field, str) else None, message, row=obj)
    try:
        obj = json.loads(text, parse_int=_parse_int, object_pairs_hook=unique_keys)
    except DuplicateKey as exc:
        return RowError(exc.key, "appears twice in this row (which value is meant?); give each key once")
    except json.JSONDecodeError as exc:
        return RowError(None, f"not valid JSON: {exc.msg} (column {exc.colno})")
    except RecursionError:
        return RowError(None, "not valid JSON: nested too deeply")
    except ValueError as exc:  # e.g. a float literal out of range
        return RowError(None, f"not usable JSON: {exc}")
    if not isinstance(obj, dict):
        return RowError(None, f"expected a JSON object, got {type(obj).__name__}")
    if CSV_ERROR in obj:
        return RowError(None, str(obj.pop(CSV_ERROR)), row=obj)
    bad = _unencodable(obj)
    if bad is not False:
        return RowError(
            bad,
            "holds a lone surrogate escape (e.g. \\ud800), which is not text; "
            "encode the text as UTF-8 or write the pair",
            row=obj,
        )
    return obj


def _unencodable(obj: dict[str, Any]) -> str | None | bool:
    """The field holding the first key or string that has no UTF-8 form (a lone surrogate: JSON allows
    "\\ud800", Unicode text does not; None: a top-level key), or False when there is none. Walked
    without recursion however deep the row nests."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or None
        elif isinstance(value, dict):
            for k, v in value.items():
                name = f"{path}.{k}" if path else k
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return path or None
                stack.append((name, v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return False


def read_rows(stream: Iterable[bytes]) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    """(line number, parsed object or RowError) for each non-blank line; bytes are decoded per line so
    one bad line cannot spoil the file."""
    for number, raw in enumerate(lines(stream) if hasattr(stream, "readline") else stream, start=1):
        if raw.strip():
            yield number, _parse(number, raw)


def _looks_openai(obj: dict[str, Any]) -> bool | None:
    """True/False when a row decides the format, None when it says nothing (e.g. `{}`)."""
    if "custom_id" in obj or "body" in obj:
        return True
    return False if obj else None


def detect_format(rows: Iterator[tuple[int, Any]], lookahead: int = 1000) -> tuple[str, Iterator[tuple[int, Any]]]:
    """('openai' | 'template', the same rows): decided by the first row that says, among the first
    `lookahead` valid rows; the rows read to decide are handed back, so a pipe is read once."""
    seen: list[tuple[int, Any]] = []
    fmt = "template"
    for item in rows:
        seen.append(item)
        obj = item[1]
        if isinstance(obj, dict):
            verdict = _looks_openai(obj)
            if verdict is not None:
                fmt = "openai" if verdict else "template"
                break
        if len(seen) >= lookahead:
            break
    return fmt, itertools.chain(seen, rows)


# -- fields ----------------------------------------------------------------------------------------
def _text(v: Any, field: str) -> str:
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise RowError(field, f"must be a string or a number, got {_kind(v)}")
    if isinstance(v, float) and not math.isfinite(v):
        raise RowError(field, f"must be a finite number, got {v}")
    return str(v)


def few(names: Iterable[str], near: str | None = None, shown: int = 5) -> str:
    """Choices as an error can list them: the closest to `near` first, at most `shown`, and how
    many there are in all (a folder of 10,000 templates is not one error line)."""
    import difflib

    names = list(names)
    close = difflib.get_close_matches(near, names, n=shown) if near is not None and len(names) < 100_000 else []
    picked = close + [n for n in sorted(names) if n not in close][: shown - len(close)]
    more = f", ... ({len(names)} in all)" if len(names) > shown else ""
    return ", ".join(map(repr, picked)) + more


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", bool: "a boolean", type(None): "null"}.get(type(v), type(v).__name__)


def layer(*sources: dict[str, Any]) -> dict[str, Any]:
    """Sampling values merged left to right, where a constraint (json_schema / regex / grammar)
    replaces the earlier layers' constraint whatever its kind, rather than clashing with it."""
    values: dict[str, Any] = {}
    for src in sources:
        if any(src.get(k) is not None for k in KINDS):
            for k in KINDS:
                values.pop(k, None)
        values.update(src)
    return values


def _params(base: dict[str, Any], row: dict[str, Any], names: dict[str, str], prefix: str = "") -> SamplingParams:
    """SamplingParams from defaults plus the row's overrides; `names` maps row keys to fields."""
    overrides = {}
    source = {}
    for key, target in names.items():
        if row.get(key) is None:
            continue
        v = row[key]
        if target == "stop" and isinstance(v, str):
            v = [v]
        overrides[target] = v
        source[target] = key
    values = layer(base, overrides)
    try:
        return SamplingParams(**values)
    except ParamError as exc:
        raise RowError(prefix + source.get(exc.field, exc.field), exc.message) from None


def _constraint_source(params: SamplingParams, layers: list[tuple[str, dict[str, Any]]]) -> str | None:
    """Who set the constraint: the last of `layers` (name, values) that sets one, as `layer` merges."""
    if not any(getattr(params, k) is not None for k in KINDS):
        return None
    for name, values in reversed(layers):
        kind = next((k for k in KINDS if values.get(k) is not None), None)
        if kind is not None:
            return name or kind
    return None


def _unreadable(exc: Exception) -> str:
    return f"cannot be processed: {type(exc).__name__}: {exc}"[:500]


def check_defaults(defaults: dict[str, Any]) -> None:
    """Raises ParamError when the command line's sampling defaults are themselves invalid."""
    SamplingParams(**defaults)


# -- template rows ---------------------------------------------------------------------------------
TEMPLATE_OVERRIDES = {k: k for k in SAMPLING_NAMES}  # a row sets any SamplingParams field by its name


def template_jobs(
    rows: Iterable[tuple[int, Any]],
    templates: dict[str, Template],
    defaults: dict[str, Any],
    id_field: str = "id",
    on_note: Callable[[str], None] | None = None,
) -> Iterator[Job | ErrorRecord]:
    """Rows of a template query file. With several templates, each row names one in `template`.
    A field a row carries that nothing reads (a typo, an OpenAI option such as logit_bias) is
    said to `on_note` once per job and template."""
    noted: set[tuple[str, str]] = set()
    read = {
        t.name: frozenset((id_field, "template", "choices", *t.fields, *TEMPLATE_OVERRIDES)) for t in templates.values()
    }
    seen: set[str] = set()  # explicit ids only: a generated `line-N` never collides with a row's own id
    occurrences: dict[str, int] = {}  # request hash -> id-less rows with it so far
    only = next(iter(templates.values())) if len(templates) == 1 else None
    plain: dict[str, tuple[SamplingParams, str | None]] = {}  # template -> params of a row that sets none
    for number, obj in rows:
        if isinstance(obj, RowError):
            yield ErrorRecord(readable_id(obj.row, id_field), number, obj.field, obj.message)
            continue
        raw_id = obj.get(id_field)
        rid: str | None = None
        try:
            if raw_id is None:
                rid = f"line-{number}"
            elif isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
                raise RowError(id_field, f"must be a string or an integer, got {_kind(raw_id)}")
            else:
                rid = str(raw_id)
            if raw_id is not None:
                if rid in seen:
                    raise RowError(id_field, f"duplicate id {rid!r} (an earlier line has it; ids must be unique)")
                seen.add(rid)
            template = only
            if "template" in obj or template is None:
                name = obj.get("template")
                if not isinstance(name, str):
                    raise RowError("template", f"must name one of {few(templates)}, got {_kind(name)}")
                if name not in templates:
                    raise RowError("template", f"unknown template {name[:80]!r}; known: {few(templates, name)}")
                template = templates[name]
            if on_note is not None:
                for key in obj:
                    if (template.name, key) not in noted and key not in read[template.name]:
                        noted.add((template.name, key))
                        on_note(
                            f"line {number}: field {key[:80]!r} is not used (template {template.name!r} has no "
                            "such placeholder and it is no sampling field); rows that carry it run without it"
                        )
            values: dict[str, str] = {}
            for name in template.fields:
                if name not in obj:
                    raise RowError(name, f"missing (template {template.name!r} needs {few(template.fields)})")
                values[name] = _text(obj[name], name)
            if template.name in plain and not any(obj.get(k) is not None for k in TEMPLATE_OVERRIDES):
                params, source = plain[template.name]  # most rows set no sampling field: checked once
            else:
                params = _params(layer(template.sampling, template.output, defaults), obj, TEMPLATE_OVERRIDES)
                row_kind = next((k for k in KINDS if obj.get(k) is not None), "")
                source = _constraint_source(
                    params, [("template", template.output), ("", defaults), (row_kind, {k: obj.get(k) for k in KINDS})]
                )
                if not any(obj.get(k) is not None for k in TEMPLATE_OVERRIDES):
                    plain[template.name] = params, source
            choices = template.choices or None
            if obj.get("choices") is not None and "choices" not in template.fields:
                try:
                    choices = check_choices(obj["choices"])
                except ValueError as exc:
                    raise RowError("choices", str(exc)) from None
            if choices is not None:  # scored, not generated: sampling settings do not apply
                params, source = SCORE_ONLY, None
            job = Job(
                rid,
                number,
                template.messages(values),
                params,
                template.name,
                data=tuple(values.values()),
                layout=template.layout,
                constraint_field=source,
                choices=choices,
            )
            # A row without an id is matched on resume by its request's hash (and occurrence), so it
            # is hashed here; a row with one is hashed when its record is written (it cannot fail
            # there: every value is text, numbers or lists, and the text has a UTF-8 form, checked
            # at parse), which spares the prefix order's keying pass a hash of every prompt.
            if raw_id is None:
                job.occurrence = occurrences.get(job.request_hash, 0)
                occurrences[job.request_hash] = job.occurrence + 1
        except RowError as err:
            yield ErrorRecord(rid, number, err.field, err.message)
            continue
        except Exception as exc:  # whatever a row's values make a later step raise: that row's error
            yield ErrorRecord(rid, number, None, _unreadable(exc))
            continue
        yield job


# -- OpenAI batch rows -----------------------------------------------------------------------------
# Body fields whose name is not the SamplingParams field's (the Chat Completions API's and vLLM's
# names); every other field is taken by its own name, as vLLM takes top_k, ignore_eos, ... .
OPENAI_RENAMES = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "top_logprobs": "logprobs",  # with `logprobs: true` (_logprobs)
    "response_format": "json_schema",  # {"type": "json_schema", ...} (_response_format)
    "guided_regex": "regex",
    "guided_grammar": "grammar",
}
OPENAI_OVERRIDES = {
    **{k: k for k in SAMPLING_NAMES if k not in OPENAI_RENAMES.values()},
    **OPENAI_RENAMES,
}
# Accepted and without effect on a local model, as the Batch API accepts them.
OPENAI_IGNORED = {
    "model",
    "user",
    "metadata",
    "store",
    "service_tier",
    "stream_options",
    "parallel_tool_calls",
    "reasoning_effort",
    "prompt_cache_key",
    "safety_identifier",
}
OPENAI_OWN = ("messages", "response_format", "logprobs", "top_logprobs")  # read by openai_jobs itself
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _unsupported(body: dict[str, Any]) -> str | None:
    """The first body field asking for something chunkgen cannot do (never silently dropped)."""
    for key, value in body.items():
        if key in OPENAI_OVERRIDES or key in OPENAI_IGNORED or key in OPENAI_OWN:
            continue
        harmless = (
            (key == "stream" and value in (False, None))
            or (key in ("logit_bias", "tools", "functions") and not value)
            or (key in ("tool_choice", "function_call") and value in ("none", None))
            or (key == "modalities" and value in (["text"], None))
        )
        if not harmless:
            return key
    return None


def _logprobs(body: dict[str, Any]) -> int | None:
    """SamplingParams.logprobs from a body's `logprobs` (true / false) and `top_logprobs` (0-20):
    None when not asked, else how many alternatives to list per token."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise RowError("body.logprobs", f"must be true or false, got {_kind(asked)}")
    if top not in (None, 0) and not asked:  # 0 asks for nothing, as the API takes it
        raise RowError("body.top_logprobs", "needs logprobs: true")
    return (top or 0) if asked else None


def _response_format(value: Any) -> str | dict | None:
    """The JSON schema a body's response_format asks for (None: free text), as the Chat
    Completions API takes it: {"type": "text"}, {"type": "json_object"} (any JSON object) or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    field = "body.response_format"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RowError(field, f"must be an object, got {_kind(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise RowError(field, f"json_schema must be an object, got {_kind(spec)}")
        schema = spec.get("schema", {})  # OpenAI's default: no schema, any JSON value
        if not isinstance(schema, (dict, bool)):
            raise RowError(field, f"json_schema.schema must be an object, got {_kind(schema)}")
        return schema
    raise RowError(field, f"type must be text, json_object or json_schema, got {kind!r}")


def _content(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text can be run here
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _kind(part)
                raise RowError(f"{field}[{j}]", f"only text content parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise RowError(field, f"must be a string or a list of text parts, got {_kind(content)}")


def openai_jobs(rows: Iterable[tuple[int, Any]], defaults: dict[str, Any]) -> Iterator[Job | ErrorRecord]:
    seen: set[str] = set()
    for number, obj in rows:
        if isinstance(obj, RowError):
            yield ErrorRecord(readable_id(obj.row, "custom_id"), number, obj.field, obj.message)
            continue
        rid = obj.get("custom_id")
        try:
            if not isinstance(rid, str) or not rid:
                rid = None
                raise RowError("custom_id", "must be a non-empty string")
            if rid in seen:
                raise RowError("custom_id", f"duplicate custom_id {rid!r} (an earlier line has it)")
            seen.add(rid)
            if obj.get("method", "POST") != "POST":
                raise RowError("method", "must be POST")
            url = obj.get("url", OPENAI_URL)
            if url not in OPENAI_URLS:
                raise RowError("url", f"only {' and '.join(OPENAI_URLS)} are served, got {url!r}")
            body = obj.get("body")
            if not isinstance(body, dict):
                raise RowError("body", f"must be an object, got {_kind(body)}")
            if url == COMPLETIONS_URL:
                job = _completions_job(rid, number, body, defaults)
                _ = job.request_hash  # computed here, so a row it fails on fails alone
                yield job
                continue
            bad = _unsupported(body)
            if bad is not None:
                raise RowError(f"body.{bad}", "is not supported by chunkgen")
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RowError("body.messages", "must be a non-empty list")
            clean = []
            for i, m in enumerate(messages):
                field = f"body.messages[{i}]"
                if not isinstance(m, dict):
                    raise RowError(field, f"must be an object, got {_kind(m)}")
                role = m.get("role")
                if role not in ROLES:
                    raise RowError(f"{field}.role", f"must be one of {sorted(ROLES)}, got {str(role)[:80]!r}")
                clean.append({"role": ROLES[role], "content": _content(m.get("content"), f"{field}.content")})
            schema = _response_format(body.get("response_format"))
            base = defaults
            if body.get("response_format") is not None and schema is None:  # {"type": "text"} asks for free text
                base = {k: v for k, v in base.items() if k not in KINDS}
            if body.get("logprobs") is False:  # an explicit no beats the command line's default
                base = {k: v for k, v in base.items() if k != "logprobs"}
            params = _params(
                base,
                {**body, "response_format": schema, "top_logprobs": _logprobs(body)},
                OPENAI_OVERRIDES,
                prefix="body.",
            )
            if params.max_new_tokens == 0:  # only a completions row may ask for none (to score its prompt)
                key = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
                raise RowError(f"body.{key}", "must be an integer >= 1, got 0")
            body_constraints = {
                "response_format": schema,
                "guided_regex": body.get("guided_regex"),
                "guided_grammar": body.get("guided_grammar"),
            }
            source = _constraint_source(
                params,
                [("", defaults), *((f"body.{k}", {OPENAI_RENAMES[k]: v}) for k, v in body_constraints.items())],
            )
            job = Job(
                rid,
                number,
                clean,
                params,
                None,
                data=tuple(m["content"] for m in clean),
                layout=tuple((i,) for i in range(len(clean))),
                constraint_field=source,
            )
            _ = job.request_hash  # computed here, so a row it fails on fails alone
        except RowError as err:
            yield ErrorRecord(rid, number, err.field, err.message)
            continue
        except Exception as exc:  # whatever a row's values make a later step raise: that row's error
            yield ErrorRecord(rid if isinstance(rid, str) else None, number, None, _unreadable(exc))
            continue
        yield job


# -- OpenAI /v1/completions rows -------------------------------------------------------------------
COMPLETIONS_OVERRIDES = {
    **{k: k for k in SAMPLING_NAMES if k not in ("max_new_tokens", "logprobs", "prompt_logprobs", *KINDS)},
    "max_tokens": "max_new_tokens",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
}
COMPLETIONS_OWN = ("prompt", "echo", "logprobs", "suffix", "best_of")
COMPLETIONS_MAX_TOKENS = 16  # the API's default when a row sets none


def _prompt(value: Any) -> str | list[int]:
    """A completions prompt: a string, token ids, or a list holding one of those."""
    field = "body.prompt"
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise RowError(field, "must not be empty")
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        return [int(t) for t in value]
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise RowError(field, f"holds {len(value)} prompts; give one prompt per row (each row gets its own custom_id)")
    raise RowError(field, f"must be a string or a list of token ids, got {_kind(value)}")


def _completions_job(rid: str, number: int, body: dict[str, Any], defaults: dict[str, Any]) -> Job:
    """A /v1/completions row: prompt, max_tokens (0: score only), echo, logprobs (top-k per token),
    and the sampling fields chat rows take."""
    if body.get("suffix") is not None:
        raise RowError(
            "body.suffix", "is not supported: chunkgen continues a prompt, it does not fill in before a suffix"
        )
    best_of = body.get("best_of")
    if best_of not in (None, 1) and best_of != body.get("n", 1):
        raise RowError("body.best_of", "is not supported (use n)")
    for key, value in body.items():
        if key not in COMPLETIONS_OVERRIDES and key not in OPENAI_IGNORED and key not in COMPLETIONS_OWN:
            harmless = (key == "stream" and value in (False, None)) or (key == "logit_bias" and not value)
            if not harmless:
                raise RowError(f"body.{key}", "is not supported by chunkgen")
    prompt = _prompt(body.get("prompt"))
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise RowError("body.echo", f"must be true or false, got {_kind(echo)}")
    top = body.get("logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise RowError("body.logprobs", f"must be an integer (alternatives per token), got {_kind(top)}")
    values = {"max_new_tokens": COMPLETIONS_MAX_TOKENS}
    values.update((k, v) for k, v in defaults.items() if k not in ("logprobs", *KINDS))
    # Echo shows the prompt's tokens: scored when logprobs are asked (their entries), and for a
    # prompt of token ids also without (their texts come with the entries).
    scored = top if top is not None else (0 if echo and isinstance(prompt, list) else None)
    row = {**body, "logprobs": top, "prompt_logprobs": scored if echo else None}
    names = {**COMPLETIONS_OVERRIDES, "logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs"}
    params = _params(values, row, names, prefix="body.")
    if params.max_new_tokens == 0 and not echo:
        raise RowError("body.max_tokens", "is 0 without echo: nothing would be returned")
    return Job(rid, number, [], params, None, data=(), prompt=prompt, echo=echo)
