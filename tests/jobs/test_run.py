"""A job's memory follows its work: `chunkgen run` over rows that share nothing holds resident
memory flat once it runs, where keeping every finished row's chunks would grow it by the rows'
K/V (a subprocess, its RSS sampled from /proc)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, build_tiny_model

ROWS = 1200
CHUNK_BYTES = 2 * 4 * 4 * 64 * 64 * 4  # K and V of a 64-token chunk: 4 layers, 4 KV heads of 64, fp32: 512 KiB


@pytest.fixture(scope="module")
def wide_kv_model(tmp_path_factory) -> Path:
    """Little compute per token, much K/V per chunk: the cache, not the model, is what grows."""
    return build_tiny_model(
        tmp_path_factory.mktemp("wide-kv"),
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
    )


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_rss_stays_flat_over_a_job_of_rows_that_share_nothing(wide_kv_model, tmp_path):
    rng = random.Random(0)
    queries, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    with queries.open("w") as f:
        for i in range(ROWS):  # token-id prompts: no two rows share a chunk's worth of anything
            body = {"prompt": [rng.randrange(10, 400) for _ in range(20)], "max_tokens": 1}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    cmd = [sys.executable, "-m", "chunkgen", "run", "-q", str(queries), "-o", str(out), "--model", str(wide_kv_model)]
    cmd += ["--chunk-size", "64", "--kv-memory", "2GiB", "--max-batch", "64", "--dtype", "fp32", "--json-log"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples: list[tuple[int, int]] = []  # (answers written, RSS)
    written = 0
    with out.parent.joinpath("out.jsonl").open("a+b") as watch:
        while proc.poll() is None:
            watch.seek(0)
            written = watch.read().count(b"\n")
            samples.append((written, _rss(proc.pid)))
            time.sleep(0.02)
    _, err = proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    summary = json.loads([line for line in err.splitlines() if '"summary"' in line or '"requests"' in line][-1])
    summary = summary.get("summary", summary)
    assert summary["requests"] == ROWS
    # Once a sixth of the rows are answered, the batch's chunks and the pool's first slabs are
    # backed: from there RSS grows by much less than the chunks of the rows still to come, which a
    # cache keeping them (all fit the 2 GiB budget) would add (1,000 x 512 KiB).
    settled = [rss for n, rss in samples if n >= ROWS // 6 and rss]
    assert len(settled) > 5
    growth = max(settled) - settled[0]
    assert growth < 100 * CHUNK_BYTES, f"RSS grew {growth / 2**20:.0f} MiB over the job"
    # The summary's peak counts what the running rows read: a batch of 64 rows' chunks, not the cache.
    assert summary["kv_peak_bytes"] <= 80 * CHUNK_BYTES


def test_rows_are_tokenized_a_wave_ahead_not_a_window_ahead(tiny_llm):
    """Before the first step one row is tokenized (the first answer does not wait for a window's
    tokenizing), then at most twice what the last step took from the queue (or a first wave's
    size), so the queue grows to the window over steps; every row is answered once."""
    from chunkgen.engine import SamplingParams
    from chunkgen.engine.scheduler import first_wave_rows
    from chunkgen.jobs.formats import RecordFormat
    from chunkgen.jobs.requests import Job
    from chunkgen.jobs.run import answer

    engine = tiny_llm.new_engine()
    rows, window = 150, 64
    first = first_wave_rows(engine.config.max_batch, "max_batch" in engine.config.auto)
    assert first < window  # else there is nothing to tell apart
    encoded = 0

    def encode(*args):
        nonlocal encoded
        encoded += 1
        return tiny_llm.encode(*args)

    seen: list[tuple[int, int, int]] = []  # (rows tokenized, queued before, queued after) at each step
    step = engine.step

    def counted_step():
        before = engine.num_waiting
        out = step()
        seen.append((encoded, before, engine.num_waiting))
        return out

    engine.step = counted_step
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    jobs = (
        (i, Job(f"r{i}", i + 1, [{"role": "user", "content": f"row {i} " * (1 + i % 5)}], params)) for i in range(rows)
    )
    got = [a.index for a in answer(engine, encode, RecordFormat("template", "m"), jobs, window)]
    assert sorted(got) == list(range(rows))
    assert seen[0][0] == 1  # a window would be 64
    for (done, before, after), (now, _, _) in zip(seen, seen[1:]):
        assert now - done <= max(first, 2 * (before - after))


@pytest.mark.parametrize("drain", [True, False])
def test_a_stop_lets_the_rows_in_flight_finish_and_starts_no_other(tiny_llm, drain):
    """Once should_stop says so, no queued row starts; the rows then running are answered, every
    one of them, unless stop_now cuts them short (here: at once, the old stop after a step)."""
    from chunkgen.engine import SamplingParams
    from chunkgen.jobs.formats import RecordFormat
    from chunkgen.jobs.requests import Job
    from chunkgen.jobs.run import answer, never

    engine = tiny_llm.new_engine(max_batch=8)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    fmt = RecordFormat("template", "m")
    finished: set[int] = set()
    asked: list[tuple[set[int], set[int]]] = []  # (rows running, rows finished) when the stop was asked
    step = engine.step

    def stepping():
        results = step()
        finished.update(r.id for r in results)
        if not asked and len(finished) >= 3:
            asked.append(({s.request.id for s in engine.scheduler.running}, set(finished)))
        return results

    engine.step = stepping
    stop = lambda: bool(asked)  # noqa: E731
    jobs = (
        (i, Job(f"r{i}", i + 1, [{"role": "user", "content": f"row {i} " * (1 + i % 5)}], params)) for i in range(60)
    )
    got = {a.index for a in answer(engine, tiny_llm.encode, fmt, jobs, 32, stop, stop_now=never if drain else None)}
    in_flight, done = asked[0]
    assert in_flight and done and len(got) < 60
    if drain:
        assert got == done | in_flight  # every row in flight, and no other
        assert not engine.has_work and engine.num_waiting == 0
    else:
        assert got == done  # stopped after the step: the rows in flight are left to a resume
        engine.drop_waiting()
        list(engine.stream())  # the shared model's KV memory free for the next test's engine


def test_a_resumed_job_announces_only_the_rows_it_has_left(tiny_llm, tmp_path):
    """The scheduler hears how many rows a job has (a job of more than one batch opens it in
    parts); a resume that has 5 rows of 40 left announces 5, not the file's 40."""
    from chunkgen.jobs.requests import read_rows, template_jobs
    from chunkgen.jobs.run import run_job
    from chunkgen.jobs.templates import load_templates
    from chunkgen.jobs.writer import ResultWriter
    from tests.helpers import PROMPTS, records

    queries, out = tmp_path / "q.jsonl", tmp_path / "out.jsonl"
    templates = load_templates(PROMPTS / "arithmetic_cot.toml")

    def run(rows: int, resume: bool) -> list[int]:
        queries.write_text("".join(json.dumps({"id": f"r{i}", "question": f"{i} + {i}?"}) + "\n" for i in range(rows)))
        engine = tiny_llm.new_engine(max_batch=8)
        heard, step = [], engine.step

        def stepping():
            heard.append(engine.expected_rows)
            return step()

        engine.step = stepping
        writer = ResultWriter(out, "template", "tiny", resume=resume)
        with queries.open("rb") as f:
            jobs = template_jobs(read_rows(f), templates, {"max_new_tokens": 1})
            run_job(engine, tiny_llm.encode, jobs, writer, total=rows, window=16)
        return heard

    assert set(run(35, resume=False)) == {35}
    assert set(run(40, resume=True)) == {5}
    assert sorted(r["id"] for r in records(out)) == sorted(f"r{i}" for i in range(40))
