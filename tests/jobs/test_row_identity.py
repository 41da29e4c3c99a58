"""Rows without an id keep their own answers across edits of the file; error records keep the
row's id whenever it can be read; numbers too long for Python's int conversion are data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chunkgen.cli import app
from chunkgen.jobs.requests import ErrorRecord, read_rows, template_jobs
from chunkgen.jobs.templates import load_templates
from tests.helpers import PROMPTS, base_args, records

runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def _rows(*questions: str) -> str:
    return "".join(json.dumps({"question": q}) + "\n" for q in questions)


def _answers(path: Path) -> list[tuple[str, str]]:
    """(request hash, text) of every answer: what each row was asked and what it got."""
    return sorted((r["request_hash"], r["text"]) for r in records(path) if "error" not in r)


@pytest.mark.parametrize("order", ["input", "prefix"])
@pytest.mark.parametrize("edit", ["insert", "delete", "reorder", "repeat"])
def test_rows_without_ids_keep_their_own_answers_after_edits(tiny_model, tmp_path, order, edit):
    questions = ["What is 2 + 2?", "What is 7 times 8?", "Is 91 prime?"]
    edited = {
        "insert": ["What is 10 minus 3?", *questions],
        "delete": questions[1:],
        "reorder": questions[::-1],
        "repeat": [questions[0], *questions],
    }[edit]
    queries, out, fresh = tmp_path / "q.jsonl", tmp_path / "out.jsonl", tmp_path / "fresh.jsonl"
    queries.write_text(_rows(*questions))
    assert _run(*base_args(tiny_model, out, queries=queries), "--order", order).exit_code == 0
    queries.write_text(_rows(*edited))
    res = _run(*base_args(tiny_model, out, queries=queries), "--order", order, "--resume")
    assert res.exit_code == 0, res.output
    assert "changed since" not in res.output
    assert _run(*base_args(tiny_model, fresh, queries=queries), "--order", order).exit_code == 0
    if edit == "delete":  # the deleted row's answer stays (resume never removes answers); the others match
        got = [a for a in _answers(out) if a in _answers(fresh)]
        assert got == _answers(fresh) and len(_answers(out)) == 3
    else:
        assert _answers(out) == _answers(fresh)  # every row answered once, by its own request
    keys = [r["row_key"] for r in records(out) if "error" not in r]
    assert len(keys) == len(set(keys))


def test_a_generated_id_never_collides_with_a_rows_own(tiny_model, tmp_path):
    queries, out = tmp_path / "q.jsonl", tmp_path / "out.jsonl"
    queries.write_text('{"id": "line-2", "question": "1?"}\n{"question": "2?"}\n')
    res = _run(*base_args(tiny_model, out, queries=queries))
    assert res.exit_code == 0, res.output
    got = records(out)
    assert len(got) == 2 and not any("error" in r for r in got)
    res = _run(*base_args(tiny_model, out, queries=queries), "--resume")
    assert res.exit_code == 0 and "already answered" in res.output


def test_resume_matches_answers_written_before_records_carried_row_keys(tiny_model, tmp_path):
    queries, out = tmp_path / "q.jsonl", tmp_path / "out.jsonl"
    queries.write_text(_rows("1?", "2?"))
    assert _run(*base_args(tiny_model, out, queries=queries)).exit_code == 0
    old = [{k: v for k, v in r.items() if k != "row_key"} for r in records(out)]
    out.write_text("".join(json.dumps(r) + "\n" for r in old))
    res = _run(*base_args(tiny_model, out, queries=queries), "--resume")
    assert res.exit_code == 0 and "already answered" in res.output, res.output


def _jobs(text: str):
    templates = load_templates(PROMPTS / "arithmetic_cot.toml")
    return list(template_jobs(read_rows(text.encode().splitlines(keepends=True)), templates, {}))


def test_error_records_keep_a_readable_id():
    (surrogate,) = _jobs('{"id": "s1", "question": "bad \\ud800 text"}\n')
    assert isinstance(surrogate, ErrorRecord) and surrogate.id == "s1" and surrogate.field == "question"
    (in_id,) = _jobs('{"id": "s\\ud800", "question": "fine"}\n')
    assert isinstance(in_id, ErrorRecord) and in_id.id is None


def test_huge_integers_are_data():
    digits = "9" * 5000
    (job,) = _jobs('{"id": "big", "question": ' + digits + "}\n")
    assert not isinstance(job, ErrorRecord), job
    assert digits in job.messages[-1]["content"]
    (big_id,) = _jobs('{"id": ' + digits + ', "question": "x"}\n')
    assert big_id.id == digits
    (seed,) = _jobs('{"id": "s", "question": "x", "seed": ' + digits + "}\n")
    assert isinstance(seed, ErrorRecord) and seed.field == "seed"


# -- whole-file mistakes, CSV input, temporary space ---------------------------------------------------
def test_csv_queries_are_read_natively(tiny_model, tmp_path):
    csv_file, jsonl, out_csv, out_jsonl = (tmp_path / n for n in ("q.csv", "q.jsonl", "a.jsonl", "b.jsonl"))
    csv_file.write_text('id,question,max_new_tokens\na,"What is 2 + 2, exactly?",3\nb,"Is 7\nprime?",\n')
    jsonl.write_text(
        '{"id": "a", "question": "What is 2 + 2, exactly?", "max_new_tokens": 3}\n'
        '{"id": "b", "question": "Is 7\\nprime?"}\n'
    )
    assert _run(*base_args(tiny_model, out_csv, queries=csv_file)).exit_code == 0
    assert _run(*base_args(tiny_model, out_jsonl, queries=jsonl)).exit_code == 0

    def strip(recs):
        return sorted((r["id"], r["text"], r["request_hash"]) for r in recs)

    assert strip(records(out_csv)) == strip(records(out_jsonl))


def test_a_csv_value_no_header_names_is_the_rows_error_not_lost(tmp_path):
    """An unquoted comma splits a value into a cell past the header's: that row is an error record
    (its id, its line, the column), not a question cut short without a word; empty trailing cells
    (a spreadsheet's) are nothing."""
    from chunkgen.jobs.whole_file import csv_rows

    path = tmp_path / "q.csv"
    path.write_text('id,question\na,"What is 2 + 2, exactly?"\nb,What is 3 + 3, exactly?\nc,Is 7 prime?,,\n')
    lines = [line.encode() for line in csv_rows(path)]
    templates = load_templates(PROMPTS / "arithmetic_cot.toml")
    a, b, c = template_jobs(read_rows(lines), templates, {})
    assert a.id == "a" and c.id == "c" and not isinstance(c, ErrorRecord)
    assert isinstance(b, ErrorRecord) and (b.id, b.line) == ("b", 3)
    assert b.message.startswith("column 3 holds a value the header names no field for (the header has 2 columns")


def test_a_latin1_csv_is_refused_at_its_line_column_and_byte(tmp_path):
    """A spreadsheet's Latin-1 export: one run-time line naming where UTF-8 breaks, before the model
    loads (a CSV is converted whole before the run starts)."""
    csv_file, out = tmp_path / "q.csv", tmp_path / "out.jsonl"
    csv_file.write_bytes('id,question\na,"fine, thanks"\nb,caf\u00e9\n'.encode("latin-1"))
    res = _run(*base_args(tmp_path / "no-model", out, queries=csv_file))
    assert res.exit_code != 0 and not out.exists()
    assert "q.csv is not UTF-8 text (line 3 has the byte 0xe9 at column 6;" in res.output, res.output


def test_whole_file_mistakes_name_what_the_file_looks_like(tmp_path):
    from chunkgen.jobs.whole_file import FileMistake, check_sample

    templates = load_templates(PROMPTS / "arithmetic_cot.toml")
    cases = {
        "id,question\na,x\n": "CSV with the header id, question",
        "id\tquestion\na\tx\n": "TSV",
        '[{"id": "a"},\n {"id": "b"}]\n': "JSON array",
        '{"id": "a", "questoin": "x"}\n{"id": "b", "questoin": "y"}\n': "did you mean 'questoin'",
    }
    latin1 = '{"id": "a", "question": "caf\u00e9"}\n\n{"id": "b", "question": "na\u00efve"}\n'.encode("latin-1")
    cases = {
        **{text.encode(): says for text, says in cases.items()},
        b"id,question\n": "the first row is not a JSON object; the file looks like CSV",
        b'{"id": "a", "questoin": "x"}\n': "which the first row for it does not have \\(it has 'questoin'\\)",
        b'{"id": "a", "questoin": "x"}\n{"id": "b", "questoin": "y"}\n': "none of the first 2 rows for it has",
        latin1: "not UTF-8 text \\(line 1 has the byte 0xe9 at column 29; .*Latin-1",
    }
    for data, says in cases.items():
        path = tmp_path / "q.jsonl"
        path.write_bytes(data)
        with pytest.raises(FileMistake, match=says):
            check_sample(path, "auto", templates, "id")
    path.write_text('not json\n{"id": "a", "question": "x"}\n{"id": "b"}\n')  # some bad rows: their own records
    check_sample(path, "auto", templates, "id")
    path.write_bytes(b'{"id": "a", "question": "x"}\n' + latin1)  # so are rows that are not UTF-8
    check_sample(path, "auto", templates, "id")


def test_a_full_temporary_folder_while_sorting_is_one_error(monkeypatch, tmp_path):
    import errno
    import tempfile

    from chunkgen.jobs.order import ExternalSort, TempSpaceError

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    sorter = ExternalSort(run_rows=2, spill_dir=str(tmp_path))
    monkeypatch.setattr(tempfile, "TemporaryFile", full)
    sorter.add(b"a", 0, 1, 0, 0)
    with pytest.raises(TempSpaceError, match="TMPDIR.*needs about"):
        sorter.add(b"b", 1, 2, 10, 0)


def test_a_model_without_a_chat_template_runs_only_when_asked(tiny_model, tmp_path):
    import shutil

    model = tmp_path / "base"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)  # transformers may keep it in chat_template.jinja instead
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    out = tmp_path / "out.jsonl"
    args = base_args(tiny_model, out)
    args[args.index("--model") + 1] = str(model)
    refused = _run(*args)
    assert refused.exit_code == 1 and "--no-chat-template" in refused.output and not out.exists()
    res = _run(*args, "--no-chat-template")
    assert res.exit_code == 0, res.output
    assert all(r["usage"]["completion_tokens"] >= 1 for r in records(out))


