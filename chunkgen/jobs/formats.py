"""Output records: a finished request or an error as chunkgen's own JSON line, or as OpenAI batch
output. Apart from the writer so that remote workers format what the driver writes."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Any

from chunkgen.engine.sequence import Completion, Result
from chunkgen.jobs.ledger import FORMAT_VERSION
from chunkgen.jobs.requests import ErrorRecord, Job


def encode_record(record: dict[str, Any]) -> bytes:
    """One JSON line. Text with a lone surrogate (no UTF-8 form) is written with \\u escapes instead."""
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(record) + "\n").encode("ascii")


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

    def __init__(self, fmt: str, model_name: str, id_field: str = "id") -> None:
        self.fmt = fmt
        self.model_name = model_name
        self.id_field = id_field  # recorded when not `id`: a resume reading ids from another field is refused

    def result_record(self, job: Job, res: Result) -> dict[str, Any]:
        if res.error is not None:
            field = job.constraint_field if res.error_field == "constraint" else "prompt"
            return self._keyed(
                self.error_record(ErrorRecord(job.id, job.line, field, res.error), job.request_hash), job
            )
        if self.fmt == "openai":
            body = {
                "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": None if c.logprobs is None else {"content": _logprobs(c), "refusal": None},
                        "finish_reason": c.finish_reason,
                    }
                    for i, c in enumerate(res.completions)
                ],
                "usage": {
                    "prompt_tokens": res.prompt_tokens,
                    "completion_tokens": res.completion_tokens,
                    "total_tokens": res.prompt_tokens + res.completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": res.cached_tokens},
                },
            }
            return {
                "id": f"batch_req_{uuid.uuid4().hex[:24]}",
                "custom_id": job.id,
                "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
                "error": None,
                "line": job.line,
                "request_hash": job.request_hash,
                "chunkgen": FORMAT_VERSION,
            }
        rec: dict[str, Any] = {
            "id": job.id,
            "line": job.line,
            "template": job.template,
            "text": res.text,
            "finish_reason": res.finish_reason,
            "usage": {
                "prompt_tokens": res.prompt_tokens,
                "cached_tokens": res.cached_tokens,
                "completion_tokens": res.completion_tokens,
            },
            "sampling": _sampling(job),
            "request_hash": job.request_hash,
            "chunkgen": FORMAT_VERSION,
            **_extras(res.completions[0]),
        }
        if len(res.completions) > 1:
            rec["completions"] = [
                {"text": c.text, "finish_reason": c.finish_reason, **_extras(c)} for c in res.completions
            ]
        return self._keyed(rec, job)

    def _keyed(self, rec: dict[str, Any], job: Job) -> dict[str, Any]:
        """A row without an id: its record also names the request and occurrence it answers; a row
        whose id came from a field other than `id`: its record names the field."""
        if job.occurrence is not None:
            rec["row_key"] = job.key
        elif self.id_field != "id" and self.fmt != "openai":
            rec["id_field"] = self.id_field
        return rec

    def error_record(self, err: ErrorRecord, request_hash: str | None = None) -> dict[str, Any]:
        if self.fmt == "openai":
            return {
                "id": f"batch_req_{uuid.uuid4().hex[:24]}",
                "custom_id": err.id,
                "response": None,
                "error": {"code": "invalid_request", "line": err.line, "field": err.field, "message": err.message},
                "line": err.line,
                "request_hash": request_hash,
                "chunkgen": FORMAT_VERSION,
            }
        return {
            "id": err.id,
            "line": err.line,
            "error": {"field": err.field, "message": err.message},
            "request_hash": request_hash,
            "chunkgen": FORMAT_VERSION,
        }
