"""The job loop, in two halves that a local run and a Ray worker share.

`triage` needs the output: it writes error records for bad rows and skips what an earlier run
answered. `answer` needs the engine: it tokenizes rows a window ahead of the engine (so memory does
not grow with the file), feeds them between steps, and turns every result, or a request the engine
refused, into a record. A local run chains the two; on Ray the driver triages and workers answer.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from chunkgen.engine import Engine, Request, Result
from chunkgen.engine.engine import EngineStats
from chunkgen.engine.scheduler import first_wave_rows
from chunkgen.jobs.formats import RecordFormat
from chunkgen.jobs.ledger import is_error
from chunkgen.jobs.requests import ErrorRecord, Job
from chunkgen.jobs.writer import ResultWriter
from chunkgen.progress import Snapshot
from chunkgen.prompt import PromptTooLong
from chunkgen.scoring import ChoiceScorer

if TYPE_CHECKING:
    from chunkgen.jobs.order import PrefixOrder

Encode = Callable[[list[dict[str, str]], tuple[str, ...], "tuple | None"], list[int]]


def never() -> bool:
    return False


# What each answer adds to JobCounts; Ray workers send these fields with every record.
USAGE = ("prompt_tokens", "cached_tokens", "completion_tokens", "constrained", "matched")


@dataclass
class JobCounts:
    answered: int = 0  # answers written by this run
    failed: int = 0  # error records written by this run (bad rows, refused requests)
    skipped: int = 0  # answered by an earlier run (--resume)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    constrained: int = 0  # completions made under a JSON schema, regex or grammar
    matched: int = 0  # of those, the ones whose whole text satisfies it

    def add_usage(self, values: Callable[[str], int]) -> None:
        """Adds an answer's USAGE counts; `values` reads one by name (a Result's attribute, a row's field)."""
        for name in USAGE:
            setattr(self, name, getattr(self, name) + int(values(name)))


@dataclass
class JobProgress:
    done: int
    total: int | None  # rows in the input when known (not for a pipe)
    errors: int
    generated_tokens: int
    elapsed_s: float
    running: int
    kv_used_bytes: int
    cache_hit_rate: float  # prompt tokens served from the cache / prompt tokens admitted
    prompt_tokens_done: int = 0  # admitted (from the cache or computed)
    prompt_tokens_queued: int = 0  # of every row given to the engine so far

    def snapshot(self) -> Snapshot:
        return Snapshot(
            self.done,
            self.total,
            self.generated_tokens,
            self.prompt_tokens_done,
            self.prompt_tokens_queued,
            self.running,
        )


@dataclass
class JobSummary:
    requests: int  # answered by this run
    skipped: int
    errors: int
    changed: int  # earlier answers whose request has changed since (kept unless --rerun-changed)
    prompt_tokens: int  # of the answered rows
    cached_tokens: int  # of those, served from the prefix cache
    completion_tokens: int
    wall_s: float
    prefill_s: float  # a mixed step's time is split between these two by its rows (EngineStats)
    decode_s: float
    kv_peak_bytes: int
    kv_unshared_peak_bytes: int
    constrained: int = 0
    matched: int = 0
    interrupted: bool = False
    prefilled_tokens: int = 0  # prompt tokens computed, recomputation after preemption included
    order: str = "input"  # the order rows were answered in: input, or prefix
    order_s: float = 0.0  # of wall_s, the prefix-order pass that keys every row (order.py)
    order_head: int = 0  # rows answered in file order while the pass ran
    dtype: str = ""  # what the model ran in and why, e.g. "bf16 (auto: the CPU has native bf16 arithmetic (AMX))"
    device: str = ""  # where, and why, e.g. "cuda:0 (auto: a CUDA GPU and chunkgen's CUDA kernels)"
    kv_memory: str = ""  # the KV budget and why, e.g. "60.2 GiB (auto: 85% of the 70.8 GiB GPU memory free ...)"
    max_batch: str = ""  # the cap on sequences decoded together and why, e.g. "256 (auto: ...)"
    batch_invariant: str = ""  # whether answers depend on the batch, e.g. "on: a row's answer ..."
    peak_batch: int = 0  # the most sequences one decode step ran (the largest of any worker's)
    held_back_steps: int = 0  # steps in which sequences waited below the cap because the KV pool was full
    workers: int = 1  # engines that answered (Ray actors; 1 for a local run)
    model_loads: int = 1  # a Ray worker that died and was replaced loads the model again
    kv_peak_bytes_per_worker: list[int] = field(default_factory=list)  # kv_peak_bytes is their largest
    decode_steps: int = 0
    mixed_steps: int = 0  # of decode_steps, those that ran a prefill wave in the same forward

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def cache_hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens of the answered rows."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "cache_hit_rate": self.cache_hit_rate, "tokens_per_s": self.tokens_per_s}


