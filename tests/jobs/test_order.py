"""Prefix order: keys, the external sort, re-reading rows by offset, and whole runs in each order."""

from __future__ import annotations

import io
import json
import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkgen.jobs.order import ExternalSort, PrefixOrder, QueryFileChanged, RowFile, key_cuts, prompt_key
from chunkgen.jobs.requests import read_rows, template_jobs
from chunkgen.jobs.templates import load_templates
from tests.helpers import PROMPTS, base_args


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["", "You route.", "You answer."]), st.text("ab\x1e", max_size=70)),
        min_size=2,
        max_size=30,
    )
)
def test_prompt_keys_walk_the_prefix_tree_depth_first(rows):
    """Sorting by key puts the rows sharing their system prompt and the first k pieces of their
    last message in one contiguous run, for every cut the key makes (fine, then doubling)."""
    piece, depth = 4, 8
    prompts = [([{"role": "system", "content": s}] if s else []) + [{"role": "user", "content": u}] for s, u in rows]
    order = sorted(range(len(rows)), key=lambda i: (prompt_key(prompts[i], piece, depth), i))
    # Each row's cuts: a system prompt takes the key's first entry, the last message the rest.
    cuts = {s: [0] + key_cuts(piece, depth - 1) if s else key_cuts(piece, depth) for s, _ in rows}
    for level in range(depth):
        groups = []
        for i in order:
            system, text = rows[i]
            cut = cuts[system][level]
            groups.append((system, text[:cut]) if len(text) >= cut and (cut or system) else None)
        seen, last = set(), None
        for g in groups:
            if g is not None and g != last:
                assert g not in seen, f"rows sharing {g} are split"
                seen.add(g)
            last = g


def test_prompt_key_agrees_on_exactly_the_shared_pieces():
    assert key_cuts(8, 6) == [8, 16, 24, 48, 96, 192]
    system = {"role": "system", "content": "You route requests."}
    a = prompt_key([system, {"role": "user", "content": "rain in Oslo? " * 4}], 8)
    b = prompt_key([system, {"role": "user", "content": "rain in Bergen? " * 4}], 8)
    c = prompt_key(
        [{"role": "user", "content": "You route requests."}, {"role": "user", "content": "rain in Oslo? " * 4}], 8
    )
    assert a[:16] == b[:16] and a[16:24] != b[16:24]  # the system prompt and "rain in ", then Oslo against Bergen
    assert a[:8] != c[:8]  # the same text in another role is another prompt
    assert prompt_key([system], 8, depth=4) == prompt_key([system], 8)  # 19 characters: cut alike at both depths
    assert prompt_key([], 8) == b""


@pytest.mark.parametrize("run_rows", [3, 1000])
def test_external_sort_spills_runs_and_merges_them_in_order(run_rows, tmp_path):
    rng = random.Random(0)
    entries = [
        (bytes(rng.randrange(4) for _ in range(rng.randrange(0, 5))), i, i + 1, 10 * i, i % 7, i % 3 - 1)
        for i in range(200)
    ]
    sorter = ExternalSort(run_rows=run_rows, spill_dir=str(tmp_path))
    for e in entries:
        sorter.add(*e)
    assert sorter.spilled_runs == (len(entries) // run_rows)
    assert list(sorter) == sorted(entries)
    sorter.close()


def _order_of(tmp_path, lines: list[str], source: str = "file", run_rows: int = 2):
    """The ids of the template rows of `lines` in prefix order, keyed by a stand-in tokenizer."""
    templates = load_templates(PROMPTS / "document_qa.toml")
    path = tmp_path / "q.jsonl"
    path.write_text("".join(l + "\n" for l in lines))
    if source == "stdin":
        sys.stdin = io.TextIOWrapper(io.BytesIO(path.read_bytes()))
        row_file = RowFile("-", spool_dir=str(tmp_path))
    else:
        row_file = RowFile(str(path))

    def to_jobs(rows):
        return template_jobs(rows, templates, {})

    order, items = PrefixOrder.reading(row_file, read_rows(row_file.lines()), to_jobs, run_rows=run_rows)
    jobs = ((i, item) for i, item in enumerate(items) if not hasattr(item, "message"))

    try:
        return [(i, job.id, job.line) for i, job in order.apply(jobs, chunk_size=1)], order
    finally:
        row_file.close()
        sys.stdin = sys.__stdin__


@pytest.mark.parametrize("source", ["file", "stdin"])
def test_rows_are_reread_by_offset_grouped_by_prefix(tmp_path, source):
    rng = random.Random(1)
    rows = [{"id": f"{d}-{q}", "question": f"doc {d} " * 3 + f"question {q}"} for d in range(6) for q in range(3)]
    rng.shuffle(rows)
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, "not json")  # an error row: not ordered, never re-read
    lines.insert(7, "")
    got, order = _order_of(tmp_path, lines, source)
    assert len(got) == len(rows) and order.stats.rows == len(rows) and order.stats.spilled_runs > 0
    docs = [i.split("-")[0] for _, i, _ in got]
    assert len([d for j, d in enumerate(docs) if j == 0 or d != docs[j - 1]]) == 6  # one run per document
    by_line = {l: json.loads(s)["id"] for l, s in enumerate(lines, start=1) if s.startswith("{")}
    assert all(by_line[line] == rid for _, rid, line in got)  # each row read back from its own line
    first_index = {rid: i for i, rid, _ in got}
    assert sorted(first_index.values()) == sorted(
        i for i, s in enumerate(l for l in lines if l.strip()) if s.startswith("{")
    )