def test_a_full_temporary_folder_while_spooling_standard_input_is_one_error(monkeypatch):
    import errno
    import io

    from chunkgen.jobs.order import RowFile, TempSpaceError

    class Full(io.BytesIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b'{"id": "a"}\n')))
    rows = RowFile("-")
    rows._spool = Full()
    with pytest.raises(TempSpaceError, match="spooling standard input.*TMPDIR|TMPDIR.*spooling standard input"):
        list(rows.lines())


def test_request_hash_is_the_sha256_of_the_sorted_json_of_the_request():
    """Assembled from cached pieces for speed, the hash stays the one earlier outputs recorded."""
    import hashlib
    import json

    from chunkgen.engine.params import SamplingParams
    from chunkgen.jobs.requests import Job

    long = 'Ünïcode "quoted" system prompt\n' * 40
    cases = [
        ([{"role": "system", "content": long}, {"role": "user", "content": "hi ☃"}], SamplingParams(), "t"),
        (
            [{"role": "system", "content": long}, {"role": "user", "content": "x" * 600}],
            SamplingParams(max_new_tokens=7, stop=["\n"], json_schema={"type": "object"}),
            None,
        ),
        ([{"content": long, "role": "user", "name": "n"}], SamplingParams(regex="[ab]+"), "t2"),
        ([{"role": "user", "content": [{"type": "text", "text": "parts"}]}], SamplingParams(seed=3), None),
    ]
    for messages, params, template in cases:
        job = Job("a", 1, messages, params, template)
        canon = json.dumps(
            {"messages": messages, "params": params.as_dict(), "template": template}, sort_keys=True, ensure_ascii=False
        )
        assert job.request_hash == hashlib.sha256(canon.encode()).hexdigest()[:16]


