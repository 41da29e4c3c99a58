"""Mistakes of a whole query file, found from its first rows before the model loads, and CSV input.

A file that is not JSONL at all (a CSV or TSV export, one JSON array) or a template placeholder no
row fills would otherwise become one error record per row after the model has loaded, as if some
rows were bad. The first rows tell: when none of them can be read, or none has a field the template
needs, the file is refused with one line that says what it looks like or which field the rows have.
"""

from __future__ import annotations

import csv
import difflib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chunkgen import bounded
from chunkgen.jobs.requests import CSV_ERROR, OPENAI_URLS, TEMPLATE_OVERRIDES, RowError, _looks_openai, read_rows
from chunkgen.jobs.templates import Template

SAMPLE_ROWS = 20  # rows read to judge the file: enough that one odd row decides nothing


class FileMistake(ValueError):
    """The whole file cannot be what the run needs; the message says what it looks like."""


def _first_lines(path: Path, n: int = SAMPLE_ROWS) -> list[tuple[int, bytes]]:
    """The first `n` non-blank lines with their line numbers, each bounded (bounded.lines): an
    endless line stops at the limit."""
    out: list[tuple[int, bytes]] = []
    with path.open("rb") as f:
        for number, raw in enumerate(bounded.lines(f, skip=False), 1):
            if raw.strip():
                out.append((number, raw))
                if len(out) >= n:
                    break
    return out


def check_encoding(path: Path, first: bytes) -> None:
    """A file that is not UTF-8 text at all (UTF-16 from a Windows editor, a sparse or binary file),
    named as such by its first line, not echoed as bytes in one error record per row."""
    kind = bounded.encoding_name(first)
    if kind is None:
        return
    if kind.startswith("binary"):
        raise FileMistake(f"{path} is not a text file: {kind}")
    raise FileMistake(f"{path} is {kind} text; save it as UTF-8 (one JSON object per line)")


def _looks_like(lines: list[bytes]) -> str:
    """What a file none of whose first lines is a JSON object looks like, in a user's words."""
    text = b"".join(lines).decode("utf-8", "replace").lstrip("\ufeff")
    first = text.splitlines()[0] if text.strip() else ""
    if text.lstrip().startswith("["):
        return (
            "one JSON array; write one JSON object per line (JSONL), e.g. "
            'python -c "import json,sys; [print(json.dumps(r)) for r in json.load(sys.stdin)]" < FILE'
        )
    for delimiter, name in (("\t", "TSV"), (",", "CSV"), (";", "CSV (semicolon-separated)")):
        if delimiter in first:
            header = next(csv.reader(io.StringIO(first), delimiter=delimiter))
            shown = ", ".join(h.strip() for h in header[:8]) + (", ..." if len(header) > 8 else "")
            return (
                f"{name} with the header {shown}; a file named .csv is read as CSV (header row = "
                "field names), or write one JSON object per line"
            )
    return "not JSONL (one JSON object per line)"


def _not_utf8(numbered: list[tuple[int, bytes]]) -> str | None:
    """Where the first of these lines that is not UTF-8 breaks it, when every one of them is not
    (a Latin-1 or Windows-1252 export): then the encoding is the file's mistake, not its format."""
    first = None
    for number, raw in numbered:
        try:
            raw.decode("utf-8")
            return None
        except UnicodeDecodeError as exc:
            if first is None:
                first = bounded.bad_byte(raw, exc.start, number)
    return first


def _first(n: int) -> str:
    return "the first row" if n == 1 else f"the first {n} rows"


def check_sample(path: Path, fmt: str, templates: dict[str, Template] | None, id_field: str) -> None:
    """Raises FileMistake when the first rows show the whole file is unusable (see the module)."""
    numbered = _first_lines(path)
    if not numbered:
        return
    lines = [raw for _, raw in numbered]
    check_encoding(path, lines[0])
    where = _not_utf8(numbered)
    if where is not None:
        raise FileMistake(str(bounded.not_utf8_rows(str(path), where)))
    rows = [obj for _, obj in read_rows(lines)]
    objects = [r for r in rows if isinstance(r, dict)]
    if not objects and not any(isinstance(r, RowError) and r.row is not None for r in rows):
        what = "the first row is not" if len(rows) == 1 else f"none of {_first(len(rows))} is"
        raise FileMistake(f"{path}: {what} a JSON object; the file looks like {_looks_like(lines)}")
    if fmt == "openai" or not templates or any(_looks_openai(o) for o in objects):
        urls = [o.get("url") for o in objects if _looks_openai(o)]
        if urls and all(u is not None and u not in OPENAI_URLS for u in urls):
            shown = ", ".join(map(repr, dict.fromkeys(map(str, urls))))
            raise FileMistake(
                f"{path}: {_first(len(urls))} {'asks' if len(urls) == 1 else 'ask'} for {shown}, which "
                f"chunkgen does not serve; it answers {' and '.join(OPENAI_URLS)}"
            )
        return
    only = next(iter(templates.values())) if len(templates) == 1 else None
    for t in templates.values():
        users = [o for o in objects if o.get("template", only.name if only else None) == t.name]
        if not users:
            continue
        have = sorted({k for o in users for k in o} - {id_field, "template", *TEMPLATE_OVERRIDES})
        for name in t.fields:
            if not any(name in o for o in users):
                near = difflib.get_close_matches(name, have, n=1, cutoff=0.5)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                one = len(users) == 1
                rows = "the first row for it does not have" if one else f"none of {_first(len(users))} for it has"
                raise FileMistake(
                    f"template {t.name!r} ({t.path}) needs the field {name!r}, which {rows} "
                    f"({'it has' if one else 'they have'} {', '.join(map(repr, have)) or 'no fields'}){hint}"
                )


# -- CSV -------------------------------------------------------------------------------------------
def csv_rows(path: Path) -> Iterator[str]:
    """A CSV file (header row = field names, as pandas and Ray Data read it) as JSONL lines: line 1
    stands for the header, so a row's line number is its line in the file when no value spans lines.
    Empty cells are absent fields; sampling fields (max_new_tokens, seed, stop...) are read as JSON
    when they parse as JSON, every other value is text."""
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return
        header = [h.strip() for h in header]
        yield "\n"
        for cells in reader:
            if not any(c.strip() for c in cells):
                yield "\n"
                continue
            row: dict[str, Any] = {}
            unnamed = [i + 1 for i, c in enumerate(cells) if c.strip() and (i >= len(header) or not header[i])]
            if unnamed:  # a value no header names: its text would be lost without a word
                row[CSV_ERROR] = (
                    f"column {unnamed[0]} holds a value the header names no field for (the header has "
                    f"{len(header)} columns, this row {len(cells)}); a value that holds a comma must be in "
                    "double quotes"
                )
            for name, value in zip(header, cells):
                if value == "" or not name:
                    continue
                if name in TEMPLATE_OVERRIDES:
                    try:
                        value = json.loads(value)
                    except ValueError:
                        pass
                row[name] = value
            yield json.dumps(row, ensure_ascii=False) + "\n"


def csv_to_jsonl(path: Path, target: Path) -> None:
    """Writes csv_rows(path) to `target`."""
    with target.open("w", encoding="utf-8") as out:
        for line in csv_rows(path):
            out.write(line)
