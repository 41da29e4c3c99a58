"""The commands users type, end to end on the tiny model: typer's runner and real subprocesses."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chunkgen.cli import EXIT_BAD_INPUT_LINES, app
from tests.conftest import PROMPTS, ROOT

runner = CliRunner()


def records(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def run_cli(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def base_args(tiny_model, out, queries=PROMPTS / "arithmetic_cot.queries.jsonl", template=PROMPTS / "arithmetic_cot.toml"):
    return ["run", "--template", str(template), "--queries", str(queries), "--out", str(out),
            "--model", str(tiny_model), "--chunk-size", "16", "--kv-memory", "64MiB", "--quiet",
            "--max-new-tokens", "12"]


def test_run_writes_one_record_per_query_and_refuses_overwrite(tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    res = run_cli(*base_args(tiny_model, out))
    assert res.exit_code == 0, res.output
    recs = records(out)
    ids = [json.loads(l)["id"] for l in (PROMPTS / "arithmetic_cot.queries.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in recs) == sorted(ids)
    for r in recs:
        assert r["finish_reason"] in ("stop", "length") and r["usage"]["completion_tokens"] >= 1
        assert r["template"] == "arithmetic_cot" and r["sampling"]["max_new_tokens"] == 12
    assert sum(r["usage"]["cached_tokens"] for r in recs) > 0
    again = run_cli(*base_args(tiny_model, out))
    assert again.exit_code == 1 and "--resume" in again.output
    assert records(out) == recs  # untouched


def test_bad_lines_become_error_records_and_good_ones_are_answered(tiny_model, tmp_path):
    queries = tmp_path / "q.jsonl"
    lines = [
        '{"id": "ok1", "question": "What is 2 + 2?"}',
        'this is not json',
        '[1, 2, 3]',
        '{"id": "nofield"}',
        '{"id": "badtype", "question": ["a list"]}',
        '{"id": "ok1", "question": "duplicate id"}',
        '{"id": "badtemp", "question": "x", "temperature": -1}',
        '{"id": "braces", "question": "keep {this} and {{that}} literally"}',
        '{"question": "no id at all"}',
    ]
    queries.write_bytes(("\n".join(lines) + "\n").encode() + b'{"id": "utf", "question": "\xff\xfe"}\n')
    out = tmp_path / "out.jsonl"
    res = run_cli(*base_args(tiny_model, out, queries=queries))
    assert res.exit_code == EXIT_BAD_INPUT_LINES
    recs = records(out)
    errors = {r.get("line"): r["error"] for r in recs if "error" in r}
    assert errors[2]["field"] is None and "JSON" in errors[2]["message"]
    assert "object" in errors[3]["message"]
    assert errors[4]["field"] == "question" and "missing" in errors[4]["message"]
    assert errors[5]["field"] == "question"
    assert errors[6]["field"] == "id" and "duplicate" in errors[6]["message"]
    assert errors[7]["field"] == "temperature"
    assert "UTF-8" in errors[10]["message"]
    answered = {r["id"] for r in recs if "error" not in r}
    assert answered == {"ok1", "braces", "line-9"}


def test_bad_template_stops_before_any_work(tiny_model, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('system = "x"\nuser = "Hello {name!r}"\n')
    out = tmp_path / "out.jsonl"
    res = run_cli(*base_args(tiny_model, out, template=bad))
    assert res.exit_code == 1 and "bad.toml" in res.output and "placeholder" in res.output
    assert not out.exists()
    missing = run_cli(*base_args(tiny_model, out, template=tmp_path / "nope.toml"))
    assert missing.exit_code == 1 and "not found" in missing.output


def test_openai_batch_in_and_out(tiny_model, tmp_path):
    queries = tmp_path / "batch.jsonl"
    system = "You are a terse assistant. " * 20
    rows = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "any", "max_tokens": 8, "messages": [
                 {"role": "system", "content": system}, {"role": "user", "content": f"Say {i}"}]}}
            for i in range(4)]
    rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {}})
    queries.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out.jsonl"
    res = run_cli("run", "--queries", str(queries), "--out", str(out), "--model", str(tiny_model),
                  "--chunk-size", "16", "--kv-memory", "64MiB", "--quiet")
    assert res.exit_code == EXIT_BAD_INPUT_LINES
    recs = {r["custom_id"]: r for r in records(out)}
    for i in range(4):
        body = recs[f"req-{i}"]["response"]["body"]
        assert recs[f"req-{i}"]["response"]["status_code"] == 200 and recs[f"req-{i}"]["error"] is None
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 8
        assert body["choices"][0]["message"]["role"] == "assistant"
    assert recs["req-3"]["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert recs["bad"]["response"] is None and "url" in recs["bad"]["error"]["field"]


def test_killed_run_resumes_to_the_same_results(tiny_model, tmp_path):
    args = base_args(tiny_model, tmp_path / "x", queries=PROMPTS / "document_qa.queries.jsonl",
                     template=PROMPTS / "document_qa.toml")
    args[args.index("--max-new-tokens") + 1] = "40"
    args += ["--max-batch", "1"]
    full = tmp_path / "full.jsonl"
    args_full = list(args)
    args_full[args_full.index("--out") + 1] = str(full)
    assert run_cli(*args_full).exit_code == 0

    part = tmp_path / "part.jsonl"
    args[args.index("--out") + 1] = str(part)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "chunkgen", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not part.exists() or len(part.read_text().splitlines()) < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(records(part))
    assert 3 <= done_before < 12, "the run should have been killed part-way"
    with part.open("a") as f:
        f.write('{"id": "doc-9')  # what a kill in the middle of a write leaves behind
    res = run_cli(*args, "--resume")
    assert res.exit_code == 0, res.output
    got = records(part)
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in records(full))
    by_id = {r["id"]: r["text"] for r in records(full)}
    assert all(by_id[r["id"]] == r["text"] for r in got)


def test_inspect_tree_reports_sharing(tiny_model, tmp_path):
    js = tmp_path / "tree.json"
    res = run_cli("inspect-tree", "--template", str(PROMPTS / "tool_dispatcher.toml"),
                  "--queries", str(PROMPTS / "tool_dispatcher.queries.jsonl"), "--model", str(tiny_model),
                  "--json", str(js))
    assert res.exit_code == 0, res.output
    fig = json.loads(js.read_text())
    assert fig["sequences"] == 16 and fig["chunks_shared"] < fig["chunks_unshared"]
    assert fig["sharing_ratio"] > 0.8 and fig["bytes_shared"] < fig["bytes_unshared"]
    assert "shared by 16 prompts" in res.output


def test_template_directory_forms_a_forest_and_ordered_output(tiny_model, tmp_path):
    queries = tmp_path / "mixed.jsonl"
    rows = []
    for i in range(4):
        rows.append({"id": f"math-{i}", "template": "arithmetic_cot", "question": f"What is {i} + {i}?"})
        rows.append({"id": f"doc-{i}", "template": "document_qa", "question": f"Question {i}?"})
    queries.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out.jsonl"
    res = run_cli(*base_args(tiny_model, out, queries=queries, template=PROMPTS), "--ordered")
    assert res.exit_code == 0, res.output
    recs = records(out)
    assert [r["id"] for r in recs] == [r["id"] for r in rows]  # input order despite completion order
    assert all(r["template"] == r["id"].replace("math", "arithmetic_cot").replace("doc", "document_qa").rsplit("-", 1)[0]
               for r in recs)
    # two system prompts: the later queries of each template hit their own tree's cache
    assert recs[-1]["usage"]["cached_tokens"] > 0 and recs[-2]["usage"]["cached_tokens"] > 0


def test_shards_split_by_prefix_and_cover_every_line_once(tiny_model, tmp_path):
    queries = tmp_path / "mixed.jsonl"
    rows = []
    for i in range(3):
        for name in ("arithmetic_cot", "document_qa", "tool_dispatcher"):
            field = "request" if name == "tool_dispatcher" else "question"
            rows.append({"id": f"{name}-{i}", "template": name, field: f"item {i}"})
    lines = [json.dumps(r) for r in rows] + ["not json"]
    queries.write_text("\n".join(lines) + "\n")
    outs = []
    for k in range(3):
        out = tmp_path / f"shard{k}.jsonl"
        res = run_cli(*base_args(tiny_model, out, queries=queries, template=PROMPTS), "--shard", f"{k}/3",
                      "--max-new-tokens", "2")
        assert res.exit_code in (0, EXIT_BAD_INPUT_LINES), res.output
        outs.append(records(out) if out.exists() else [])
    ids = [r.get("id") or f"line:{r['line']}" for recs in outs for r in recs]
    assert sorted(ids) == sorted([r["id"] for r in rows] + ["line:10"])  # each exactly once
    for recs in outs:  # a template's rows never straddle shards
        for name in {r["template"] for r in recs if "template" in r}:
            assert sum(r.get("template") == name for r in recs) == 3
    bad = run_cli(*base_args(tiny_model, tmp_path / "x.jsonl", queries=queries, template=PROMPTS), "--shard", "3/3")
    assert bad.exit_code == 1 and "i/N" in bad.output


def test_bench_kernel_quick_rows_and_refusals(tmp_path):
    import torch

    from chunkgen import native_cuda_available

    out = tmp_path / "rows.json"
    res = run_cli("bench", "kernel", "--quick", "--impls", "paged,chunk_tpp", "--json", str(out))
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())
    assert {(r["impl"], r["n_s"], r["device"]) for r in rows} == {
        (i, s, "cpu") for i in ("paged", "chunk_tpp") for s in (0, 1024)}
    assert all(r["us"] > 0 for r in rows)
    res = runner.invoke(app, ["bench", "kernel", "--quick", "--dtype", "fp16"])
    assert res.exit_code == 1 and "fp16 is for --device cuda" in res.output
    if not (torch.cuda.is_available() and native_cuda_available()):
        res = runner.invoke(app, ["bench", "kernel", "--quick", "--device", "cuda"])
        assert res.exit_code == 1 and "needs a CUDA GPU" in res.output