def cache_hit_rate(stats: EngineStats) -> float:
    return 1 - stats.prefilled_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0


def summarize(
    counts: JobCounts, engines: list[EngineStats], changed: int, wall_s: float, interrupted: bool, workers: int = 1
) -> JobSummary:
    """The run's summary from its engines' stats: the one engine of a local run, or every Ray worker's
    (times and tokens added up, KV peaks per worker; one engine per model load, a replaced worker's too)."""
    total = EngineStats(
        prompt_tokens=sum(s.prompt_tokens for s in engines), prefilled_tokens=sum(s.prefilled_tokens for s in engines)
    )
    peaks = [s.kv_peak_bytes for s in engines]
    return JobSummary(
        requests=counts.answered,
        skipped=counts.skipped,
        errors=counts.failed,
        changed=changed,
        prompt_tokens=counts.prompt_tokens,
        cached_tokens=counts.cached_tokens,
        completion_tokens=counts.completion_tokens,
        wall_s=wall_s,
        prefill_s=sum(s.prefill_s for s in engines),
        decode_s=sum(s.decode_s for s in engines),
        kv_peak_bytes=max(peaks, default=0),
        kv_unshared_peak_bytes=max((s.kv_unshared_peak_bytes for s in engines), default=0),
        constrained=counts.constrained,
        matched=counts.matched,
        interrupted=interrupted,
        workers=workers,
        model_loads=len(engines),
        prefilled_tokens=total.prefilled_tokens,
        kv_peak_bytes_per_worker=peaks,
        peak_batch=max((max(s.batch_sizes, default=0) for s in engines), default=0),
        decode_steps=sum(s.decode_steps for s in engines),
        mixed_steps=sum(s.mixed_steps for s in engines),
        held_back_steps=sum(s.held_back_steps for s in engines),
    )


def triage(items: Iterable[Job | ErrorRecord], writer: ResultWriter, counts: JobCounts) -> Iterator[tuple[int, Job]]:
    """The rows still to answer, numbered in input order; bad rows become error records here."""
    for index, item in enumerate(items):
        if isinstance(item, ErrorRecord):
            writer.write(writer.format.error_record(item), index)
            counts.failed += 1
        elif writer.answered(item):
            writer.skip(index)
            counts.skipped += 1
        else:
            yield index, item


@dataclass
class Answer:
    index: int
    record: dict
    result: Result | None = None


def kv_shortfall(engine: Engine, tokens: int, job: Job) -> str | None:
    """Why the KV budget cannot hold this row's samples at once (each sample's answer in chunks of
    its own beside the shared prompt), with the budget that would; None when it can."""
    pool, chunk = engine.pool, engine.config.chunk_size
    n, new = job.params.n, job.params.max_new_tokens
    slots = tokens // chunk + n * -(-(tokens % chunk + new) // chunk)
    if slots <= pool.max_slots:
        return None
    from chunkgen.device import human_bytes

    return (
        f"the KV budget ({human_bytes(pool.max_slots * pool.bytes_per_slot)}) cannot hold line {job.line}'s {n} "
        f"sample(s) of up to {new} tokens beside its {tokens}-token prompt at once, so such rows run a few "
        f"samples at a time, many times slower; --kv-memory {human_bytes(slots * pool.bytes_per_slot)} would hold them"
    )


def batch_shortfall(engine: Engine) -> str | None:
    """Why fewer rows ran at once than --max-batch allows (the KV budget was full while rows
    waited), with a budget that would hold a full batch of rows like these; None when it did not."""
    running, max_batch = engine.num_running, engine.config.max_batch
    if not engine.stats.held_back_steps or running >= max_batch or running == 0:
        return None
    from chunkgen.device import human_bytes

    pool = engine.pool
    # The live rows' chunks scaled to a full batch: shared chunks counted again, so it is enough.
    enough = pool.used_bytes * max_batch // running
    return (
        f"the KV budget ({human_bytes(pool.max_slots * pool.bytes_per_slot)}) holds {running} rows' prompts at "
        f"once where --max-batch allows {max_batch}, so rows wait for memory; --kv-memory {human_bytes(enough)} "
        f"would hold {max_batch} rows like these"
    )