def test_a_row_changed_between_the_passes_is_an_error_naming_its_line(tmp_path):
    templates = load_templates(PROMPTS / "document_qa.toml")
    path = tmp_path / "q.jsonl"
    path.write_text('{"id": "a", "question": "one"}\n{"id": "b", "question": "two"}\n')
    row_file = RowFile(str(path))
    order, items = PrefixOrder.reading(
        row_file, read_rows(row_file.lines()), lambda rows: template_jobs(rows, templates, {})
    )

    def jobs():
        yield from enumerate(items)
        path.write_text('{"id": "a", "question": "uno"}\n{"id": "b", "question": "two"}\n')

    with pytest.raises(QueryFileChanged, match="line 1 changed"):
        list(order.apply(jobs(), chunk_size=4))
    row_file.close()


def test_a_large_file_feeds_rows_in_file_order_while_the_rest_is_keyed(tmp_path, monkeypatch):
    """Past HEAD_AFTER rows, the first HEAD_ROWS go on in file order, then every SAMPLE_EVERY-th row
    as it is keyed (so the engine always has rows while the pass runs); every other row follows
    once, in key order (one run per document); the rows handed on are a function of the counts."""
    from chunkgen.jobs import order as order_mod

    monkeypatch.setattr(order_mod, "HEAD_AFTER", 8)
    monkeypatch.setattr(order_mod, "HEAD_ROWS", 3)
    monkeypatch.setattr(order_mod, "SAMPLE_EVERY", 4)
    rng = random.Random(2)
    rows = [{"id": f"{d}-{q}", "question": f"doc {d} " * 3 + f"question {q}"} for d in range(6) for q in range(4)]
    rng.shuffle(rows)
    templates = load_templates(PROMPTS / "document_qa.toml")
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    keyed: list[int] = []  # rows keyed when each row was handed on

    def numbered(items):
        for n, item in enumerate(items):
            keyed.append(n + 1)
            yield n, item

    row_file = RowFile(str(path))
    order, items = PrefixOrder.reading(
        row_file, read_rows(row_file.lines()), lambda rows: template_jobs(rows, templates, {}), run_rows=5
    )
    got, when = [], []
    for index, job in order.apply(numbered(items), chunk_size=1):
        got.append((index, job.id))
        when.append(keyed[-1])
    row_file.close()
    # the head once 9 rows are keyed (more than HEAD_AFTER), then rows 12, 16, 20 and 24 as keyed
    assert [i for i, _ in got[:3]] == [0, 1, 2] and when[:3] == [9, 9, 9]
    assert [i for i, _ in got[3:7]] == [11, 15, 19, 23] and when[3:7] == [12, 16, 20, 24]
    assert [job_id for _, job_id in got[:7]] == [rows[i]["id"] for i in [0, 1, 2, 11, 15, 19, 23]]
    assert sorted(i for i, _ in got) == list(range(len(rows)))  # each row once
    docs = [job_id.split("-")[0] for _, job_id in got[7:]]
    assert len([d for j, d in enumerate(docs) if j == 0 or d != docs[j - 1]]) == 6  # one run per document
    assert order.stats.head == 7 and order.stats.rows == len(rows)