# -- ids and generated keys never meet; a re-keyed resume never answers twice -------------------
def _cli(tiny_model, tmp_path, queries: str, *extra: str):
    (tmp_path / "q.jsonl").write_text(queries)
    out = tmp_path / "out.jsonl"
    res = _run(*base_args(tiny_model, out, queries=tmp_path / "q.jsonl"), "--order", "input", *extra)
    return res, out


def test_an_explicit_id_spelling_a_generated_key_keeps_both_answers(tiny_model, tmp_path):
    from chunkgen.jobs.requests import template_jobs as jobs_of

    (t,) = load_templates(PROMPTS / "arithmetic_cot.toml").values()
    (first,) = jobs_of(read_rows([json.dumps({"question": "What is 2 + 2?"}).encode() + b"\n"]), {t.name: t}, {})
    rows = _rows("What is 2 + 2?") + json.dumps({"id": first.key, "question": "Is 7 prime?"}) + "\n"
    res, out = _cli(tiny_model, tmp_path, rows)
    assert res.exit_code == 0 and len(records(out)) == 2
    for extra in (["--resume"], ["--resume", "--rerun-changed"]):
        res, _ = _cli(tiny_model, tmp_path, rows, *extra)
        assert res.exit_code == 0, res.output
        assert "superseded" not in res.output and len(records(out)) == 2


