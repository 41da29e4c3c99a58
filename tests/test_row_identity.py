"""Rows without an id keep their own answers across edits of the file; error records keep the
row's id whenever it can be read; numbers too long for Python's int conversion are data."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chunkgen.cli import EXIT_BAD_INPUT_LINES, app
from chunkgen.jobs.requests import ErrorRecord, read_rows, template_jobs
from chunkgen.jobs.templates import load_templates
from tests.conftest import PROMPTS
from tests.test_cli import base_args, records

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
    edited = {"insert": ["What is 10 minus 3?", *questions], "delete": questions[1:],
              "reorder": questions[::-1], "repeat": [questions[0], *questions]}[edit]
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
    surrogate, = _jobs('{"id": "s1", "question": "bad \\ud800 text"}\n')
    assert isinstance(surrogate, ErrorRecord) and surrogate.id == "s1" and surrogate.field == "question"
    in_id, = _jobs('{"id": "s\\ud800", "question": "fine"}\n')
    assert isinstance(in_id, ErrorRecord) and in_id.id is None


def test_huge_integers_are_data():
    digits = "9" * 5000
    job, = _jobs('{"id": "big", "question": ' + digits + '}\n')
    assert not isinstance(job, ErrorRecord), job
    assert digits in job.messages[-1]["content"]
    big_id, = _jobs('{"id": ' + digits + ', "question": "x"}\n')
    assert big_id.id == digits
    seed, = _jobs('{"id": "s", "question": "x", "seed": ' + digits + '}\n')
    assert isinstance(seed, ErrorRecord) and seed.field == "seed"
