"""Streaming JSONL results: one flushed line per finished request, resumable after a kill.

Every record carries the input line it answers and a hash of the request (`line`, `request_hash`).
Resume keys answers by (line, id): an error record never stands for an answer (its row is tried
again), and an answer whose request has changed since is reported, and re-answered only when asked.
A record written again in a later run supersedes the earlier one; the file is compacted at the end
of that run so each key appears once.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from chunkgen.engine.sequence import Completion, Result
from chunkgen.jobs.lock import OutputLock
from chunkgen.jobs.requests import ErrorRecord, Job

Key = tuple[int | None, str | None]  # (input line, id); line None for records of older versions


class OutputExists(FileExistsError):
    pass


class OutputError(ValueError):
    """The output file cannot be used or written; the message says why and what is safe."""


def _is_record(rec: Any) -> bool:
    if not isinstance(rec, dict):
        return False
    if "custom_id" in rec:  # OpenAI batch output
        return "response" in rec and "error" in rec
    return "id" in rec and ("text" in rec or "error" in rec)


def record_key(rec: dict[str, Any]) -> Key:
    rid = rec.get("custom_id") if "custom_id" in rec else rec.get("id")
    line = rec.get("line")
    return (line if isinstance(line, int) else None, None if rid is None else str(rid))


def is_error(rec: dict[str, Any]) -> bool:
    return rec.get("error") is not None


def _scan(path: Path) -> tuple[dict[Key, str | None], set[Key], int]:
    """(answers: key -> request hash, every key in the file, byte length of the complete records).
    Refuses, before changing anything, a file holding lines that are not chunkgen records."""
    answers: dict[Key, str | None] = {}
    keys: set[Key] = set()
    good_end = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                break  # no newline: a run died mid-line; this fragment is cut off
            if raw.strip():
                try:
                    rec = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                    rec = None
                if not _is_record(rec):
                    raise OutputError(
                        f"{path}: line {number} is not a chunkgen result record; refusing to resume into "
                        "a file chunkgen did not write (is --out your queries file?)"
                    )
                key = record_key(rec)
                keys.add(key)
                if is_error(rec):
                    answers.pop(key, None)  # a later error record supersedes an earlier answer
                else:
                    answers[key] = rec.get("request_hash")
            good_end += len(raw)
    return answers, keys, good_end


def _sampling(job: Job) -> dict[str, Any]:
    """The record's sampling parameters. A constraint is named by its kind and a short hash, not
    repeated in full: a tool catalogue's schema would be most of every line."""
    out = job.params.as_dict()
    for kind in ("json_schema", "regex", "grammar"):
        if out.get(kind) is not None:
            out[kind] = "sha256:" + hashlib.sha256(out[kind].encode()).hexdigest()[:16]
    return out


def _logprobs(c: Completion) -> list[dict] | None:
    return None if c.logprobs is None else [e.as_openai() for e in c.logprobs]


def _extras(c: Completion) -> dict[str, Any]:
    """A completion's optional fields in chunkgen's own records: only those the request asked for."""
    out: dict[str, Any] = {}
    if c.logprobs is not None:
        out["logprobs"] = _logprobs(c)
    if c.matched is not None:
        out["constraint_matched"] = c.matched
    return out


class RecordFormat:
    """Turns results and errors into output records: chunkgen's own lines, or OpenAI batch output.
    Separate from the writer so remote workers can format what the driver writes."""

    def __init__(self, fmt: str, model_name: str) -> None:
        self.fmt = fmt
        self.model_name = model_name

    def result_record(self, job: Job, res: Result) -> dict[str, Any]:
        if res.error is not None:
            return self.error_record(ErrorRecord(job.id, job.line, "prompt", res.error), job.request_hash)
        if self.fmt == "openai":
            body = {
                "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                             "logprobs": None if c.logprobs is None else {"content": _logprobs(c), "refusal": None},
                             "finish_reason": c.finish_reason} for i, c in enumerate(res.completions)],
                "usage": {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
                          "total_tokens": res.prompt_tokens + res.completion_tokens,
                          "prompt_tokens_details": {"cached_tokens": res.cached_tokens}},
            }
            return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": job.id,
                    "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
                    "error": None, "line": job.line, "request_hash": job.request_hash}
        rec: dict[str, Any] = {"id": job.id, "line": job.line, "template": job.template, "text": res.text,
                               "finish_reason": res.finish_reason,
                               "usage": {"prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens,
                                         "completion_tokens": res.completion_tokens},
                               "sampling": _sampling(job), "request_hash": job.request_hash,
                               **_extras(res.completions[0])}
        if len(res.completions) > 1:
            rec["completions"] = [{"text": c.text, "finish_reason": c.finish_reason, **_extras(c)}
                                  for c in res.completions]
        return rec

    def error_record(self, err: ErrorRecord, request_hash: str | None = None) -> dict[str, Any]:
        if self.fmt == "openai":
            return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": err.id, "response": None,
                    "error": {"code": "invalid_request", "line": err.line, "field": err.field,
                              "message": err.message},
                    "line": err.line, "request_hash": request_hash}
        return {"id": err.id, "line": err.line, "error": {"field": err.field, "message": err.message},
                "request_hash": request_hash}


