"""`--shard i/N`: the plan (balance bound, every row exactly once, deterministic) and the command
(every shard writes its file, an empty shard loads no model, merged shards equal a local run)."""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from chunkgen.engine import SamplingParams
from chunkgen.jobs.groups import prefix_group_key
from chunkgen.jobs.requests import ErrorRecord, Job
from chunkgen.jobs.shard import WHOLE_GROUP_ROWS, plan_groups, plan_items
from tests.helpers import PROMPTS, base_args, records, run_cli

group_sizes = st.lists(st.integers(1, 400), min_size=0, max_size=40)


@settings(max_examples=300, deadline=None)
@given(group_sizes, st.integers(1, 12))
def test_plan_is_balanced_complete_and_splits_few_groups(sizes, count):
    plan = plan_groups({f"g{i}": n for i, n in enumerate(sizes)}, count)
    total = sum(sizes)
    mean = total / count
    assert sum(plan.loads) == total and len(plan.loads) == count
    assert max(plan.loads) <= max(max(sizes, default=0), 1.25 * mean, math.ceil(mean))
    for i, n in enumerate(sizes):  # a group's pieces cover its rows once, in order, on distinct shards
        ends = [end for end, _ in plan.pieces[f"g{i}"]]
        assert ends == sorted(set(ends)) and ends[-1] == n and ends[0] > 0
        assert len({s for _, s in plan.pieces[f"g{i}"]}) == len(ends)
    assert sum(len(p) - 1 for p in plan.pieces.values()) <= count  # a split fills a shard
    assert plan_groups({f"g{i}": n for i, n in enumerate(sizes)}, count) == plan  # deterministic
    if len(sizes) <= count and max(sizes, default=0) <= WHOLE_GROUP_ROWS:
        assert plan.split_groups == 0  # a small file's groups stay whole when there is room


def test_one_large_group_is_split_evenly():
    plan = plan_groups({"only": 1000}, 4)
    assert plan.loads == [250, 250, 250, 250] and plan.split_groups == 1


def _job(i: int, system: str) -> Job:
    return Job(
        f"r{i}", i + 1, [{"role": "system", "content": system}, {"role": "user", "content": str(i)}], SamplingParams()
    )


def test_select_gives_every_row_to_exactly_one_shard():
    items = [_job(i, "long" if i % 5 else "short") for i in range(200)] + [ErrorRecord(None, 201, None, "bad")]
    plan = plan_items(items, 3)
    chosen = [[it.line for it in plan.select(items, s)] for s in range(3)]
    assert sorted(sum(chosen, [])) == [it.line for it in items]
    assert [len(c) for c in chosen] == plan.loads and max(plan.loads) <= math.ceil(1.25 * 201 / 3)
    assert prefix_group_key(items[-1]) == "line:201"


def _template_rows(per_template: dict[str, int]) -> list[dict]:
    rows = []
    for name, n in per_template.items():
        field = "request" if name == "tool_dispatcher" else "question"
        rows += [{"id": f"{name}-{i}", "template": name, field: f"item {i}"} for i in range(n)]
    return rows


def _run_shards(tiny_model, tmp_path, queries, count, *extra, template=PROMPTS):
    """Every shard's records; each shard must write its file."""
    outs = []
    for k in range(count):
        out = tmp_path / f"shard{k}of{count}.jsonl"
        args = base_args(tiny_model, out, queries=queries, template=template)
        res = run_cli(*args, "--shard", f"{k}/{count}", "--max-new-tokens", "2", *extra)
        assert res.exit_code in (0, 3), res.output
        assert out.exists(), f"shard {k}/{count} wrote no output file"
        outs.append(records(out))
    return outs


