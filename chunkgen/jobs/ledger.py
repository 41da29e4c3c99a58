"""What an output file already holds: chunkgen's records read back (a file with any other line is
refused before anything changes), and the ledger of which records still stand: an answer belongs
to its row by id, or by request and occurrence for a row without one; an error record never stands
for an answer, and a later record at the same line supersedes an earlier one. `--resume` and the
writer's end-of-run rewrite both go by it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chunkgen.jobs.requests import id_key, row_key

FORMAT_VERSION = 1  # the `chunkgen` field of every record; records without it (older releases) need `request_hash`


class OutputError(ValueError):
    """The output file cannot be used or written; the message says why and what is safe."""


# -- records on disk -------------------------------------------------------------------------------
def is_record(rec: Any) -> bool:
    """A line chunkgen wrote: its own fields with their types, not merely an `id` and a `text`."""
    if not isinstance(rec, dict) or rec.get("chunkgen", FORMAT_VERSION) != FORMAT_VERSION:
        return False
    line = rec.get("line")
    if "request_hash" not in rec or not isinstance(rec["request_hash"], (str, type(None))):
        return False
    if isinstance(line, bool) or not isinstance(line, int):
        return False
    if "custom_id" in rec:  # OpenAI batch output
        return (
            "response" in rec
            and isinstance(rec.get("error"), (dict, type(None)))
            and isinstance(rec["custom_id"], (str, type(None)))
        )
    if not isinstance(rec.get("id", 0), (str, type(None))):
        return False
    return "id" in rec and (isinstance(rec.get("text"), str) or isinstance(rec.get("error"), dict))


def record_id(rec: dict[str, Any]) -> str | None:
    return rec.get("custom_id") if "custom_id" in rec else rec.get("id")


def record_key(rec: dict[str, Any]) -> str | None:
    """What a record's answer belongs to (Job.key): the row's id (as id_key), or the `row_key` of a
    row without one."""
    key = rec.get("row_key")
    if isinstance(key, str):
        return key
    rid = record_id(rec)
    return None if rid is None else id_key(rid)


def record_id_field(rec: dict[str, Any]) -> str | None:
    """The field a record's row took its id from (`id` unless the record says), None for an
    OpenAI record or a row without an id."""
    if "custom_id" in rec or "row_key" in rec or rec.get("id") is None:
        return None
    field = rec.get("id_field", "id")
    return field if isinstance(field, str) else None


def is_error(rec: dict[str, Any]) -> bool:
    return rec.get("error") is not None


def _foreign(path: Path, number: int, rec: Any) -> OutputError:
    if isinstance(rec, dict) and isinstance(rec.get("chunkgen"), int) and rec["chunkgen"] > FORMAT_VERSION:
        why = f"line {number} was written by a newer chunkgen (record format {rec['chunkgen']})"
    else:
        why = f"line {number} is not a chunkgen result record"
    return OutputError(
        f"{path}: {why}; refusing to resume into it, and nothing was changed (is --out your queries file?)"
    )


def parse_line(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, a number too long to convert
        return None


def read_records(path: Path) -> Iterator[tuple[int, bytes, dict[str, Any] | None]]:
    """(line number, raw line, record) for each non-blank line; record None for a last line without
    its newline that is not a whole record (a run died while writing it). Raises OutputError at the
    first line that is not chunkgen's."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            rec = parse_line(raw)
            if not is_record(rec):
                if _cut_record(raw, rec):
                    yield number, raw, None
                    return
                raise _foreign(path, number, rec)
            yield number, raw, rec


def _cut_record(raw: bytes, parsed: Any) -> bool:
    """A last line that a run died while writing: no newline, not JSON, and begun as every record is."""
    return not raw.endswith(b"\n") and parsed is None and raw.startswith(b'{"id": ')


class Ledger:
    """Which records of a file stand: the last answer of each id, and at each line the last record
    (an error record there is superseded by any later record for that line; an answer, only by a
    later error record for the same id and line, i.e. its request, asked again, now fails)."""

    def __init__(self) -> None:
        self.n = 0  # records added
        self.last_at_line: dict[int, tuple[int, bool, str | None]] = {}  # line -> (index, answer?, id)
        self.answers: dict[str, tuple[int, int, str | None]] = {}  # key -> (index, line, request hash)
        self.id_fields: dict[str, int] = {}  # the id field of rows with an id -> its first record's line

    def add(self, rec: dict[str, Any]) -> None:
        rid, line, answer = record_key(rec), rec["line"], not is_error(rec)
        field = record_id_field(rec) if answer else None
        if field is not None:
            self.id_fields.setdefault(field, line)
        self.last_at_line[line] = (self.n, answer, rid)
        if answer and rid is not None:
            self.answers[rid] = (self.n, line, rec.get("request_hash"))
        self.n += 1

    def _answer_stands(self, rid: str, index: int, line: int) -> bool:
        last, answer, last_id = self.last_at_line[line]
        return last == index or answer or last_id != rid

    def stands(self, index: int, rec: dict[str, Any], first_new: int | None = None) -> bool:
        """Whether record number `index` (0-based, file order) is kept. With `first_new`, error records
        before it (earlier runs') go too: a run that read its whole input gave every row a new verdict."""
        rid, line = record_key(rec), rec["line"]
        if is_error(rec) or rid is None:
            return self.last_at_line[line][0] == index and (first_new is None or index >= first_new)
        return self.answers[rid][0] == index and self._answer_stands(rid, index, line)

    def kept(self, first_new: int | None = None) -> int:
        errors = sum(
            1 for i, answer, _ in self.last_at_line.values() if not answer and (first_new is None or i >= first_new)
        )
        answers = sum(1 for rid, (i, line, _) in self.answers.items() if self._answer_stands(rid, i, line))
        return errors + answers

    def standing_answers(self) -> dict[str, tuple[int, str | None]]:
        """key (record_key) -> (line, request hash) of every answer that stands."""
        return {rid: (line, h) for rid, (i, line, h) in self.answers.items() if self._answer_stands(rid, i, line)}


def legacy_keys(answers: dict[str, tuple[int, str | None]]) -> dict[str, tuple[int, str | None]]:
    """Answers of id-less rows written before records carried `row_key` (id `line-N` at line N),
    under the key their rows have now: the occurrences of a request counted in line order."""
    out: dict[str, tuple[int, str | None]] = {}
    counts: dict[str, int] = {}
    for rid, (line, h) in sorted(answers.items(), key=lambda kv: kv[1][0]):
        if h is not None and rid == id_key(f"line-{line}"):
            out[row_key(h, counts.get(h, 0))] = (line, h)
            counts[h] = counts.get(h, 0) + 1
    return out
