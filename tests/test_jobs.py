"""Rows in, records out, without a model: reading and validating rows, templates, the writer's resume
index, the output lock."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chunkgen.engine import Completion, Result, SamplingParams
from chunkgen.jobs.lock import OutputLock, OutputLocked
from chunkgen.jobs.requests import (ErrorRecord, Job, detect_format, openai_jobs, read_rows, template_jobs)
from chunkgen.jobs.results import OutputError, OutputExists, ResultWriter
from chunkgen.jobs.templates import TemplateError, load_template, load_templates
from tests.conftest import PROMPTS


def rows_of(*lines: str | bytes) -> list:
    data = b"".join((l if isinstance(l, bytes) else l.encode()) + b"\n" for l in lines)
    return list(read_rows(io.BytesIO(data)))


def templates():
    return load_templates(PROMPTS / "arithmetic_cot.toml")


def by_line(items) -> dict[int, Job | ErrorRecord]:
    return {i.line: i for i in items}


# -- rows ------------------------------------------------------------------------------------------
def test_hostile_template_rows_become_one_error_each():
    lines = [
        '{"id": "ok", "question": "2+2?"}',
        '{"id": "tlist", "question": "x", "template": ["t"]}',
        '{"id": "tref", "question": "x", "template": {"$ref": "x"}}',
        '{"id": "bigseed", "question": "x", "seed": 1180591620717411303424}',
        '{"id": "nan", "question": "x", "temperature": NaN}',
        '{"id": "inf", "question": "x", "top_p": Infinity}',
        '{"id": "strtok", "question": "x", "max_new_tokens": "5"}',
        '{"id": "floattok", "question": "x", "max_new_tokens": 5.5}',
        '{"id": "boolk", "question": "x", "top_k": true}',
        '{"id": "tiny", "question": "x", "temperature": 1e-300}',
        '{"id": ["list"], "question": "x"}',
        '{"id": "nanval", "question": NaN}',
        '{"id": "emptystop", "question": "x", "stop": [""]}',
        '{"id": "deep", "question": ' + "[" * 100000 + "]" * 100000 + "}",
    ]
    got = by_line(template_jobs(rows_of(*lines), templates(), {}))
    assert isinstance(got[1], Job) and isinstance(got[10], Job)  # a tiny temperature is valid (greedy)
    want_field = {2: "template", 3: "template", 4: "seed", 5: "temperature", 6: "top_p", 7: "max_new_tokens",
                  8: "max_new_tokens", 9: "top_k", 11: "id", 12: "question", 13: "stop", 14: None}
    for line, field in want_field.items():
        assert isinstance(got[line], ErrorRecord), f"line {line} should be an error: {got[line]}"
        assert got[line].field == field, (line, got[line])
    assert len(got) == len(lines)


def test_duplicate_ids_are_errors_that_name_the_later_line():
    got = by_line(template_jobs(rows_of('{"id": "a", "question": "1"}', '{"id": "b", "question": "2"}',
                                        '{"id": "a", "question": "3"}'), templates(), {}))
    assert isinstance(got[1], Job) and isinstance(got[2], Job)
    assert isinstance(got[3], ErrorRecord) and got[3].id == "a" and "duplicate" in got[3].message


def test_bom_blank_lines_and_format_detection_from_any_row():
    rows = rows_of(b'\xef\xbb\xbf{"id": "x", "question": "q"}', b"", b"   ")
    assert [n for n, _ in rows] == [1] and rows[0][1]["id"] == "x"
    openai_row = json.dumps({"custom_id": "r", "body": {"messages": [{"role": "user", "content": "hi"}]}})
    fmt, rest = detect_format(iter(rows_of("not json", "{}", openai_row)))
    assert fmt == "openai" and [n for n, _ in rest] == [1, 2, 3]  # nothing read to decide is lost
    fmt, _ = detect_format(iter(rows_of("[1]", '{"id": "a", "question": "q"}')))
    assert fmt == "template"


def openai_row(body: dict, cid: str = "r") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


def test_openai_body_fields_supported_ignored_and_refused():
    msgs = [{"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    lines = [
        openai_row({"messages": msgs, "max_completion_tokens": 7, "stop": "x", "seed": 3, "n": 2,
                    "user": "u", "metadata": {"k": "v"}, "model": "m", "logprobs": False,
                    "response_format": {"type": "text"}}, "ok"),
        openai_row({"messages": msgs, "tools": [{"type": "function"}]}, "tools"),
        openai_row({"messages": msgs, "response_format": {"type": "xml"}}, "rf"),
        openai_row({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "img"),
        openai_row({"messages": [{"role": "tool", "content": "x"}]}, "role"),
        openai_row({"messages": msgs, "max_tokens": 0}, "zero"),
        openai_row({"messages": msgs, "frequency_penalty": 2.5}, "pen"),
        openai_row({"messages": msgs, "temperature": "hot"}, "temp"),
    ]
    got = {i.id: i for i in openai_jobs(rows_of(*lines), {})}
    ok = got["ok"]
    assert isinstance(ok, Job) and ok.params.max_new_tokens == 7 and ok.params.stop == ("x",) and ok.params.n == 2
    assert ok.messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "ab"}]
    assert ok.data == ("sys", "ab")  # every content of a batch file is data
    fields = {k: got[k].field for k in ("tools", "rf", "img", "role", "zero", "pen", "temp")}
    assert fields == {"tools": "body.tools", "rf": "body.response_format", "img": "body.messages[0].content[0]",
                      "role": "body.messages[0].role", "zero": "body.max_tokens", "pen": "body.frequency_penalty",
                      "temp": "body.temperature"}


@pytest.mark.parametrize("fields, field", [
    ({"n": 0}, "body.n"), ({"seed": -1}, "body.seed"), ({"stop": 5}, "body.stop"), ({"stop": ["a", ""]}, "body.stop"),
    ({"max_completion_tokens": -3}, "body.max_completion_tokens"), ({"top_p": 2}, "body.top_p"),
    ({"tool_choice": "auto"}, "body.tool_choice"), ({"audio": {"voice": "x"}}, "body.audio"),
    ({"logit_bias": {"50256": -100}}, "body.logit_bias"), ({"stream": True}, "body.stream"),
    ({"modalities": ["text", "audio"]}, "body.modalities"), ({"functions": [{"name": "f"}]}, "body.functions"),
])
def test_openai_bad_or_unsupported_body_fields_name_the_field(fields, field):
    line = openai_row({"messages": [{"role": "user", "content": "hi"}], **fields})
    (item,) = openai_jobs(rows_of(line), {})
    assert isinstance(item, ErrorRecord) and item.field == field, item


def test_openai_harmless_fields_are_accepted():
    line = openai_row({"messages": [{"role": "user", "content": "hi"}], "seed": 5, "n": 3, "stop": ["a", "b"],
                       "max_completion_tokens": 9, "stream": False, "tool_choice": "none", "tools": [],
                       "logit_bias": {}, "modalities": ["text"], "top_logprobs": 0, "user": "u",
                       "metadata": {"a": "b"}, "store": False, "service_tier": "auto"})
    (job,) = openai_jobs(rows_of(line), {})
    assert isinstance(job, Job), job
    assert (job.params.seed, job.params.n, job.params.stop, job.params.max_new_tokens) == (5, 3, ("a", "b"), 9)
    assert job.params.logprobs is None


def test_request_hash_follows_what_the_answer_depends_on():
    one = by_line(template_jobs(rows_of('{"id": "a", "question": "q"}'), templates(), {}))[1]
    same = by_line(template_jobs(rows_of('{"id": "a", "question": "q"}'), templates(), {}))[1]
    text = by_line(template_jobs(rows_of('{"id": "a", "question": "other"}'), templates(), {}))[1]
    tokens = by_line(template_jobs(rows_of('{"id": "a", "question": "q"}'), templates(), {"max_new_tokens": 3}))[1]
    assert one.request_hash == same.request_hash
    assert len({one.request_hash, text.request_hash, tokens.request_hash}) == 3


# -- templates -------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling, key", [
    ('max_new_tokens = "5"', "max_new_tokens"), ("temperature = -1.0", "temperature"),
    ("top_p = 1.5", "top_p"), ("stop = 3", "stop"), ("seed = -2", "seed"), ("colour = 1", "colour"),
])
def test_template_sampling_is_checked_when_read(tmp_path, sampling, key):
    bad = tmp_path / "bad.toml"
    bad.write_text(f'user = "Q: {{q}}"\n[sampling]\n{sampling}\n')
    with pytest.raises(TemplateError) as info:
        load_template(bad)
    assert "bad.toml" in str(info.value) and key in str(info.value)


def test_template_top_level_keys_and_types(tmp_path):
    typo = tmp_path / "typo.toml"
    typo.write_text('user = "Q: {q}"\nsytem = "x"\n')
    with pytest.raises(TemplateError, match="sytem"):
        load_template(typo)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('user = "Q: {q}"\nsystem = 3\n')
    with pytest.raises(TemplateError, match="'system' must be a string"):
        load_template(wrong)


# -- writer and resume -----------------------------------------------------------------------------
def job(line: int, rid: str, text: str = "q") -> Job:
    return Job(rid, line, [{"role": "user", "content": text}], SamplingParams(max_new_tokens=4))


def result(i: int) -> Result:
    return Result(i, 5, 0, [Completion(f"answer {i}", [1, 2], "stop")])


def test_an_error_record_never_stands_for_an_answer(tmp_path):
    out = tmp_path / "out.jsonl"
    w = ResultWriter(out, "template", "m")
    w.write(w.error_record(ErrorRecord("a", 3, "id", "duplicate id 'a'")))  # the run is cut here
    w.close()
    w = ResultWriter(out, "template", "m", resume=True)
    assert not w.answered(job(1, "a")) and not w.answered(job(3, "a"))
    w.write(w.result_record(job(1, "a"), result(1)))
    w.write(w.error_record(ErrorRecord("a", 3, "id", "duplicate id 'a'")))
    w.close()
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [(r["line"], r["id"], "error" in r) for r in recs] == [(1, "a", False), (3, "a", True)]  # compacted
    w = ResultWriter(out, "template", "m", resume=True)
    assert w.answered(job(1, "a")) and not w.answered(job(3, "a"))
    w.close()


def test_changed_requests_are_reported_and_rerun_only_when_asked(tmp_path):
    out = tmp_path / "out.jsonl"
    w = ResultWriter(out, "template", "m")
    w.write(w.result_record(job(1, "a", "old text"), result(1)))
    w.close()
    w = ResultWriter(out, "template", "m", resume=True)
    assert w.answered(job(1, "a", "old text")) and w.changed == []
    assert w.answered(job(1, "a", "new text")) and w.changed == [(1, "a")]
    w.close()
    w = ResultWriter(out, "template", "m", resume=True, rerun_changed=True)
    assert not w.answered(job(1, "a", "new text"))
    w.write(w.result_record(job(1, "a", "new text"), result(2)))
    w.close()
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(recs) == 1 and recs[0]["text"] == "answer 2"


def test_foreign_files_are_refused_before_any_repair(tmp_path):
    queries = tmp_path / "q.jsonl"
    original = '{"id": "a", "question": "q"}\n{"id": "b", "question": "cut'
    queries.write_text(original)
    with pytest.raises(OutputError, match="line 1 is not a chunkgen result record"):
        ResultWriter(queries, "template", "m", resume=True)
    assert queries.read_text() == original  # the user's file is untouched
    odd = tmp_path / "odd.jsonl"
    odd.write_text("[1, 2]\n")
    with pytest.raises(OutputError, match="line 1"):
        ResultWriter(odd, "template", "m", resume=True)
    with pytest.raises(OutputExists):
        ResultWriter(odd, "template", "m")
    with pytest.raises(OutputError, match="is a directory"):
        ResultWriter(tmp_path, "template", "m")


def test_a_write_that_fails_says_what_is_safe(tmp_path):
    out = tmp_path / "out.jsonl"
    w = ResultWriter(out, "template", "m")
    w.write(w.result_record(job(1, "a"), result(1)))

    class Full(io.StringIO):
        def write(self, s):
            raise OSError(28, "No space left on device")

    w._f = Full()
    with pytest.raises(OutputError, match="No space left on device.*--resume"):
        w.write(w.result_record(job(2, "b"), result(2)))
    w.lock.release()
    assert len(out.read_text().splitlines()) == 1


def test_truncated_last_line_is_cut_and_its_row_answered_again(tmp_path):
    out = tmp_path / "out.jsonl"
    w = ResultWriter(out, "openai", "m")
    w.write(w.result_record(job(1, "a"), result(1)))
    w.close()
    with out.open("a") as f:
        f.write('{"id": "batch_req_x", "custom_id": "b", "resp')
    w = ResultWriter(out, "openai", "m", resume=True)
    assert w.answered(job(1, "a")) and not w.answered(job(2, "b"))
    w.close()
    assert len(out.read_text().splitlines()) == 1


# -- lock ------------------------------------------------------------------------------------------
def test_one_writer_per_output_and_a_dead_holder_never_blocks(tmp_path):
    out = tmp_path / "out.jsonl"
    first = OutputLock(out).acquire()
    with pytest.raises(OutputLocked, match=rf"PID {os.getpid()} on .*--resume"):
        OutputLock(out).acquire()
    first.release()
    OutputLock(out).acquire().release()
    # A process that takes the lock and dies without releasing it (SIGKILL) leaves only a sidecar.
    code = (f"import os; from pathlib import Path; from chunkgen.jobs.lock import OutputLock; "
            f"OutputLock(Path({str(out)!r})).acquire(); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert out.with_name("out.jsonl.lock").exists()
    OutputLock(out).acquire().release()
