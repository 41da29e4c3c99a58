"""Prefix order against file order on a retrieval-QA job: D synthetic documents of about T tokens,
Q questions on each, rows shuffled, a KV budget that holds a fraction of the documents. The same
query file is run through the same job loop a `chunkgen run` uses, once per order, on one model in
one process; the figures are the prompt tokens prefilled, the minimum any order could reach (every
distinct prefix computed once), wall time, generated tokens/s and whether the answers agree."""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from chunkgen.bench.e2e import PeakRSS
from chunkgen.llm import LLM

TEMPLATE = '''# Retrieval QA over many documents: each document is the prefix its questions share.
name = "docqa"
description = "Answer a question about the document given with it."

system = """
You answer questions about the document in the user's message. Use only what the document says,
and answer in one sentence.
"""

user = """Document {doc}:
{document}

Question: {question}"""
'''

_SUBJECTS = (
    "the northern depot",
    "the pump station",
    "the survey team",
    "the river authority",
    "the council",
    "the night shift",
    "the east wing",
    "the supplier",
    "the inspection crew",
    "the archive office",
    "the harbour master",
    "the main laboratory",
    "the rail yard",
    "the school board",
    "the clinic",
)
_VERBS = (
    "reported",
    "recorded",
    "replaced",
    "inspected",
    "ordered",
    "measured",
    "delayed",
    "approved",
    "repaired",
    "moved",
    "counted",
    "tested",
    "rejected",
    "stored",
    "shipped",
)
_OBJECTS = (
    "valves",
    "filters",
    "meters",
    "cables",
    "pallets",
    "samples",
    "permits",
    "boilers",
    "sensors",
    "tyres",
    "ledgers",
    "pipes",
    "crates",
    "lamps",
    "batteries",
)
_PLACES = (
    "near the old mill",
    "on the west quay",
    "at the ferry terminal",
    "behind the depot",
    "in the lower basin",
    "along the canal",
    "at the main gate",
    "in the north field",
)
_MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)


def _sentence(rng: random.Random) -> str:
    return (
        f"In {rng.choice(_MONTHS)} {rng.randint(1990, 2025)}, {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} "
        f"{rng.randint(2, 900)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
    )


def _document(rng: random.Random, tokenizer, n_tokens: int) -> str:
    """Sentences until the text has n_tokens tokens, cut there (the text then tokenizes to about
    n_tokens again: a cut inside a word may re-merge)."""
    parts: list[str] = []
    ids: list[int] = []
    while len(ids) < n_tokens:
        parts.append(" ".join(_sentence(rng) for _ in range(8)))
        ids = tokenizer(" ".join(parts), add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[:n_tokens]).strip()


