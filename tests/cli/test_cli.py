"""The commands users type, end to end on the tiny model: typer's runner and real subprocesses."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from chunkgen.cli import EXIT_BAD_INPUT_LINES, app
from tests.helpers import PROMPTS, ROOT, base_args, records, run_cli, runner


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


def test_a_run_reads_the_tokenizer_once(tiny_model, tmp_path, monkeypatch):
    """The check before the weights load and the load itself take one tokenizer, read once."""
    from chunkgen.model import loading

    loads = []
    real = loading.load_tokenizer

    def counted(path, **kwargs):
        loads.append(path)
        return real(path, **kwargs)

    monkeypatch.setattr(loading, "load_tokenizer", counted)
    res = run_cli(*base_args(tiny_model, tmp_path / "out.jsonl"))
    assert res.exit_code == 0, res.output
    assert len(loads) == 1, loads


def test_kv_dtype_sets_the_caches_dtype_beside_the_models(tiny_model, tmp_path):
    """--kv-dtype bf16 in an fp32 run: the same rows hold half the K/V bytes, the summary says so."""
    peaks = {}
    for kv in (None, "bf16"):
        out = tmp_path / f"out-{kv}.jsonl"
        res = run_cli(*base_args(tiny_model, out, dtype="fp32", kv_dtype=kv, json_log=True, quiet=None))
        assert res.exit_code == 0, res.output
        (summary,) = [json.loads(l) for l in res.output.splitlines() if l.startswith('{"event": "summary"')]
        peaks[kv] = summary["kv_peak_bytes"]
        assert ("of bf16 K/V" in summary["kv_memory"]) == (kv == "bf16") and summary["dtype"].startswith("fp32")
        assert len(records(out)) == 12
    assert peaks["bf16"] * 2 == peaks[None] > 0
    bad = run_cli(*base_args(tiny_model, tmp_path / "bad.jsonl", kv_dtype="int4"))
    assert bad.exit_code == 2 and "--kv-dtype" in bad.output


def test_bad_lines_become_error_records_and_good_ones_are_answered(tiny_model, tmp_path):
    queries = tmp_path / "q.jsonl"
    lines = [
        '{"id": "ok1", "question": "What is 2 + 2?"}',
        "this is not json",
        "[1, 2, 3]",
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
    rows = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "any",
                "max_tokens": 8,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Say {i}"}],
            },
        }
        for i in range(4)
    ]
    rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {}})
    queries.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out.jsonl"
    res = run_cli(*base_args(tiny_model, out, queries, None, max_new_tokens=None, dtype=None))
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
    docs = PROMPTS / "document_qa"
    args = base_args(
        tiny_model, tmp_path / "x", f"{docs}.queries.jsonl", f"{docs}.toml", max_new_tokens=40, max_batch=1
    )
    full = tmp_path / "full.jsonl"
    args_full = list(args)
    args_full[args_full.index("--out") + 1] = str(full)
    assert run_cli(*args_full).exit_code == 0

    part = tmp_path / "part.jsonl"
    args[args.index("--out") + 1] = str(part)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "chunkgen", *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
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
    res = run_cli(
        "inspect-tree",
        "--template",
        str(PROMPTS / "tool_dispatcher.toml"),
        "--queries",
        str(PROMPTS / "tool_dispatcher.queries.jsonl"),
        "--model",
        str(tiny_model),
        "--json",
        str(js),
    )
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
    res = run_cli(*base_args(tiny_model, out, queries=queries, template=PROMPTS), "--output-order", "input")
    assert res.exit_code == 0, res.output
    recs = records(out)
    assert [r["id"] for r in recs] == [r["id"] for r in rows]  # input order despite completion order
    alias = tmp_path / "alias.jsonl"  # --ordered, the option's earlier name, still works (hidden from --help)
    assert run_cli(*base_args(tiny_model, alias, queries=queries, template=PROMPTS), "--ordered").exit_code == 0
    assert [r["id"] for r in records(alias)] == [r["id"] for r in rows]
    assert all(
        r["template"] == r["id"].replace("math", "arithmetic_cot").replace("doc", "document_qa").rsplit("-", 1)[0]
        for r in recs
    )
    # two system prompts: the later queries of each template hit their own tree's cache
    assert recs[-1]["usage"]["cached_tokens"] > 0 and recs[-2]["usage"]["cached_tokens"] > 0


def test_bench_kernel_quick_rows_and_refusals(tmp_path):
    import torch

    from chunkgen import native_cuda_available

    out = tmp_path / "rows.json"
    res = run_cli("bench", "kernel", "--quick", "--device", "cpu", "--impls", "paged,chunk_tpp", "--json", str(out))
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())
    assert {(r["impl"], r["n_s"], r["device"]) for r in rows} == {
        (i, s, "cpu") for i in ("paged", "chunk_tpp") for s in (0, 1024)
    }
    assert all(r["us"] > 0 for r in rows)
    assert all(r["batch_invariant"] for r in rows)  # auto: on, as the engine runs on a CPU
    res = runner.invoke(app, ["bench", "kernel", "--quick", "--device", "cpu", "--kv-dtype", "fp16"])
    assert res.exit_code == 1 and "fp16 is for --device cuda" in res.output
    if not (torch.cuda.is_available() and native_cuda_available()):
        res = runner.invoke(app, ["bench", "kernel", "--quick", "--device", "cuda"])
        assert res.exit_code == 1 and "needs a CUDA GPU" in res.output


# -- mistakes caught before the model loads --------------------------------------------------------
MISSING_MODEL = "/nonexistent/model"  # an option error must win over this: it is checked first


@pytest.mark.parametrize(
    "extra, option, words",
    [
        (["--chunk-size", "17"], "--chunk-size", "multiple of 16"),
        (["--max-new-tokens", "0"], "--max-new-tokens", "at least 1"),
        (["--temperature", "nan"], "--temperature", "nan"),
        (["--top-p", "0"], "--top-p", "(0, 1]"),
        (["--seed", str(2**70)], "--seed", "integer"),
        (["--kv-memory", "lots"], "--kv-memory", "size"),
        (["--dtype", "fp8"], "--dtype", "fp8"),
        (["--device", "tpu"], "--device", "cpu, cuda"),
        (["--format", "csv"], "--format", "csv"),
        (["--shard", "3/3"], "--shard", "i/N"),
        (["--rerun-changed"], "--rerun-changed", "--resume"),
    ],
)
def test_option_mistakes_are_usage_errors_before_anything_loads(tmp_path, extra, option, words):
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, base_args(MISSING_MODEL, out) + extra)
    assert res.exit_code == 2, res.output
    assert option in res.output and words.lower() in res.output.lower(), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert not out.exists()


def test_output_and_input_paths_are_checked(tmp_path):
    res = runner.invoke(app, base_args(MISSING_MODEL, tmp_path))
    assert res.exit_code == 2 and "is a directory" in res.output
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"id": "a", "question": "q"}\n')
    res = runner.invoke(app, base_args(MISSING_MODEL, queries, queries=queries))
    assert res.exit_code == 2 and "is the queries file" in res.output
    assert queries.read_text() == '{"id": "a", "question": "q"}\n'
    res = runner.invoke(app, base_args(MISSING_MODEL, tmp_path / "o.jsonl", queries=tmp_path / "nope.jsonl"))
    assert res.exit_code == 2 and "not found" in res.output


def test_mistyped_template_fails_before_the_model_loads(tmp_path):
    bad = tmp_path / "typed.toml"
    bad.write_text('user = "Q: {question}"\n[sampling]\nmax_new_tokens = "5"\n')
    res = runner.invoke(app, base_args(MISSING_MODEL, tmp_path / "o.jsonl", template=bad))
    assert res.exit_code == 1 and "typed.toml" in res.output and "max_new_tokens" in res.output
    assert "Traceback" not in res.output


def test_unsupported_or_incomplete_models_are_named(tmp_path, tiny_model):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(gpt2)
    res = runner.invoke(app, base_args(str(gpt2), tmp_path / "o.jsonl"))
    assert res.exit_code == 1 and str(gpt2) in res.output and "'gpt2'" in res.output and "llama" in res.output
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text((tiny_model / "config.json").read_text())
    res = runner.invoke(app, base_args(str(empty), tmp_path / "o.jsonl"))
    assert res.exit_code == 1 and "no weights" in res.output
    # Weights that are a code-running pickle, a chat template the sandbox refuses: one message each.
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_model, pickled)
    (pickled / "model.safetensors").unlink()
    torch.save({"w": _RunsCode()}, pickled / "pytorch_model.bin")
    res = runner.invoke(app, base_args(str(pickled), tmp_path / "o.jsonl"))
    assert res.exit_code == 1 and "safe loader refuses" in res.output and "posix.system" in res.output
    sandboxed = tmp_path / "sandboxed"
    shutil.copytree(tiny_model, sandboxed)
    (sandboxed / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}")
    res = runner.invoke(app, base_args(str(sandboxed), tmp_path / "o.jsonl"))
    assert res.exit_code == 1 and "chat template cannot be used" in res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "o.jsonl").exists()  # a run that wrote nothing leaves no file


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


def test_help_and_version():
    assert "--resume" in runner.invoke(app, ["run", "-h"]).output
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("chunkgen ")
    text = runner.invoke(app, ["run", "--help"]).output
    assert "--no-share" in text and "--no-no-share" not in text and "--no-resume" not in text
    assert "chunkgen[ray]" in text


def test_every_option_is_spelled_from_its_parameters_name():
    """Each option's flags are its parameter's name in lower case (typer 0.27 turned a metavar
    that spells the name, DEVICE for device, into the flag --DEVICE), for every command."""
    import typer.main

    def commands(group, path=()):
        for name, cmd in group.commands.items():
            yield from commands(cmd, path + (name,)) if hasattr(cmd, "commands") else [(path + (name,), cmd)]

    found = {
        (" ".join(path), opt)
        for path, cmd in commands(typer.main.get_command(app))
        for param in cmd.params
        for opt in param.opts + param.secondary_opts
        if opt.startswith("--") and opt != opt.lower()
    }
    assert not found
    assert "--device" in runner.invoke(app, ["bench", "e2e", "--help"]).output


# -- rows that fail alone --------------------------------------------------------------------------
def test_hostile_rows_get_one_record_each_and_the_good_ones_answers(tiny_model, tmp_path):
    queries = tmp_path / "q.jsonl"
    lines = [
        '{"id": "good1", "question": "What is 1 + 1?"}',
        '{"id": "t", "question": "x", "template": ["t"]}',
        '{"id": "ref", "question": "x", "template": {"$ref": "x"}}',
        '{"id": "seed", "question": "x", "seed": 1180591620717411303424}',
        '{"id": "tiny", "question": "What is 2 + 2?", "temperature": 1e-300}',
        '{"id": "nan", "question": "x", "temperature": NaN}',
        '{"id": "big", "question": "' + "many words here " * 150 + '"}',
        '{"id": "good2", "question": "What is 3 + 3?", "temperature": 0.8, "seed": 5}',
    ]
    queries.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    res = run_cli(*base_args(tiny_model, out, queries=queries), "--kv-memory", "1MiB")
    assert res.exit_code == EXIT_BAD_INPUT_LINES, res.output
    assert "Traceback" not in res.output
    recs = records(out)
    assert sorted(r["line"] for r in recs) == list(range(1, len(lines) + 1))  # exactly one each
    answered = {r["id"] for r in recs if "error" not in r}
    assert answered == {"good1", "tiny", "good2"}
    big = next(r for r in recs if r["id"] == "big")
    assert big["error"]["field"] == "prompt" and "--kv-memory" in big["error"]["message"]


# -- resume ----------------------------------------------------------------------------------------
def test_resume_answers_a_duplicate_ids_first_row(tiny_model, tmp_path):
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"id": "a", "question": "1?"}\n{"id": "b", "question": "2?"}\n{"id": "a", "question": "3?"}\n')
    out = tmp_path / "out.jsonl"
    assert run_cli(*base_args(tiny_model, out, queries=queries)).exit_code == EXIT_BAD_INPUT_LINES
    full = records(out)
    # A run cut right after the duplicate's error record (written before any answer):
    out.write_text(json.dumps(next(r for r in full if "error" in r)) + "\n")
    res = run_cli(*base_args(tiny_model, out, queries=queries), "--resume")
    assert res.exit_code == EXIT_BAD_INPUT_LINES
    got = records(out)
    assert sorted((r["line"], r["id"], "error" in r) for r in got) == [(1, "a", False), (2, "b", False), (3, "a", True)]


def test_resume_retries_rows_that_failed_and_reports_changed_ones(tiny_model, tmp_path):
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"id": "a", "question": "1?"}\n{"id": "b", "question": "' + "long words " * 200 + '"}\n')
    out = tmp_path / "out.jsonl"
    assert (
        run_cli(*base_args(tiny_model, out, queries=queries), "--kv-memory", "1MiB").exit_code == EXIT_BAD_INPUT_LINES
    )
    res = run_cli(*base_args(tiny_model, out, queries=queries), "--resume")  # a budget big enough now
    assert res.exit_code == 0, res.output
    got = records(out)
    assert sorted((r["id"], "error" in r) for r in got) == [("a", False), ("b", False)]  # compacted
    queries.write_text('{"id": "a", "question": "changed?"}\n{"id": "b", "question": "' + "long words " * 200 + '"}\n')
    res = run_cli(*base_args(tiny_model, out, queries=queries), "--resume")
    assert res.exit_code == 0 and "changed since" in res.output and "--rerun-changed" in res.output
    assert records(out) == got
    res = run_cli(*base_args(tiny_model, out, queries=queries), "--resume", "--rerun-changed")
    assert res.exit_code == 0
    again = records(out)
    assert len(again) == 2 and next(r for r in again if r["id"] == "a")["request_hash"] != got[0]["request_hash"]
    res = run_cli(*base_args(tiny_model, out, queries=queries), "--resume")
    assert res.exit_code == 0 and "already answered" in res.output


def test_queries_from_standard_input(tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    text = "\ufeff" + '{"id": "a", "question": "1?"}\n{"id": "b", "question": "2?"}\n'
    args = base_args(tiny_model, out)
    args[args.index("--queries") + 1] = "-"
    res = runner.invoke(app, args, input=text.encode())
    assert res.exit_code == 0, res.output
    assert sorted(r["id"] for r in records(out)) == ["a", "b"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_queries_from_a_named_pipe_are_spooled_like_standard_input(tiny_model, tmp_path):
    """A path that is a stream (a named pipe, a shell's `<(...)`) can be read once only: the
    prefix order spools it as it does standard input; --shard, which plans over the whole file
    first, refuses it."""
    import threading

    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    rows = "".join(json.dumps({"id": f"r{i}", "question": f"{i} + {i}?"}) + "\n" for i in range(5))

    def feed() -> None:
        with open(fifo, "w") as f:
            f.write(rows)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    out = tmp_path / "out.jsonl"
    res = run_cli(*base_args(tiny_model, out, queries=fifo))
    feeder.join(timeout=10)
    assert res.exit_code == 0, res.output
    assert sorted(r["id"] for r in records(out)) == [f"r{i}" for i in range(5)]
    res = run_cli(*base_args(tiny_model, tmp_path / "shard.jsonl", queries=fifo), "--shard", "0/2")
    assert res.exit_code == 2 and "not standard input or a pipe" in res.output


def test_streams_records_after_every_prefill_wave(tiny_llm, tmp_path):
    """With one new token per row, answers finish at prefill: they must reach the file wave by
    wave, not all at the end."""
    from chunkgen.jobs.run import run_job
    from chunkgen.jobs.writer import ResultWriter

    queries = tmp_path / "q.jsonl"
    queries.write_text(
        "".join(json.dumps({"id": f"r{i}", "question": f"What is {i} + {i}?"}) + "\n" for i in range(120))
    )
    items = _items(queries, {"max_new_tokens": 1})
    out = tmp_path / "out.jsonl"
    writer = ResultWriter(out, "template", "tiny")
    seen_on_disk = []
    engine = tiny_llm.new_engine(max_batch=8)
    run_job(
        engine,
        tiny_llm.encode,
        items,
        writer,
        window=16,
        on_progress=lambda p: seen_on_disk.append(len(out.read_text().splitlines())),
    )
    assert len(records(out)) == 120
    assert 0 < seen_on_disk[len(seen_on_disk) // 2] < 120, seen_on_disk


def _items(queries: Path, defaults: dict):
    from chunkgen.jobs.requests import read_rows, template_jobs
    from chunkgen.jobs.templates import load_templates

    return template_jobs(read_rows(queries.open("rb")), load_templates(PROMPTS / "arithmetic_cot.toml"), defaults)


# -- one writer per output, signals ---------------------------------------------------------------
SLOW_ROWS = 200


def _slow_queries(tmp_path: Path) -> Path:
    """More rows than a run gets through before a test's signal reaches it: no timing window to race."""
    queries = tmp_path / "slow.queries.jsonl"
    if not queries.exists():
        queries.write_text(
            "".join(
                json.dumps({"id": f"doc-{i:03d}", "question": f"What does section {i % 9} say?"}) + "\n"
                for i in range(SLOW_ROWS)
            )
        )
    return queries


def _slow_args(tiny_model, out: Path, tmp_path: Path) -> list[str]:
    args = base_args(tiny_model, out, queries=_slow_queries(tmp_path), template=PROMPTS / "document_qa.toml")
    args[args.index("--max-new-tokens") + 1] = "8"
    return args + ["--max-batch", "4"]


def _slow_run(tiny_model, out: Path, tmp_path: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "chunkgen", *_slow_args(tiny_model, out, tmp_path), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_records(out: Path, n: int, proc: subprocess.Popen) -> None:
    """Until the run has written n whole records (it cannot finish first: it has SLOW_ROWS rows)."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and (not out.exists() or out.read_bytes().count(b"\n") < n):
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be interrupted"


def test_a_second_run_on_the_same_output_is_refused_through_any_name(tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    first = _slow_run(tiny_model, out, tmp_path)
    _wait_for_records(out, 1, first)
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.jsonl").symlink_to(out)
    os.link(out, tmp_path / "hard.jsonl")
    for name in (out, tmp_path / "link.jsonl", tmp_path / "hard.jsonl", tmp_path / "sub" / ".." / "out.jsonl"):
        t0 = time.time()
        second = runner.invoke(app, _slow_args(tiny_model, name, tmp_path) + ["--resume"])
        assert second.exit_code == 1 and time.time() - t0 < 20, second.output
        assert "another chunkgen run" in second.output and f"PID {first.pid}" in second.output
        assert "--resume" in second.output
    assert sorted(p.name for p in tmp_path.iterdir() if "out" in p.name) == ["out.jsonl"]  # no sidecar to delete
    first.send_signal(signal.SIGKILL)
    first.wait()
    # The killed run's lock died with it: a resume right after is not refused.
    res = run_cli(*_slow_args(tiny_model, out, tmp_path), "--resume", "--max-new-tokens", "1")
    assert res.exit_code == 0, res.output
    ids = [r["id"] for r in records(out)]
    assert len(ids) == len(set(ids)) == SLOW_ROWS


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_cleanly_and_resume_finishes_the_job(tiny_model, tmp_path, signum, code):
    out = tmp_path / "out.jsonl"
    proc = _slow_run(tiny_model, out, tmp_path, "--quiet")
    _wait_for_records(out, 2, proc)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert signal.Signals(signum).name in stderr and "--resume" in stderr and "Traceback" not in stderr
    done = records(out)  # every line is a whole record
    assert 2 <= len(done) < SLOW_ROWS
    if signum == signal.SIGTERM:
        res = run_cli(*_slow_args(tiny_model, out, tmp_path), "--resume")
        assert res.exit_code == 0, res.output
        got = records(out)
        assert sorted(r["id"] for r in got) == [f"doc-{i:03d}" for i in range(SLOW_ROWS)]
        assert {r["id"]: r for r in got if r["id"] in {d["id"] for d in done}} == {d["id"]: d for d in done}


def test_a_signal_lets_the_rows_in_flight_finish_and_says_so(tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    args = [a for a in _slow_args(tiny_model, out, tmp_path) if a != "--quiet"]  # the notice is progress output
    proc = subprocess.Popen(
        [sys.executable, "-m", "chunkgen", *args, "--stop-grace", "60"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_records(out, 2, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "SIGINT: taking no new rows; the rows in flight finish within 60 s" in stderr
    written = re.search(r"stopped by SIGINT: (\d+)\s+records", stderr)
    assert written and 2 <= int(written.group(1)) == len(records(out)) < SLOW_ROWS, stderr


def test_a_second_signal_stops_at_once_with_a_message(tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    proc = _slow_run(tiny_model, out, tmp_path, "--quiet")
    _wait_for_records(out, 1, proc)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)  # two kinds: two of one kind sent at once may arrive as one
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode in (130, 143), stderr
    assert "stopped at once by a second signal" in stderr and "--resume" in stderr and "Traceback" not in stderr
    assert all(r["id"].startswith("doc-") for r in records(out))


def _signal_inside_the_rewrite(monkeypatch, signals: list[int]) -> list[bool]:
    """Sends `signals` to this process once the end-of-run rewrite has copied a record; the list
    returned says whether the copy existed on disk at that moment."""
    from chunkgen.jobs import writer as results  # the module whose read_records the rewrite calls

    real_records, seen = results.read_records, []

    def records_then_signal(path):
        for i, item in enumerate(real_records(path)):
            if i == 1 and not seen:
                seen.append(any(".compact-" in p.name for p in path.parent.iterdir()))
                for s in signals:
                    os.kill(os.getpid(), s)
            yield item

    real_rewrite = results.ResultWriter._rewrite

    def rewrite(self, first_new):
        monkeypatch.setattr(results, "read_records", records_then_signal)
        try:
            real_rewrite(self, first_new)
        finally:
            monkeypatch.setattr(results, "read_records", real_records)

    monkeypatch.setattr(results.ResultWriter, "_rewrite", rewrite)
    return seen


def test_signals_during_the_final_rewrite(tiny_model, tmp_path, monkeypatch):
    queries = tmp_path / "q.jsonl"
    queries.write_text(
        '{"id": "a", "question": "1?"}\n{"id": "b", "question": "2?", "temperature": -1}\n'
        '{"id": "c", "question": "3?"}\n'
    )
    out = tmp_path / "out.jsonl"
    args = base_args(tiny_model, out, queries=queries)
    assert run_cli(*args).exit_code == EXIT_BAD_INPUT_LINES
    # Every --resume writes b's error record again, so it ends with a rewrite.
    seen = _signal_inside_the_rewrite(monkeypatch, [signal.SIGTERM])
    res = run_cli(*args, "--resume")
    assert seen == [True] and res.exit_code == EXIT_BAD_INPUT_LINES, res.output  # the job was complete
    assert "stopped" not in res.output and len(records(out)) == 3
    monkeypatch.undo()
    seen = _signal_inside_the_rewrite(monkeypatch, [signal.SIGTERM, signal.SIGTERM])
    res = run_cli(*args, "--resume")
    assert seen == [True] and res.exit_code == 143, res.output
    assert "stopped at once" in res.output and "--resume" in res.output
    assert len(records(out)) == 4 and sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "q.jsonl"]
    monkeypatch.undo()
    res = run_cli(*args, "--resume")
    assert res.exit_code == EXIT_BAD_INPUT_LINES and "interrupted rewrite" in res.output, res.output
    assert sorted((r["id"], "error" in r) for r in records(out)) == [("a", False), ("b", True), ("c", False)]


# -- the output file as a database -----------------------------------------------------------------
def test_resume_refuses_an_output_chunkgen_did_not_write(tiny_model, tmp_path):
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"id": "a", "question": "1?", "text": "x"}\n{"id": "b", "question": "2?", "text": "y"}\n')
    copy = tmp_path / "copy.jsonl"
    shutil.copy(queries, copy)
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": "z", "question": "9?"}\n')
    for target in (copy, other):
        before = target.read_bytes()
        res = run_cli(*base_args(tiny_model, target, queries=queries), "--resume")
        assert res.exit_code == 1 and "not a chunkgen result record" in res.output, res.output
        assert "already answered" not in res.output and target.read_bytes() == before


def test_lines_inserted_or_removed_above_never_re_answer(tiny_model, tmp_path):
    queries = tmp_path / "q.jsonl"
    rows = [json.dumps({"id": f"r{i}", "question": f"{i} + 1?"}) for i in range(4)]
    queries.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out.jsonl"
    assert run_cli(*base_args(tiny_model, out, queries=queries)).exit_code == 0
    first = records(out)
    for text in ("\n\n" + "\n".join(rows) + "\n", "\n".join(rows[1:]) + "\n"):
        queries.write_text(text)
        res = run_cli(*base_args(tiny_model, out, queries=queries), "--resume")
        assert res.exit_code == 0 and "already answered" in res.output, res.output
        assert records(out) == first


def test_a_lone_surrogate_fails_its_row_only_and_resume_finishes(tiny_model, tmp_path):
    queries = tmp_path / "q.jsonl"
    queries.write_text(
        '{"id": "a", "question": "1?"}\n{"id": "s", "question": "\\ud800"}\n'
        '{"id": "n", "question": "x", "seed": ' + "1" * 5000 + '}\n{"id": "c", "question": "3?"}\n'
    )
    out = tmp_path / "out.jsonl"
    for resume in ((), ("--resume",)):
        res = run_cli(*base_args(tiny_model, out, queries=queries), *resume)
        assert res.exit_code == EXIT_BAD_INPUT_LINES and "Traceback" not in res.output, res.output
    recs = {r["line"]: r for r in records(out)}
    assert sorted(recs) == [1, 2, 3, 4]
    assert recs[2]["error"]["field"] == "question" and "surrogate" in recs[2]["error"]["message"]
    assert (
        recs[2]["id"] == "s" and recs[3]["id"] == "n" and recs[3]["error"]["field"] == "seed"
    )  # huge integers are data
    assert "error" not in recs[1] and "error" not in recs[4]


def test_a_fixed_bad_line_keeps_no_old_error_record(tiny_model, tmp_path):
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"id": "a", "question": "1?"}\n{"id": "b", "question": 2?}\n')
    out = tmp_path / "out.jsonl"
    assert run_cli(*base_args(tiny_model, out, queries=queries)).exit_code == EXIT_BAD_INPUT_LINES
    queries.write_text('{"id": "a", "question": "1?"}\n{"id": "b", "question": "2?"}\n')
    assert run_cli(*base_args(tiny_model, out, queries=queries), "--resume").exit_code == 0
    assert sorted((r["id"], "error" in r) for r in records(out)) == [("a", False), ("b", False)]


def test_a_last_record_without_its_newline_is_kept_not_recomputed(tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    assert run_cli(*base_args(tiny_model, out)).exit_code == 0
    out.write_bytes(out.read_bytes().rstrip(b"\n"))
    before = records(out)
    res = run_cli(*base_args(tiny_model, out), "--resume")
    assert res.exit_code == 0 and "newline" in res.output and "already answered" in res.output, res.output
    assert records(out) == before and out.read_bytes().endswith(b"\n")


def test_constraints_that_cannot_compile_name_their_source(tiny_model, tmp_path):
    monster = "((((a{50}){50}){50}){50})"
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"id": "row", "question": "1?", "regex": monster}) + "\n")
    out = tmp_path / "out.jsonl"
    assert run_cli(*base_args(tiny_model, out, queries=queries)).exit_code == EXIT_BAD_INPUT_LINES
    assert records(out)[0]["error"]["field"] == "regex"
    template = tmp_path / "t.toml"
    template.write_text('user = "{question}"\n[output]\nregex = "' + monster + '"\n')
    queries.write_text('{"id": "t", "question": "1?"}\n')
    out = tmp_path / "out2.jsonl"
    assert run_cli(*base_args(tiny_model, out, queries=queries, template=template)).exit_code == EXIT_BAD_INPUT_LINES
    assert records(out)[0]["error"]["field"] == "template"
    batch = tmp_path / "b.jsonl"
    batch.write_text(
        json.dumps({"custom_id": "o", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}})
        + "\n"
    )
    out = tmp_path / "out3.jsonl"
    res = run_cli(*base_args(tiny_model, out, batch, None, max_new_tokens=None, dtype=None, regex=monster))
    assert res.exit_code == EXIT_BAD_INPUT_LINES and records(out)[0]["error"]["field"] == "regex"


def test_a_template_longer_than_the_context_is_refused_before_the_weights_load(tiny_model, tmp_path):
    broken = tmp_path / "model"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    header_end = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    weights.write_bytes(weights.read_bytes()[:header_end])  # the header, no tensors: a load would fail differently
    long = tmp_path / "long.toml"
    long.write_text('system = """' + "the handbook says many things. " * 3000 + '"""\nuser = "{question}"\n')
    out = tmp_path / "out.jsonl"
    res = run_cli(*base_args(str(broken), out, template=long))
    assert res.exit_code == 1 and "long.toml" in res.output and "context" in res.output, res.output
    assert "Traceback" not in res.output and not out.exists()


def test_an_empty_input_says_so(tiny_model, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    out = tmp_path / "out.jsonl"
    res = run_cli(*base_args(MISSING_MODEL, out, queries=empty))
    assert res.exit_code == 1 and "no rows" in res.output and not out.exists()
    args = base_args(tiny_model, out)
    args[args.index("--queries") + 1] = "-"
    res = runner.invoke(app, args, input=b"")
    assert res.exit_code == 1 and "standard input held no rows" in res.output and not out.exists()


def test_n_samples_records_every_completion(tiny_model, tmp_path):
    queries = tmp_path / "q.jsonl"
    queries.write_text(
        '{"id": "a", "question": "1?", "n": 3, "temperature": 0.9, "seed": 7, "logprobs": 2, '
        '"regex": "[a-z ]{1,6}", "max_new_tokens": 5}\n'
    )
    out = tmp_path / "out.jsonl"
    assert run_cli(*base_args(tiny_model, out, queries=queries)).exit_code == 0
    (rec,) = records(out)
    comps = rec["completions"]
    assert len(comps) == 3 and rec["text"] == comps[0]["text"] and rec["finish_reason"] == comps[0]["finish_reason"]
    total = 0
    for c in comps:
        assert set(c) == {"text", "finish_reason", "logprobs", "constraint_matched"}
        assert c["finish_reason"] in ("stop", "length") and isinstance(c["constraint_matched"], bool)
        assert 1 <= len(c["logprobs"]) <= 5 and all(len(e["top_logprobs"]) == 2 for e in c["logprobs"])
        assert "".join(e["token"] for e in c["logprobs"]).startswith(c["text"])
        total += len(c["logprobs"])
    assert rec["usage"]["completion_tokens"] == total and rec["sampling"]["n"] == 3
    assert len({c["text"] for c in comps}) > 1  # samples, not one answer three times


def test_openai_records_field_by_field(tiny_model, tmp_path):
    batch = tmp_path / "b.jsonl"
    batch.write_text(
        json.dumps(
            {
                "custom_id": "ok",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3,
                    "n": 2,
                    "temperature": 0.5,
                    "seed": 1,
                    "logprobs": True,
                },
            }
        )
        + "\n"
        + json.dumps({"custom_id": "bad", "body": {"messages": []}})
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    res = run_cli(*base_args(tiny_model, out, batch, None, max_new_tokens=None, dtype=None))
    assert res.exit_code == EXIT_BAD_INPUT_LINES, res.output
    ok, bad = sorted(records(out), key=lambda r: r["custom_id"] != "ok")
    assert set(ok) == {"id", "custom_id", "response", "error", "line", "request_hash", "chunkgen"}
    assert ok["id"].startswith("batch_req_") and ok["error"] is None and ok["line"] == 1 and ok["chunkgen"] == 1
    assert set(ok["response"]) == {"status_code", "request_id", "body"} and ok["response"]["status_code"] == 200
    body = ok["response"]["body"]
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert (
        body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == tiny_model.name
    )
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for c in body["choices"]:
        assert set(c) == {"index", "message", "logprobs", "finish_reason"}
        assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
        assert set(c["logprobs"]) == {"content", "refusal"} and c["finish_reason"] in ("stop", "length")
        assert [set(e) for e in c["logprobs"]["content"]] == [{"token", "logprob", "bytes", "top_logprobs"}] * len(
            c["logprobs"]["content"]
        )
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in body["choices"])
    assert set(usage["prompt_tokens_details"]) == {"cached_tokens"}
    assert set(bad) == {"id", "custom_id", "response", "error", "line", "request_hash", "chunkgen"}
    assert bad["response"] is None and bad["line"] == 2 and bad["request_hash"] is None
    assert bad["error"] == {
        "code": "invalid_request",
        "line": 2,
        "field": "body.messages",
        "message": "must be a non-empty list",
    }