def answer(
    engine: Engine,
    encode: Encode,
    fmt: RecordFormat,
    jobs: Iterable[tuple[int, Job]],
    window: int = 256,
    should_stop: Callable[[], bool] = never,
    on_step: Callable[[], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    in_prefix_order: bool = False,
    stop_now: Callable[[], bool] | None = None,
    expected_rows: int | None = None,
) -> Iterator[Answer]:
    """Records for `jobs` as the engine finishes them. Rows are tokenized and queued only while
    fewer than `window` wait, so the engine is never starved and the rest of the file stays unread;
    and between two steps no more than the engine can take soon: one row before the first step
    (in a job whose rows share a prompt the first wave is the first row alone anyway: the others
    wait for the shared chunks it computes), then twice what the last step took from the queue, or
    a first wave's worth (first_wave_rows) when that is more, so the queue grows to the window over
    a few steps instead of the first answer waiting while a whole window is read and tokenized
    (about 7 ms a row of a 1,700-token prompt on a 2-core Zen 3: 7 s for a window of 1,024 rows).
    A source may yield None for "nothing ready yet, more to come" (a Ray worker between deliveries):
    the engine steps on with what it has. `in_prefix_order`: the jobs come in prefix order, so the
    engine releases a finished row's chunks as soon as no queued row can share them (rows further
    on cannot either); once the source is spent it does so whatever the order. Not once a row with
    choices came: its choices are queued when its prompt is done, to share the prompt's chunks.

    Once `should_stop` says so, no row is read or started: the queued ones are dropped (a resume
    answers them) and the rows in flight run on to their answers, until `stop_now` (default:
    should_stop itself, which gives up the rows in flight at once). `expected_rows`: how many rows
    the source holds, when known (a job of more than one batch opens it in parts:
    Scheduler.running_cap)."""
    source = iter(jobs)
    pending: dict[int, Job] = {}
    scorer = ChoiceScorer()  # rows with choices: each choice scored after the row's prompt
    usage: dict[int, list[int]] = {}  # such a row's prompt and cached tokens so far, over its choices
    answer_ids = _choice_tokenizer(getattr(engine, "tokenizer", None))
    exhausted = idle = False
    warned = warned_batch = False
    first_fill = first_wave_rows(engine.config.max_batch, "max_batch" in engine.config.auto)
    fill = 1  # the most rows queued before the next step
    before = engine.later_rows
    engine.later_rows = keep = "prefix" if in_prefix_order else before
    stop_now = stop_now or should_stop
    draining = False
    engine.expected_rows = expected_rows or 0
    try:
        while not stop_now():
            if not draining and should_stop():
                draining = exhausted = True
                engine.drop_waiting()
            if not exhausted and engine.num_waiting < window:
                batch: list[Request] = []
                want = min(window - engine.num_waiting, fill)
                taken = 0
                idle = False
                for item in itertools.islice(source, want):
                    if item is None:
                        idle = True
                        break
                    index, job = item
                    taken += 1
                    try:
                        tokens = encode(job.source, job.data, job.layout)
                    except PromptTooLong as exc:  # refused before it was tokenized
                        yield Answer(
                            index, fmt.error_record(ErrorRecord(job.id, job.line, "prompt", str(exc)), job.request_hash)
                        )
                        continue
                    except Exception as exc:  # e.g. the model's chat template rejects these messages
                        err = ErrorRecord(job.id, job.line, "messages", f"the model's chat template failed: {exc}")
                        yield Answer(index, fmt.error_record(err, job.request_hash))
                        continue
                    if on_note is not None and not warned and (why := kv_shortfall(engine, len(tokens), job)):
                        on_note(why)  # once a job: every such row is slow for the same reason
                        warned = True
                    pending[index] = job
                    if job.choices is None:
                        batch.append(Request(index, tokens, job.params))
                        continue
                    # Its choices are queued once its prompt is done, to share the prompt's chunks:
                    # no releasing them when the prompt finishes (for the rest of the job).
                    engine.later_rows = keep = "unknown"
                    batch.append(scorer.start(index, tokens, [answer_ids(c) for c in job.choices]))
                    usage[index] = [0, 0]
                exhausted = taken < want and not idle
                if batch:
                    engine.add(batch)  # one call per window: the scheduler groups shared prefixes within it
                if exhausted and keep != "unknown":
                    engine.later_rows = "none"  # every row still to answer is queued
            if not engine.has_work:
                if exhausted:
                    return
                if idle and on_step:
                    on_step()  # the source is busy (the prefix order's keying): no step is running
                continue
            queued = engine.num_waiting
            results = engine.step()
            fill = max(first_fill, 2 * (queued - engine.num_waiting))
            for res in results:
                if not scorer.owns(res.id):
                    yield Answer(res.id, fmt.result_record(pending.pop(res.id), res), res)
                    continue
                follow, index, done = scorer.finished(res)
                if follow and not draining:  # a row's choices are new rows: not started once stopping
                    engine.add(follow)
                if index in usage:
                    usage[index][0] += res.prompt_tokens
                    usage[index][1] += res.cached_tokens
                if done is None:
                    continue
                job, (prompt_tokens, cached) = pending.pop(index), usage.pop(index)
                if isinstance(done, str):
                    yield Answer(index, fmt.result_record(job, res), res)  # the error record
                else:
                    whole = Result(index, prompt_tokens, cached, [])
                    yield Answer(index, fmt.choices_record(job, done, whole), whole)
            if on_note is not None and not warned_batch and (why := batch_shortfall(engine)):
                on_note(why)  # once a job: the budget, not a row, is what limits the batch
                warned_batch = True
            if on_step:
                on_step()
    finally:
        engine.later_rows = before
        engine.expected_rows = 0


def _choice_tokenizer(tokenizer) -> Callable[[str], list[int]]:
    """A choice's token ids: its text tokenized alone, as the answer's first tokens after the
    prompt (a template's choices are the same for every row: tokenized once)."""

    @functools.lru_cache(maxsize=1024)
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return ids


def run_job(
    engine: Engine,
    encode: Encode,
    items: Iterable[Job | ErrorRecord],
    writer: ResultWriter,
    total: int | None = None,
    window: int | None = None,
    should_stop: Callable[[], bool] = never,
    on_progress: Callable[[JobProgress], None] | None = None,
    order: PrefixOrder | None = None,
    on_note: Callable[[str], None] | None = None,
    stop_now: Callable[[], bool] | None = None,
) -> JobSummary:
    """A whole local job: rows in, records out, nothing held but the window in flight. With an
    `order`, the rows still to answer are answered in prefix order (bad rows and rows answered
    before are dealt with first, in file order). `should_stop` and `stop_now`: as `answer`'s."""
    t0 = time.perf_counter()
    counts = JobCounts()
    window = window or engine.config.window

    def report() -> None:
        if on_progress:
            s = engine.stats
            on_progress(
                JobProgress(
                    done=counts.answered + counts.failed + counts.skipped,
                    total=total,
                    errors=counts.failed,
                    generated_tokens=s.generated_tokens,
                    elapsed_s=time.perf_counter() - t0,
                    running=engine.num_running,
                    kv_used_bytes=engine.pool.used_bytes,
                    cache_hit_rate=cache_hit_rate(s),
                    prompt_tokens_done=s.prompt_tokens,
                    prompt_tokens_queued=s.queued_prompt_tokens,
                )
            )

    jobs = triage(items, writer, counts)
    if order is not None:
        jobs = order.apply(jobs, engine.config.chunk_size, should_stop)
    left = None if total is None else max(0, total - len(writer.answers))  # a resume's rows to answer
    in_prefix_order = order is not None
    answers = answer(
        engine, encode, writer.format, jobs, window, should_stop, report, on_note, in_prefix_order, stop_now, left
    )
    for a in answers:
        writer.write(a.record, a.index)
        if is_error(a.record):
            counts.failed += 1
        else:
            counts.answered += 1
        if a.result is not None and a.result.error is None:
            counts.add_usage(functools.partial(getattr, a.result))
    interrupted = should_stop()
    writer.close(complete=not interrupted)
    summary = summarize(counts, [engine.stats], len(writer.changed), time.perf_counter() - t0, interrupted)
    if order is not None:
        summary.order, summary.order_s, summary.order_head = "prefix", order.stats.seconds, order.stats.head
    return summary