def _question(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return f"How many {rng.choice(_OBJECTS)} did {rng.choice(_SUBJECTS)} handle?"
    if kind == 1:
        return f"What happened {rng.choice(_PLACES)}?"
    if kind == 2:
        return f"When did {rng.choice(_SUBJECTS)} last report on {rng.choice(_OBJECTS)}?"
    return f"Which {rng.choice(_OBJECTS)} were {rng.choice(_VERBS)} in {rng.choice(_MONTHS)}?"


def parse_doc_tokens(text: str) -> tuple[int, int]:
    """'300' or '300-1000': the length of each document in tokens, fixed or drawn uniformly."""
    lo, _, hi = text.partition("-")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise ValueError(f"--doc-tokens takes T or LO-HI with 1 <= LO <= HI, got {text!r}")
    return low, high


def docqa_rows(
    tokenizer, docs: int, questions: int, doc_tokens: tuple[int, int], shuffle: bool = True, seed: int = 0
) -> list[dict]:
    """Rows of the docqa template: `questions` distinct questions on each of `docs` documents, in
    document order or shuffled."""
    rng = random.Random(seed)
    rows = []
    for d in range(docs):
        document = _document(rng, tokenizer, rng.randint(*doc_tokens))
        asked: set[str] = set()
        while len(asked) < questions:
            asked.add(_question(rng))
        for q, question in enumerate(sorted(asked)):
            rows.append({"id": f"doc{d}-q{q}", "doc": d, "document": document, "question": question})
    if shuffle:
        rng.shuffle(rows)
    return rows


def write_workload(out_dir: Path, rows: list[dict]) -> tuple[Path, Path]:
    """(template, queries): files a `chunkgen run --template T --queries Q` takes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    template, queries = out_dir / "docqa.toml", out_dir / "docqa.queries.jsonl"
    template.write_text(TEMPLATE)
    queries.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return template, queries


def minimum_prefill(prompts: list[list[int]]) -> int:
    """Tokens any order must compute: the size of the prompts' token trie (each distinct prefix once)."""
    total, prev = 0, []
    for p in sorted(prompts):
        shared = 0
        for a, b in zip(p, prev):
            if a != b:
                break
            shared += 1
        total += len(p) - min(shared, len(p) - 1)  # a prompt wholly cached still computes its last token
        prev = p
    return total


def run_order(
    llm: LLM, template: Path, queries: Path, order: str, kv_memory: int, max_batch: int, max_new_tokens: int, out: Path
) -> dict:
    """One `chunkgen run` of the file in `order`, on a fresh engine (empty cache) of the given budget."""
    from chunkgen.jobs.order import PrefixOrder, RowFile
    from chunkgen.jobs.requests import open_queries, read_rows, template_jobs
    from chunkgen.jobs.run import run_job
    from chunkgen.jobs.templates import load_templates
    from chunkgen.jobs.writer import ResultWriter

    templates = load_templates(template)
    defaults = {"max_new_tokens": max_new_tokens, "ignore_eos": True}  # every answer full length, as vLLM's bench

    def to_jobs(rows):
        return template_jobs(rows, templates, defaults)

    engine = llm.new_engine(kv_memory=kv_memory, max_batch=max_batch)
    writer = ResultWriter(out, "template", model_name=Path(llm.model_path).name)
    prefix_order, row_file = None, None
    if order == "prefix":
        row_file = RowFile(str(queries))
        prefix_order, items = PrefixOrder.reading(row_file, read_rows(row_file.lines()), to_jobs)
    else:
        items = to_jobs(read_rows(open_queries(queries)))
    try:
        with PeakRSS() as rss:
            summary = run_job(engine, llm.encode, items, writer, order=prefix_order)
    finally:
        writer.close()
        if row_file is not None:
            row_file.close()
    s = engine.stats
    return dict(
        order=order,
        rows=summary.requests,
        errors=summary.errors,
        wall_s=summary.wall_s,
        order_s=summary.order_s,
        prefill_s=s.prefill_s,
        decode_s=s.decode_s,
        prompt_tokens=s.prompt_tokens,
        prefilled_tokens=s.prefilled_tokens,
        cached_tokens=summary.cached_tokens,
        cache_hit_rate=summary.cache_hit_rate,
        completion_tokens=summary.completion_tokens,
        gen_tokens_per_s=summary.tokens_per_s,
        preemptions=s.preemptions,
        kv_peak_bytes=s.kv_peak_bytes,
        rss_peak_bytes=rss.peak,
    )


def answers(path: Path) -> dict[str, str | None]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["id"]: r.get("text") for r in records}