def test_a_file_of_at_most_head_after_rows_is_ordered_whole(tmp_path):
    lines = [json.dumps({"id": f"{d}-{q}", "question": f"doc {d} " * 3 + f"q {q}"}) for q in range(3) for d in range(5)]
    got, order = _order_of(tmp_path, lines, run_rows=100)
    assert order.stats.head == 0 and len(got) == len(lines)
    docs = [i.split("-")[0] for _, i, _ in got]
    assert len([d for j, d in enumerate(docs) if j == 0 or d != docs[j - 1]]) == 5


# -- whole runs on the tiny model -------------------------------------------------------------------
def _docqa(tmp_path, tiny_model, docs=10, questions=3, doc_tokens=(150, 200)):
    from transformers import AutoTokenizer

    from chunkgen.bench.order import docqa_rows, write_workload

    tok = AutoTokenizer.from_pretrained(tiny_model)
    return write_workload(tmp_path / "work", docqa_rows(tok, docs, questions, doc_tokens, shuffle=True, seed=3))


def _run(tiny_model, template, queries, out, *extra, stdin=None):
    from typer.testing import CliRunner

    from chunkgen.cli import app

    args = base_args(tiny_model, out, queries, template, kv_memory="400KiB", max_batch=4, quiet=None, max_new_tokens=6)
    args += ["--json-log", *extra]  # fp32 (base_args): bf16 answers depend on the waves
    res = CliRunner().invoke(app, args, input=stdin, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = [json.loads(l) for l in res.output.splitlines() if l.startswith('{"event": "summary"')]
    return summary[-1]


def _minimum_prefill(tiny_model, template, queries) -> int:
    from transformers import AutoTokenizer

    from chunkgen.bench.order import _jobs, minimum_prefill
    from chunkgen.llm import encode_prompt

    tok = AutoTokenizer.from_pretrained(tiny_model)
    return minimum_prefill([encode_prompt(tok, j.messages, j.data) for j in _jobs(template, queries)])


def _texts(out) -> dict[str, str]:
    return {r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())}


def test_prefix_order_prefills_less_and_answers_the_same(tiny_model, tmp_path):
    template, queries = _docqa(tmp_path, tiny_model)
    by_input = _run(tiny_model, template, queries, tmp_path / "input.jsonl", "--order", "input")
    by_prefix = _run(tiny_model, template, queries, tmp_path / "prefix.jsonl")  # the default
    assert by_input["order"] == "input" and by_prefix["order"] == "prefix"
    assert by_input["prompt_tokens"] == by_prefix["prompt_tokens"]
    assert by_prefix["prefilled_tokens"] <= 1.15 * _minimum_prefill(tiny_model, template, queries)
    assert by_prefix["prefilled_tokens"] * 1.5 < by_input["prefilled_tokens"]
    assert by_prefix["cache_hit_rate"] > by_input["cache_hit_rate"] + 0.2
    assert by_prefix["cached_tokens"] == by_prefix["prompt_tokens"] - by_prefix["prefilled_tokens"]
    assert _texts(tmp_path / "input.jsonl") == _texts(tmp_path / "prefix.jsonl")  # greedy: same answers


def test_a_head_answered_while_the_file_is_keyed_gives_the_same_answers(tiny_model, tmp_path, monkeypatch):
    from chunkgen.jobs import order as order_mod

    template, queries = _docqa(tmp_path, tiny_model, docs=6)
    whole = _run(tiny_model, template, queries, tmp_path / "whole.jsonl")
    monkeypatch.setattr(order_mod, "HEAD_AFTER", 6)
    monkeypatch.setattr(order_mod, "HEAD_ROWS", 4)
    monkeypatch.setattr(order_mod, "SAMPLE_EVERY", 2)
    headed = _run(tiny_model, template, queries, tmp_path / "headed.jsonl")
    rows = whole["requests"]  # the head, then each 2nd row keyed past the 7th
    assert whole["order_head"] == 0 and headed["order_head"] == 4 + len(range(8, rows + 1, 2))
    first = [json.loads(l)["line"] for l in (tmp_path / "headed.jsonl").read_text().splitlines()]
    assert sorted(first[:4]) == [1, 2, 3, 4]  # the head's records come first (max_batch 4)
    assert _texts(tmp_path / "headed.jsonl") == _texts(tmp_path / "whole.jsonl")
    assert len(first) == len(set(first)) == whole["requests"]