class ResultWriter(RecordFormat):
    """The one writer of an output file (it holds the file's lock from open to close)."""

    def __init__(self, path: str | Path, fmt: str, model_name: str, resume: bool = False,
                 ordered: bool = False, rerun_changed: bool = False) -> None:
        super().__init__(fmt, model_name)
        self.path = Path(path)
        if self.path.is_dir():
            raise OutputError(f"{self.path} is a directory; --out takes a file path, e.g. {self.path / 'results.jsonl'}")
        self.lock = OutputLock(self.path).acquire()
        try:
            self._open(resume, ordered, rerun_changed)
        except BaseException:
            self.lock.release()
            raise

    def _open(self, resume: bool, ordered: bool, rerun_changed: bool) -> None:
        self.answers: dict[Key, str | None] = {}
        self._old_keys: set[Key] = set()
        self._created = not self.path.exists()  # removed again if the run ends without a record
        self._written = 0
        if self.path.exists() and self.path.stat().st_size > 0:
            if not resume:
                raise OutputExists(
                    f"{self.path} already has results; pass --resume to continue it, or choose another --out"
                )
            self.answers, self._old_keys, good_end = _scan(self.path)
            if good_end < self.path.stat().st_size:
                self._guard(lambda: os.truncate(self.path, good_end), "repair")
        self.rerun_changed = rerun_changed
        self.changed: list[Key] = []  # answered before, but the request differs now
        self._superseded = False
        self._f = self._guard(lambda: self.path.open("a", encoding="utf-8"), "open")
        self.ordered = ordered
        self._buffer: dict[int, str] = {}
        self._next = 0
        self.closed = False

    def _guard(self, action, what: str):
        try:
            return action()
        except OSError as exc:
            raise OutputError(
                f"cannot {what} {self.path}: {exc.strerror or exc}; every record written before this "
                "point is kept, and a rerun with --resume continues from it"
            ) from None

    # -- resume -------------------------------------------------------------------------------
    def answered(self, job: Job) -> bool:
        """True when an earlier run already answered this request (same line, id and request)."""
        key: Key = (job.line, job.id)
        if key not in self.answers:
            if (None, job.id) in self.answers:  # written by a version without line numbers
                return True
            return False
        if self.answers[key] in (None, job.request_hash):
            return True
        self.changed.append(key)
        return not self.rerun_changed

    # -- writing ------------------------------------------------------------------------------
    def write(self, record: dict[str, Any], index: int | None = None) -> None:
        """Write now (completion order), or hold until every earlier index is written (--ordered)."""
        if record_key(record) in self._old_keys:
            self._superseded = True
        line = json.dumps(record, ensure_ascii=False) + "\n"
        if not self.ordered or index is None:
            self._emit(line)
        else:
            self._hold(line, index)

    def skip(self, index: int) -> None:
        """An index with nothing to write (answered in an earlier run): frees the ordered queue."""
        if self.ordered:
            self._hold("", index)

    def _hold(self, line: str, index: int) -> None:
        self._buffer[index] = line
        while self._next in self._buffer:
            self._emit(self._buffer.pop(self._next))
            self._next += 1

    def _emit(self, line: str) -> None:
        if line:
            def put() -> None:
                self._f.write(line)
                self._f.flush()  # a killed process loses at most the line being written
            self._guard(put, "write to")
            self._written += 1

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            for i in sorted(self._buffer):
                self._emit(self._buffer.pop(i))
            self._guard(lambda: (self._f.flush(), os.fsync(self._f.fileno())), "flush")
            self._f.close()
            if self._superseded:
                self._guard(self._compact, "compact")
            if self._created and not self._written:
                self.path.unlink(missing_ok=True)  # e.g. the model failed to load: leave nothing behind
        finally:
            self.lock.release()

    def _compact(self) -> None:
        """Keep only the last record of every key (a key written again in this run supersedes)."""
        last: dict[Key, int] = {}
        with self.path.open("rb") as f:
            for number, raw in enumerate(f):
                if raw.strip():
                    last[record_key(json.loads(raw))] = number
        tmp = self.path.with_name(f".{self.path.name}.compact-{os.getpid()}")
        with self.path.open("rb") as src, tmp.open("wb") as dst:
            for number, raw in enumerate(src):
                if raw.strip() and last[record_key(json.loads(raw))] == number:
                    dst.write(raw)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, self.path)  # atomic: a kill during compaction leaves the old, longer file