def test_adding_ids_after_answering_takes_the_earlier_answers(tiny_model, tmp_path):
    questions = [f"What is {i} plus {i}?" for i in range(6)]
    res, out = _cli(tiny_model, tmp_path, _rows(*questions))
    assert res.exit_code == 0 and len(records(out)) == 6
    with_ids = "".join(json.dumps({"id": f"q{i}", "question": q}) + "\n" for i, q in enumerate(questions))
    res, _ = _cli(tiny_model, tmp_path, with_ids, "--resume")
    assert res.exit_code == 0, res.output
    assert len(records(out)) == 6  # not 12: each row's answer found by its line and request


def test_resuming_with_another_id_field_is_refused(tiny_model, tmp_path):
    rows = "".join(json.dumps({"id": f"a{i}", "q": f"b{i}", "question": f"Is {i} odd?"}) + "\n" for i in range(3))
    res, out = _cli(tiny_model, tmp_path, rows)
    assert res.exit_code == 0 and len(records(out)) == 3
    res = runner.invoke(
        app,
        [*base_args(tiny_model, out, queries=tmp_path / "q.jsonl"), "--resume", "--id-field", "q"],
    )
    assert res.exit_code == 1 and "--id-field id" in res.output and len(records(out)) == 3
    res, _ = _cli(tiny_model, tmp_path, rows, "--resume")
    assert res.exit_code == 0 and len(records(out)) == 3


def test_an_id_field_is_recorded_when_not_id(tiny_model, tmp_path):
    res, out = _cli(
        tiny_model, tmp_path, json.dumps({"key": "k1", "question": "Is 3 odd?"}) + "\n", "--id-field", "key"
    )
    assert res.exit_code == 0
    (rec,) = records(out)
    assert rec["id"] == "k1" and rec["id_field"] == "key"