def test_ordered_output_resume_and_stdin_keep_working_in_prefix_order(tiny_model, tmp_path):
    template, queries = _docqa(tmp_path, tiny_model, docs=5)
    _run(tiny_model, template, queries, tmp_path / "ref.jsonl", "--order", "input")
    expected = _texts(tmp_path / "ref.jsonl")
    ordered = tmp_path / "ordered.jsonl"
    _run(tiny_model, template, queries, ordered, "--ordered")
    lines = [r["line"] for r in map(json.loads, ordered.read_text().splitlines())]
    assert lines == sorted(lines) and _texts(ordered) == expected
    # A run stopped part way: the first records kept, the rest answered by --resume in prefix order.
    kept = ordered.read_text().splitlines()[:6]
    ordered.write_text("".join(l + "\n" for l in kept))
    summary = _run(tiny_model, template, queries, ordered, "--resume")
    assert summary["skipped"] == 6 and summary["requests"] == len(expected) - 6
    assert _texts(ordered) == expected and len(ordered.read_text().splitlines()) == len(expected)
    piped = tmp_path / "piped.jsonl"
    _run(tiny_model, template, "-", piped, stdin=queries.read_bytes())
    assert _texts(piped) == expected


def test_inspect_tree_foresees_the_hit_rate_of_each_order(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from chunkgen.cli import app

    template, queries = _docqa(tmp_path, tiny_model)
    figures = tmp_path / "tree.json"
    res = CliRunner().invoke(
        app,
        [
            "inspect-tree",
            "--template",
            str(template),
            "--queries",
            str(queries),
            "--model",
            str(tiny_model),
            "--chunk-size",
            "16",
            "--kv-memory",
            "400KiB",
            "--dtype",
            "fp32",  # the budget is sized for fp32 K/V
            "--max-batch",
            "4",
            "--json",
            str(figures),
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    f = json.loads(figures.read_text())
    assert f["input_order"]["prompt_tokens"] == f["prefix_order"]["prompt_tokens"] == f["tokens"]
    assert f["prefix_order"]["cache_hit_rate"] > f["input_order"]["cache_hit_rate"] + 0.2
    # With a cache that holds everything, either order reaches what the whole tree shares.
    res = CliRunner().invoke(
        app,
        [
            "inspect-tree",
            "--template",
            str(template),
            "--queries",
            str(queries),
            "--model",
            str(tiny_model),
            "--chunk-size",
            "16",
            "--kv-memory",
            "64MiB",
            "--json",
            str(figures),
        ],
        catch_exceptions=False,
    )
    f = json.loads(figures.read_text())
    assert f["input_order"]["cached_tokens"] == f["prefix_order"]["cached_tokens"]
    # The replay admits prompts one at a time; the tree is built in prefill waves, where a partly
    # filled chunk is copied only from an earlier wave: at most one chunk a prompt less.
    saved = f["prefill_tokens_saved"]
    assert saved <= f["input_order"]["cached_tokens"] < saved + 16 * f["sequences"]


def test_bench_order_and_order_pass_reproduce_the_figures(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from chunkgen.cli import app

    figures = tmp_path / "order.json"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "order",
            "--model",
            str(tiny_model),
            "--docs",
            "6",
            "--questions",
            "3",
            "--doc-tokens",
            "100-150",
            "--max-new-tokens",
            "3",
            "--max-batch",
            "4",
            "--json",
            str(figures),
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    f = json.loads(figures.read_text())
    by = {r["order"]: r for r in f["results"]}
    assert f["rows"] == 18 and by["input"]["rows"] == by["prefix"]["rows"] == 18
    assert by["prefix"]["answers_equal_to_first"] == 18  # the same answers as in file order
    assert by["prefix"]["prefilled_tokens"] <= 1.15 * f["minimum_prefill_tokens"] < by["input"]["prefilled_tokens"]
    res = CliRunner().invoke(
        app, ["bench", "order-pass", "--rows", "300", "--prefixes", "10", "--run-rows", "50"], catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    assert "300 rows over 10 prefixes" in res.output and "6 sorted runs spilled" in res.output
    assert "in 10 runs of one prefix" in res.output
