"""A whole job: query rows in, engine in the middle, records out; the CLI only wires and prints."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from chunkgen.engine import Engine, Request
from chunkgen.jobs.requests import ErrorRecord, Job
from chunkgen.jobs.results import ResultWriter, error_key


@dataclass
class JobProgress:
    done: int
    total: int
    errors: int
    generated_tokens: int
    elapsed_s: float
    running: int
    kv_used_bytes: int
    cache_hit_rate: float  # prompt tokens served from the cache / prompt tokens admitted


@dataclass
class JobSummary:
    requests: int
    skipped: int  # answered by an earlier run (--resume)
    errors: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    wall_s: float
    prefill_s: float
    decode_s: float
    kv_peak_bytes: int
    kv_unshared_peak_bytes: int

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0


def run_job(
    engine: Engine,
    encode: Callable[[list[dict[str, str]]], list[int]],
    items: Iterable[Job | ErrorRecord],
    writer: ResultWriter,
    max_context: int,
    on_progress: Callable[[JobProgress], None] | None = None,
) -> JobSummary:
    t0 = time.perf_counter()
    jobs: dict[int, Job] = {}
    requests: list[Request] = []
    skipped = errors = 0

    def fail(err: ErrorRecord, index: int) -> None:
        nonlocal errors
        errors += 1
        writer.write(writer.error_record(err), index)

    for index, item in enumerate(items):
        if isinstance(item, ErrorRecord):
            if error_key(item) in writer.done:
                skipped += 1
                writer.skip(index)
            else:
                fail(item, index)
            continue
        if item.id in writer.done:
            skipped += 1
            writer.skip(index)
            continue
        tokens = encode(item.messages)
        if len(tokens) + 1 > max_context:
            fail(ErrorRecord(item.id, item.line, "prompt",
                             f"prompt is {len(tokens)} tokens; the model's context is {max_context}"), index)
            continue
        jobs[index] = item
        requests.append(Request(index, tokens, item.params))

    engine.add(requests)
    total = len(requests)
    done = generated = 0
    prompt = cached = 0
    while engine.has_work:
        for res in engine.step():
            writer.write(writer.result_record(jobs[res.id], res), res.id)
            done += 1
            generated += res.completion_tokens
            prompt += res.prompt_tokens
            cached += res.cached_tokens
        if on_progress:
            s = engine.stats
            on_progress(JobProgress(
                done=done, total=total, errors=errors, generated_tokens=s.generated_tokens,
                elapsed_s=time.perf_counter() - t0, running=len(engine.scheduler.running),
                kv_used_bytes=engine.pool.used_bytes,
                cache_hit_rate=1 - s.prefilled_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            ))
    writer.close()
    s = engine.stats
    return JobSummary(
        requests=total, skipped=skipped, errors=errors, prompt_tokens=prompt, cached_tokens=cached,
        completion_tokens=generated, wall_s=time.perf_counter() - t0, prefill_s=s.prefill_s,
        decode_s=s.decode_s, kv_peak_bytes=s.kv_peak_bytes,
        kv_unshared_peak_bytes=s.kv_unshared_peak_bytes,
    )