def test_shards_cover_every_line_once_and_merge_to_a_local_run(tiny_model, tmp_path):
    queries = tmp_path / "mixed.jsonl"
    rows = _template_rows({"arithmetic_cot": 3, "document_qa": 3, "tool_dispatcher": 3})
    queries.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    outs = _run_shards(tiny_model, tmp_path, queries, 3)
    assert all(outs), "a shard was left empty although there are more groups than shards"
    key = lambda r: r.get("id") or f"line:{r['line']}"  # noqa: E731
    merged = [r for recs in outs for r in recs]
    assert sorted(map(key, merged)) == sorted([r["id"] for r in rows] + ["line:10"])  # each exactly once
    for recs in outs:  # a template's rows never straddle shards
        for name in {r["template"] for r in recs if "template" in r}:
            assert sum(r.get("template") == name for r in recs) == 3
    local = tmp_path / "local.jsonl"
    assert (
        run_cli(*base_args(tiny_model, local, queries=queries, template=PROMPTS), "--max-new-tokens", "2").exit_code
        == 3
    )
    assert {key(r): r.get("text") for r in merged} == {key(r): r.get("text") for r in records(local)}
    bad = run_cli(*base_args(tiny_model, tmp_path / "x.jsonl", queries=queries, template=PROMPTS), "--shard", "3/3")
    assert bad.exit_code == 2 and "i/N" in bad.output


def test_openai_rows_shard_by_system_message(tiny_model, tmp_path):
    queries = tmp_path / "batch.jsonl"
    systems = ["You answer in one word. " * 8, "You are a careful tutor. " * 8]
    rows = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "any",
                "messages": [
                    {"role": "system", "content": systems[i % 3 == 0]},
                    {"role": "user", "content": f"Say {i}"},
                ],
            },
        }
        for i in range(24)
    ]  # 16 rows of one system prompt, 8 of the other
    queries.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    outs = _run_shards(tiny_model, tmp_path, queries, 2, template=None)
    by_id = {r["custom_id"]: r for r in rows}
    seen = [sorted({by_id[r["custom_id"]]["body"]["messages"][0]["content"] for r in recs}) for recs in outs]
    assert sorted(map(len, outs)) == [8, 16] and seen[0] != seen[1] and all(len(s) == 1 for s in seen)


def test_a_shard_with_no_rows_writes_an_empty_file_without_loading_the_model(tiny_model, tmp_path, monkeypatch):
    import chunkgen.cli.options as options
    import chunkgen.cli.run as cli_run
    from chunkgen.jobs.lock import OutputLock

    queries = tmp_path / "two.jsonl"
    queries.write_text("\n".join(json.dumps(r) for r in _template_rows({"arithmetic_cot": 3, "document_qa": 2})) + "\n")

    def no_model(*args, **kwargs):
        raise AssertionError("an empty shard loaded the model")

    monkeypatch.setattr(cli_run, "load_llm", no_model)
    monkeypatch.setattr(cli_run, "resolve_model", no_model)
    monkeypatch.setattr(options, "resolve_model", no_model)
    out = tmp_path / "shard3.jsonl"
    res = run_cli(*base_args(tiny_model, out, queries=queries, template=PROMPTS), "--shard", "3/4", "--json-log")
    assert res.exit_code == 0, res.output
    assert out.exists() and out.read_text() == ""
    OutputLock(out).acquire().release()  # the shard's lock was let go: OutputLocked otherwise
    assert "none of the 5 rows" in res.output and "3, 2, 0, 0" in res.output
    summary = json.loads([l for l in res.output.splitlines() if l.startswith('{"event": "summary"')][-1])
    assert summary["requests"] == 0 and summary["model_loads"] == 0
    again = run_cli(*base_args(tiny_model, out, queries=queries, template=PROMPTS), "--shard", "3/4", "--resume")
    assert again.exit_code == 0 and out.read_text() == ""


def test_shard_needs_a_file_not_standard_input(tiny_model, tmp_path):
    args = base_args(tiny_model, tmp_path / "o.jsonl")
    args[args.index("--queries") + 1] = "-"
    res = run_cli(*args, "--shard", "0/2")
    assert res.exit_code == 2 and "standard input" in res.output
