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
from chunkgen.scoring import ContinuationScore, best_index


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


def _prompt_logprobs(res: Result) -> list[dict | None]:
    """Each prompt token's entry (None for the first), in the Chat Completions logprobs shape."""
    return [None if e is None else e.as_openai() for e in res.prompt_logprobs or []]


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
        if self.fmt == "openai" and job.prompt is not None:
            return self._openai_record(job, _completions_body(job, res, self.model_name))
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
            if res.prompt_logprobs is not None:  # vLLM's extension of the body
                body["prompt_logprobs"] = _prompt_logprobs(res)
            return self._openai_record(job, body)
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
        if res.prompt_logprobs is not None:
            rec["prompt_logprobs"] = _prompt_logprobs(res)
        if len(res.completions) > 1:
            rec["completions"] = [
                {"text": c.text, "finish_reason": c.finish_reason, **_extras(c)} for c in res.completions
            ]
        return self._keyed(rec, job)

    def choices_record(self, job: Job, scores: list[ContinuationScore], res: Result) -> dict[str, Any]:
        """A choices row's answer: each choice's total logprob after the prompt, its length in
        tokens, whether it is the greedy continuation; `text` and `choice` name the likeliest."""
        assert job.choices is not None
        best = best_index(scores)
        rec: dict[str, Any] = {
            "id": job.id,
            "line": job.line,
            "template": job.template,
            "text": job.choices[best],
            "choice": best,
            "choices": [
                {"text": c, "logprob": s.logprob, "num_tokens": s.num_tokens, "greedy": s.greedy}
                for c, s in zip(job.choices, scores)
            ],
            "usage": {"prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens, "completion_tokens": 0},
            "request_hash": job.request_hash,
            "chunkgen": FORMAT_VERSION,
        }
        return self._keyed(rec, job)

    @staticmethod
    def _openai_record(job: Job, body: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": f"batch_req_{uuid.uuid4().hex[:24]}",
            "custom_id": job.id,
            "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
            "error": None,
            "line": job.line,
            "request_hash": job.request_hash,
            "chunkgen": FORMAT_VERSION,
        }

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


def _completions_body(job: Job, res: Result, model_name: str) -> dict[str, Any]:
    """A /v1/completions response body: each choice's text (after the prompt's with echo) and, when
    logprobs were asked, OpenAI's tokens / token_logprobs / top_logprobs / text_offset, the
    prompt's tokens first with echo (the first of them has no logprob)."""
    prompt_texts = res.prompt_token_texts or []
    if job.echo:
        echoed = job.prompt if isinstance(job.prompt, str) else "".join(prompt_texts)
    choices = []
    for i, c in enumerate(res.completions):
        logprobs = None
        if job.params.logprobs is not None:
            entries: list = list(res.prompt_logprobs or []) if job.echo else []
            texts = list(prompt_texts) if job.echo else []
            entries += c.logprobs or []
            texts += [e.token for e in c.logprobs or []]
            offsets, at = [], 0
            for t in texts:
                offsets.append(at)
                at += len(t)
            logprobs = {
                "tokens": texts,
                "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else {t.token: t.logprob for t in e.top} for e in entries],
                "text_offset": offsets,
            }
        text = echoed + c.text if job.echo else c.text
        choices.append({"text": text, "index": i, "logprobs": logprobs, "finish_reason": c.finish_reason})
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:24]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": res.cached_tokens},
        },
    }