def run_order_bench(
    llm: LLM,
    rows: list[dict],
    orders: list[str],
    kv_memory: int | None,
    max_batch: int,
    max_new_tokens: int,
    work_dir: Path | None = None,
    on_row: Callable[[dict], None] | None = None,
) -> dict:
    """Each order in turn on the same file; the answers of every order compared with the first's.
    `kv_memory` None: the K/V of a tenth of the distinct prompt tokens (whole chunks), or of two
    of the longest prompts when that is more."""
    with tempfile.TemporaryDirectory(prefix="chunkgen-bench-order-") as tmp:
        base = work_dir or Path(tmp)
        template, queries = write_workload(base, rows)
        prompts = [llm.encode(j.messages, j.data, j.layout) for j in _jobs(template, queries)]
        floor = minimum_prefill(prompts)
        if kv_memory is None:  # a tenth of the distinct tokens, and room for two of the longest prompts
            tokens = max(floor // 10, 2 * (max(map(len, prompts)) + max_new_tokens))
            kv_memory = -(-tokens // llm.config.chunk_size) * llm.engine.pool.bytes_per_slot
        results, first = [], None
        for order in orders:
            out = Path(tmp) / f"out-{order}.jsonl"
            t0 = time.perf_counter()
            row = run_order(llm, template, queries, order, kv_memory, max_batch, max_new_tokens, out)
            row["run_s"] = time.perf_counter() - t0
            got = answers(out)
            first = first or got
            row["answers_equal_to_first"] = sum(got.get(k) == v for k, v in first.items())
            row["prefill_vs_minimum"] = row["prefilled_tokens"] / floor
            results.append(row)
            if on_row:
                on_row(row)
    return {
        "rows": len(rows),
        "prompt_tokens": sum(map(len, prompts)),
        "minimum_prefill_tokens": floor,
        "kv_memory": kv_memory,
        "results": results,
    }


def _jobs(template: Path, queries: Path):
    from chunkgen.jobs.requests import open_queries, read_rows, template_jobs
    from chunkgen.jobs.templates import load_templates

    with open_queries(queries) as f:
        return list(template_jobs(read_rows(f), load_templates(template), {}))


def dump_token_ids(llm: LLM, rows: list[dict], max_new_tokens: int, path: Path) -> None:
    """The rows' prompts as token ids, in file order, as JSON (`prompts`, `max_new_tokens`), so
    another engine can be fed the very same prompts."""
    with tempfile.TemporaryDirectory() as tmp:
        template, queries = write_workload(Path(tmp), rows)
        prompts = [llm.encode(j.messages, j.data, j.layout) for j in _jobs(template, queries)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            dict(
                n_shared=0,
                n_queries=len(prompts),
                max_new_tokens=max_new_tokens,
                model_dir=str(Path(llm.model_path).resolve()),
                eos_token_id=llm.tokenizer.eos_token_id,
                prompt_lens=[len(p) for p in prompts],
                minimum_prefill_tokens=minimum_prefill(prompts),
                sha256=hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
                prompts=prompts,
            )
        )
        + "\n"
    )


PERSONA_TEMPLATE = '''# Synthetic data: one persona per row, many rows per persona.
name = "persona"
description = "Write a short reply in the voice of the persona."

system = "You write short replies in the voice of the persona the user describes."

user = """Persona: {persona}

Request: {request}"""
'''


def write_persona_rows(out_dir: Path, rows: int, prefixes: int, seed: int = 0) -> tuple[Path, Path]:
    """(template, queries): `rows` short rows over `prefixes` distinct personas, interleaved at
    random, written as they are made (a million rows take seconds and no memory)."""
    rng = random.Random(seed)
    personas = [" ".join(_sentence(rng) for _ in range(4)) for _ in range(prefixes)]
    out_dir.mkdir(parents=True, exist_ok=True)
    template, queries = out_dir / "persona.toml", out_dir / "persona.queries.jsonl"
    template.write_text(PERSONA_TEMPLATE)
    with queries.open("w") as f:
        for i in range(rows):
            f.write(
                json.dumps(
                    {
                        "id": i,
                        "persona": personas[rng.randrange(prefixes)],
                        "request": f"Say what you did in {rng.choice(_MONTHS)}, item {i}.",
                    }
                )
                + "\n"
            )
    return template, queries


def ordering_pass(template: Path, queries: Path, chunk_size: int = 64, run_rows: int | None = None) -> dict:
    """The prefix-order pass alone, as a run makes it (rows read and validated, every prompt keyed,
    keys sorted with spills, rows read again by offset and validated again), with no model run:
    its wall time and the process's peak RSS."""
    from chunkgen.jobs.order import RUN_ROWS, PrefixOrder, RowFile
    from chunkgen.jobs.requests import read_rows, template_jobs
    from chunkgen.jobs.templates import load_templates

    templates = load_templates(template)

    def to_jobs(rows):
        return template_jobs(rows, templates, {})

    row_file = RowFile(str(queries))
    order, items = PrefixOrder.reading(row_file, read_rows(row_file.lines()), to_jobs, run_rows=run_rows or RUN_ROWS)
    n, groups, last = 0, 0, None
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        for _, job in order.apply(enumerate(items), chunk_size):
            n += 1
            persona = job.data[0]
            groups += persona != last
            last = persona
        wall = time.perf_counter() - t0
    row_file.close()
    return dict(
        rows=n,
        wall_s=wall,
        keying_s=order.stats.seconds,
        reread_s=wall - order.stats.seconds,
        spilled_runs=order.stats.spilled_runs,
        prefix_runs=groups,
        rss_peak_bytes=rss.peak,
    )
