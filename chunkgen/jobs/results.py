"""Streaming JSONL results: one flushed line per finished request, resumable after a kill."""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from chunkgen.engine.sequence import Result
from chunkgen.jobs.requests import ErrorRecord, Job


class OutputExists(FileExistsError):
    pass


def error_key(err: ErrorRecord) -> str:
    return err.id if err.id is not None else f"line:{err.line}"


def _repair_and_read(path: Path) -> set[str]:
    """Ids already answered; a truncated last line (a killed run) is cut off the file."""
    done: set[str] = set()
    good_end = 0
    with path.open("rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # no newline: the writer died mid-line
        line = data[pos:nl]
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            line_no = data.count(b"\n", 0, pos) + 1
            raise ValueError(f"{path}: line {line_no} is not a result record; "
                             "refusing to resume into a file chunkgen did not write") from None
        key = rec.get("custom_id", rec.get("id")) if "custom_id" in rec else rec.get("id")
        if key is None:
            err = rec.get("error") or {}
            key = f"line:{err.get('line', rec.get('line'))}"
        done.add(str(key))
        pos = good_end = nl + 1
    if good_end < len(data):
        with path.open("r+b") as f:
            f.truncate(good_end)
    return done


class RecordFormat:
    """Turns results and errors into output records: chunkgen's own lines, or OpenAI batch output.
    Separate from the writer so remote workers can format what the driver writes."""

    def __init__(self, fmt: str, model_name: str) -> None:
        self.fmt = fmt
        self.model_name = model_name

    # -- records ------------------------------------------------------------------------------
    def result_record(self, job: Job, res: Result) -> dict[str, Any]:
        usage = {"prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens,
                 "completion_tokens": res.completion_tokens}
        if self.fmt == "openai":
            body = {
                "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                             "finish_reason": c.finish_reason} for i, c in enumerate(res.completions)],
                "usage": {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
                          "total_tokens": res.prompt_tokens + res.completion_tokens,
                          "prompt_tokens_details": {"cached_tokens": res.cached_tokens}},
            }
            return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": job.id,
                    "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
                    "error": None}
        rec: dict[str, Any] = {"id": job.id, "template": job.template, "text": res.text,
                               "finish_reason": res.finish_reason, "usage": usage,
                               "sampling": job.params.as_dict()}
        if len(res.completions) > 1:
            rec["completions"] = [{"text": c.text, "finish_reason": c.finish_reason} for c in res.completions]
        return rec

    def error_record(self, err: ErrorRecord) -> dict[str, Any]:
        if self.fmt == "openai":
            return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": err.id, "response": None,
                    "error": {"code": "invalid_request", "line": err.line, "field": err.field,
                              "message": err.message}}
        return {"id": err.id, "line": err.line, "error": {"field": err.field, "message": err.message}}


class ResultWriter(RecordFormat):
    def __init__(self, path: str | Path, fmt: str, model_name: str, resume: bool = False,
                 ordered: bool = False) -> None:
        super().__init__(fmt, model_name)
        self.path = Path(path)
        self.done: set[str] = set()
        if self.path.exists() and self.path.stat().st_size > 0:
            if not resume:
                raise OutputExists(
                    f"{self.path} already has results; pass --resume to continue it, or choose "
                    "another --out"
                )
            self.done = _repair_and_read(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")
        self.ordered = ordered
        self._buffer: dict[int, str] = {}
        self._next = 0
        self.results = 0
        self.errors = 0

    # -- writing ------------------------------------------------------------------------------
    def write(self, record: dict[str, Any], index: int | None = None) -> None:
        """Write now (completion order), or hold until every earlier index is written (--ordered)."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        if not self.ordered or index is None:
            self._emit(line)
            return
        self.write_record_line(line, index)

    def skip(self, index: int) -> None:
        """An index with nothing to write (answered in an earlier run): frees the ordered queue."""
        if self.ordered:
            self.write_record_line("", index)

    def write_record_line(self, line: str, index: int) -> None:
        self._buffer[index] = line
        while self._next in self._buffer:
            self._emit(self._buffer.pop(self._next))
            self._next += 1

    def _emit(self, line: str) -> None:
        if line:
            self._f.write(line)
            self._f.flush()  # a killed process loses at most the line being written

    def close(self) -> None:
        for i in sorted(self._buffer):
            self._emit(self._buffer.pop(i))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
