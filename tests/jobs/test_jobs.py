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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkgen.engine import Completion, Result, SamplingParams
from chunkgen.jobs.formats import RecordFormat, encode_record
from chunkgen.jobs.ledger import OutputError
from chunkgen.jobs.lock import OutputLock, OutputLocked
from chunkgen.jobs.requests import (
    TEMPLATE_OVERRIDES,
    ErrorRecord,
    Job,
    detect_format,
    openai_jobs,
    read_rows,
    template_jobs,
)
from chunkgen.jobs.templates import TemplateError, load_template, load_templates
from chunkgen.jobs.writer import OutputExists, ResultWriter
from tests.helpers import PROMPTS, base_args, openai_row, records, rows_of


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
    want_field = {
        2: "template",
        3: "template",
        4: "seed",
        5: "temperature",
        6: "top_p",
        7: "max_new_tokens",
        8: "max_new_tokens",
        9: "top_k",
        11: "id",
        12: "question",
        13: "stop",
        14: None,
    }
    for line, field in want_field.items():
        assert isinstance(got[line], ErrorRecord), f"line {line} should be an error: {got[line]}"
        assert got[line].field == field, (line, got[line])
    assert len(got) == len(lines)


def test_duplicate_ids_are_errors_that_name_the_later_line():
    got = by_line(
        template_jobs(
            rows_of('{"id": "a", "question": "1"}', '{"id": "b", "question": "2"}', '{"id": "a", "question": "3"}'),
            templates(),
            {},
        )
    )
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


def test_openai_body_fields_supported_ignored_and_refused():
    msgs = [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    lines = [
        openai_row(
            {
                "messages": msgs,
                "max_completion_tokens": 7,
                "stop": "x",
                "seed": 3,
                "n": 2,
                "user": "u",
                "metadata": {"k": "v"},
                "model": "m",
                "logprobs": False,
                "response_format": {"type": "text"},
            },
            "ok",
        ),
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
    assert fields == {
        "tools": "body.tools",
        "rf": "body.response_format",
        "img": "body.messages[0].content[0]",
        "role": "body.messages[0].role",
        "zero": "body.max_tokens",
        "pen": "body.frequency_penalty",
        "temp": "body.temperature",
    }


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"n": 0}, "body.n"),
        ({"seed": -1}, "body.seed"),
        ({"stop": 5}, "body.stop"),
        ({"stop": ["a", ""]}, "body.stop"),
        ({"max_completion_tokens": -3}, "body.max_completion_tokens"),
        ({"top_p": 2}, "body.top_p"),
        ({"tool_choice": "auto"}, "body.tool_choice"),
        ({"audio": {"voice": "x"}}, "body.audio"),
        ({"logit_bias": {"50256": -100}}, "body.logit_bias"),
        ({"stream": True}, "body.stream"),
        ({"modalities": ["text", "audio"]}, "body.modalities"),
        ({"functions": [{"name": "f"}]}, "body.functions"),
    ],
)
def test_openai_bad_or_unsupported_body_fields_name_the_field(fields, field):
    line = openai_row({"messages": [{"role": "user", "content": "hi"}], **fields})
    (item,) = openai_jobs(rows_of(line), {})
    assert isinstance(item, ErrorRecord) and item.field == field, item


def test_openai_harmless_fields_are_accepted():
    line = openai_row(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "seed": 5,
            "n": 3,
            "stop": ["a", "b"],
            "max_completion_tokens": 9,
            "stream": False,
            "tool_choice": "none",
            "tools": [],
            "logit_bias": {},
            "modalities": ["text"],
            "top_logprobs": 0,
            "user": "u",
            "metadata": {"a": "b"},
            "store": False,
            "service_tier": "auto",
        }
    )
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
@pytest.mark.parametrize(
    "sampling, key",
    [
        ('max_new_tokens = "5"', "max_new_tokens"),
        ("temperature = -1.0", "temperature"),
        ("top_p = 1.5", "top_p"),
        ("stop = 3", "stop"),
        ("seed = -2", "seed"),
        ("colour = 1", "colour"),
    ],
)
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
    w.write(w.format.error_record(ErrorRecord("a", 3, "id", "duplicate id 'a'")))  # the run is cut here
    w.close()
    w = ResultWriter(out, "template", "m", resume=True)
    assert not w.answered(job(1, "a")) and not w.answered(job(3, "a"))
    w.write(w.format.result_record(job(1, "a"), result(1)))
    w.write(w.format.error_record(ErrorRecord("a", 3, "id", "duplicate id 'a'")))
    w.close()
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [(r["line"], r["id"], "error" in r) for r in recs] == [(1, "a", False), (3, "a", True)]  # compacted
    w = ResultWriter(out, "template", "m", resume=True)
    assert w.answered(job(1, "a")) and w.answers == {"id:a": (1, job(1, "a").request_hash)}
    w.close()


def test_changed_requests_are_reported_and_rerun_only_when_asked(tmp_path):
    out = tmp_path / "out.jsonl"
    w = ResultWriter(out, "template", "m")
    w.write(w.format.result_record(job(1, "a", "old text"), result(1)))
    w.close()
    w = ResultWriter(out, "template", "m", resume=True)
    assert w.answered(job(1, "a", "old text")) and w.changed == []
    assert w.answered(job(1, "a", "new text")) and w.changed == ["a"]
    w.close()
    w = ResultWriter(out, "template", "m", resume=True, rerun_changed=True)
    assert not w.answered(job(1, "a", "new text"))
    w.write(w.format.result_record(job(1, "a", "new text"), result(2)))
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


def test_a_write_that_fails_says_what_is_safe_and_close_stays_quiet(tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    w = ResultWriter(out, "template", "m")
    w.write(w.format.result_record(job(1, "a"), result(1)))
    real_write = os.write

    def full(fd, data):
        if fd == w.lock.fd:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OutputError, match="No space left on device.*--resume"):
        w.write(w.format.result_record(job(2, "b"), result(2)))
    w.close()  # after the failure: no second error, no traceback from clean-up, the lock released
    monkeypatch.undo()
    assert w.lock.fd is None and len(out.read_text().splitlines()) == 1
    OutputLock(out).acquire().release()


def test_truncated_last_line_is_cut_and_its_row_answered_again(tmp_path):
    out = tmp_path / "out.jsonl"
    w = ResultWriter(out, "openai", "m")
    w.write(w.format.result_record(job(1, "a"), result(1)))
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
    with pytest.raises(OutputLocked, match=rf"PID {os.getpid()}\).*--resume"):
        OutputLock(out).acquire()
    first.release()
    OutputLock(out).acquire().release()
    # A process that takes the lock and dies without releasing it (SIGKILL) leaves nothing that blocks.
    code = (
        f"import os; from pathlib import Path; from chunkgen.jobs.lock import OutputLock; "
        f"OutputLock(Path({str(out)!r})).acquire(); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    OutputLock(out).acquire().release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]  # no sidecar to delete or forget


# -- the output file as a database -----------------------------------------------------------------
def write_records(
    out: Path, *pairs: tuple[Job, Result | ErrorRecord], resume: bool = False, complete: bool = False
) -> ResultWriter:
    w = ResultWriter(out, "template", "m", resume=resume)
    for j, r in pairs:
        w.write(
            w.format.error_record(r, j.request_hash) if isinstance(r, ErrorRecord) else w.format.result_record(j, r)
        )
    w.close(complete=complete)
    return w


def lines_of(out: Path) -> list[dict]:
    return [json.loads(l) for l in out.read_text().splitlines() if l.strip()]


def test_files_that_are_not_chunkgen_output_are_refused_untouched(tmp_path):
    copy = tmp_path / "copy.jsonl"
    text = '{"id": "a", "question": "q", "text": "looks like an answer"}\n{"id": "b", "question": "r"}\n'
    copy.write_text(text)
    os.chmod(copy, 0o640)
    for fmt in ("template", "openai"):
        with pytest.raises(OutputError, match="line 1 is not a chunkgen result record.*nothing was changed"):
            ResultWriter(copy, fmt, "m", resume=True)
    assert copy.read_text() == text and (copy.stat().st_mode & 0o777) == 0o640
    one_line = tmp_path / "one.jsonl"  # a queries file without a final newline is not "a cut record"
    one_line.write_text('{"id": "a", "question": "q"}')
    with pytest.raises(OutputError, match="line 1"):
        ResultWriter(one_line, "template", "m", resume=True)
    assert one_line.read_text() == '{"id": "a", "question": "q"}'
    text_file = tmp_path / "notes.txt"
    text_file.write_text("just some notes")
    with pytest.raises(OutputError, match="line 1"):
        ResultWriter(text_file, "template", "m", resume=True)
    assert text_file.read_text() == "just some notes"
    # Records of this release carry the marker; the previous release's records (no marker, but a
    # request_hash) still resume; a newer format is refused by name.
    out = tmp_path / "out.jsonl"
    write_records(out, (job(1, "a"), result(1)))
    (rec,) = lines_of(out)
    assert rec["chunkgen"] == 1 and rec["request_hash"] == job(1, "a").request_hash
    del rec["chunkgen"]
    out.write_text(json.dumps(rec) + "\n")
    w = ResultWriter(out, "template", "m", resume=True)
    assert w.answered(job(1, "a"))
    w.close()
    out.write_text(json.dumps({**rec, "chunkgen": 2}) + "\n")
    with pytest.raises(OutputError, match="newer chunkgen"):
        ResultWriter(out, "template", "m", resume=True)


def test_resume_finds_answers_by_id_wherever_their_line_moved(tmp_path):
    out = tmp_path / "out.jsonl"
    write_records(out, (job(1, "a", "qa"), result(1)), (job(2, "b", "qb"), result(2)))
    w = ResultWriter(out, "template", "m", resume=True)
    # a header line deleted above (every row one line up), a blank line inserted (one down)
    assert w.answered(job(5, "a", "qa")) and w.answered(job(1, "b", "qb")) and w.changed == []
    assert not w.answered(job(2, "c", "qb"))  # same text, another id: a row of its own
    w.close()


def test_a_rewrite_left_undone_is_finished_by_the_next_resume(tmp_path):
    out = tmp_path / "out.jsonl"
    first = [(job(i, f"r{i}"), result(i)) for i in range(1, 4)]
    write_records(out, *first)
    before = out.read_text()
    # What a run killed inside its final rewrite leaves: a record written twice, and the copy.
    again = ResultWriter(out, "template", "m", resume=True)
    again.write(again.format.result_record(job(2, "r2"), result(2)))
    os.fsync(again.lock.fd)
    again.lock.release()
    leftover = tmp_path / f".out.jsonl.compact-{os.getpid() + 1}"
    leftover.write_text(before[:10])
    w = ResultWriter(out, "template", "m", resume=True)
    assert any("leftover" in n or "interrupted rewrite" in n for n in w.notes)
    assert any("removed 1 superseded" in n for n in w.notes), w.notes
    w.close(complete=True)
    assert sorted(r["id"] for r in lines_of(out)) == ["r1", "r2", "r3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_a_rewrite_keeps_the_mode_and_writes_through_a_symlink(tmp_path):
    real = tmp_path / "data" / "results.jsonl"
    real.parent.mkdir()
    link = tmp_path / "out.jsonl"
    link.symlink_to(real)
    write_records(link, (job(1, "a"), ErrorRecord("a", 1, "prompt", "too long")))
    os.chmod(real, 0o600)
    write_records(link, (job(1, "a"), result(1)), resume=True, complete=True)  # supersedes: a rewrite
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert (real.stat().st_mode & 0o777) == 0o600
    assert [("error" in r) for r in lines_of(real)] == [False]
    assert sorted(p.name for p in real.parent.iterdir()) == ["results.jsonl"]


def test_a_fixed_bad_line_loses_its_old_error_record(tmp_path):
    out = tmp_path / "out.jsonl"
    write_records(
        out,
        (job(1, "a"), result(1)),
        (job(2, "x"), ErrorRecord(None, 2, None, "not valid JSON")),
        (job(3, "c"), ErrorRecord("c", 3, "question", "missing")),
    )
    # Line 2 fixed (it now has the id "b"), a line inserted above line 3 (now line 4, still bad).
    write_records(
        out,
        (job(2, "b"), result(2)),
        (job(4, "c"), ErrorRecord("c", 4, "question", "missing")),
        resume=True,
        complete=True,
    )
    got = sorted((r["line"], r["id"], "error" in r) for r in lines_of(out))
    assert got == [(1, "a", False), (2, "b", False), (4, "c", True)]


def test_a_stopped_run_keeps_earlier_error_records_of_rows_it_did_not_reach(tmp_path):
    out = tmp_path / "out.jsonl"
    write_records(
        out,
        (job(1, "a"), ErrorRecord("a", 1, "prompt", "too long")),
        (job(2, "b"), ErrorRecord("b", 2, "prompt", "too long")),
    )
    write_records(out, (job(1, "a"), result(1)), resume=True, complete=False)
    assert sorted((r["id"], "error" in r) for r in lines_of(out)) == [("a", False), ("b", True)]


def test_a_complete_last_record_without_its_newline_is_kept(tmp_path):
    out = tmp_path / "out.jsonl"
    write_records(out, (job(1, "a"), result(1)), (job(2, "b"), result(2)))
    out.write_bytes(out.read_bytes()[:-1])
    w = ResultWriter(out, "template", "m", resume=True)
    assert w.answered(job(1, "a")) and w.answered(job(2, "b")) and "newline" in w.notes[0]
    w.write(w.format.result_record(job(3, "c"), result(3)))
    w.close()
    assert [r["id"] for r in lines_of(out)] == ["a", "b", "c"]


def test_the_lock_is_the_files_whatever_its_name(tmp_path):
    out = tmp_path / "out.jsonl"
    w = ResultWriter(out, "template", "m")
    w.write(w.format.result_record(job(1, "a"), result(1)))
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.jsonl").symlink_to(out)
    os.link(out, tmp_path / "hard.jsonl")
    for name in (tmp_path / "link.jsonl", tmp_path / "hard.jsonl", tmp_path / "sub" / ".." / "out.jsonl"):
        with pytest.raises(OutputLocked, match=rf"PID {os.getpid()}"):
            ResultWriter(name, "template", "m", resume=True)
    w.close()
    ResultWriter(tmp_path / "hard.jsonl", "template", "m", resume=True).close()


def test_the_lock_passes_to_the_rewritten_file_without_a_gap(tmp_path):
    out = tmp_path / "out.jsonl"
    write_records(out, (job(1, "a"), ErrorRecord("a", 1, "prompt", "too long")))
    w = ResultWriter(out, "template", "m", resume=True)
    w.write(w.format.result_record(job(1, "a"), result(1)))
    inode = out.stat().st_ino
    w._rewrite(None)  # what close() does at the end of a run, here with the run still going
    w._scan()
    assert out.stat().st_ino != inode and w.lock.still_named()
    with pytest.raises(OutputLocked):
        ResultWriter(out, "template", "m", resume=True)
    w.write(w.format.result_record(job(2, "b"), result(2)))
    w.close()
    assert [r["id"] for r in lines_of(out)] == ["a", "b"]


@pytest.mark.parametrize("remove", ["file", "directory"])
def test_an_output_removed_mid_run_stops_the_run_with_one_message(tmp_path, remove):
    import shutil

    out = tmp_path / "d" / "out.jsonl"
    w = ResultWriter(out, "template", "m")
    w.write(w.format.result_record(job(1, "a"), result(1)))
    if remove == "file":
        out.unlink()
    else:
        shutil.rmtree(out.parent)
    with pytest.raises(OutputError, match="deleted, moved or replaced"):
        w.write(w.format.result_record(job(2, "b"), result(2)))
    w.close()  # quiet: nothing more to say
    assert w.lock.fd is None


def test_a_vanished_output_is_noticed_at_the_end_too(tmp_path):
    out = tmp_path / "out.jsonl"
    w = ResultWriter(out, "template", "m")
    w.write(w.format.result_record(job(1, "a"), result(1)))
    out.rename(tmp_path / "moved.jsonl")
    with pytest.raises(OutputError, match="deleted, moved or replaced"):
        w.close()
    assert w.lock.fd is None


def test_records_of_text_without_a_utf8_form_are_still_written(tmp_path):
    out = tmp_path / "out.jsonl"
    res = Result(1, 5, 0, [Completion("half a pair \ud800", [1], "stop")])
    write_records(out, (job(1, "a"), res))
    assert lines_of(out)[0]["text"] == "half a pair \ud800"


# -- no row can abort the job ----------------------------------------------------------------------
def test_values_a_later_step_cannot_handle_become_the_rows_error_records():
    lines = [
        '{"id": "s", "question": "\\ud800 alone"}',
        '{"id": "k", "question": "x", "\\udfff": 1}',
        '{"id": "n", "question": "x", "seed": ' + "9" * 5000 + "}",
        '{"id": "d", "question": "x", "stop": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"id": "ok", "question": "fine"}',
    ]
    items = list(template_jobs(rows_of(*lines), templates(), {}))
    assert [type(i).__name__ for i in items] == ["ErrorRecord"] * 4 + ["Job"]
    assert items[0].field == "question" and "surrogate" in items[0].message
    assert "surrogate" in items[1].message
    assert items[2].field == "seed" and "integer" in items[2].message  # a huge integer is data: out of range here
    assert [i.id for i in items[:4]] == ["s", "k", "n", None]  # every readable id is kept
    assert "nested too deeply" in items[3].message
    batch = '{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "\\udc00"}]}}'
    (err,) = openai_jobs(rows_of(batch), {})
    assert err.field == "body.messages[0].content" and "surrogate" in err.message


def test_a_row_that_is_not_utf8_is_an_error_record_naming_its_id_line_and_field():
    """A Latin-1 row among UTF-8 ones (a spreadsheet's export): its record says where the byte is,
    names the row by its id and the field holding the byte; a row whose bytes are no JSON at all
    still gets its line."""
    latin1 = '{"id": "b", "question": "caf\u00e9"}'.encode("latin-1")
    items = list(template_jobs(rows_of('{"id": "a", "question": "x"}', latin1, b"\x80 garbage"), templates(), {}))
    assert [type(i).__name__ for i in items] == ["Job", "ErrorRecord", "ErrorRecord"]
    err = items[1]
    assert (err.id, err.line, err.field) == ("b", 2, "question")
    assert err.message == "not UTF-8 text (the byte 0xe9 at column 29); save the file as UTF-8"
    assert (items[2].id, items[2].line, items[2].field) == (None, 3, None) and "0x80 at column 1" in items[2].message
    batch = b'{"custom_id": "c", "body": {"messages": [{"role": "user", "content": "\xe9"}]}}'
    (err,) = openai_jobs(rows_of(batch), {})
    assert (err.id, err.field) == ("c", "body.messages[0].content") and "not UTF-8" in err.message


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
TEMPLATE_FIELDS = ["id", "question", "template", *sorted(TEMPLATE_OVERRIDES)]
OPENAI_FIELDS = [
    "custom_id",
    "method",
    "url",
    "body",
    "body.messages",
    "body.response_format",
    "body.stop",
    "body.max_tokens",
    "body.logprobs",
    "body.top_logprobs",
    "body.n",
    "body.temperature",
]


def _row_lines():
    """Lines as hostile as files get: random bytes, every JSON type in every field, lone surrogates,
    deep nesting, literals too long to convert."""

    def assign(fields):
        def build(values):
            row: dict = {}
            for name, value in values.items():
                head, _, rest = name.partition(".")
                if rest:
                    row.setdefault(head, {}) if isinstance(row.get(head), dict) or head not in row else None
                    if isinstance(row.get(head), dict):
                        row[head][rest] = value
                else:
                    row[head] = value
            return json.dumps(row, ensure_ascii=True).encode()

        return st.dictionaries(st.sampled_from(fields), JSON_VALUES, max_size=6).map(build)

    surrogate = st.sampled_from(
        [
            b'{"id": "a", "question": "\\ud800"}',
            b'{"id": "\\udfff", "question": "q"}',
            b'{"custom_id": "c", "body": {"messages": [{"role": "user", "content": "\\ud83d"}]}}',
        ]
    )
    deep = st.integers(1, 50_000).map(lambda n: b'{"id": "d", "question": ' + b"[" * n + b"]" * n + b"}")
    huge = st.sampled_from(
        [
            b'{"id": 1' + b"0" * 5000 + b', "question": "q"}',
            b'{"id": "h", "question": 1e999}',
            b'{"id": "h", "question": "q", "max_new_tokens": 1' + b"0" * 400 + b"}",
        ]
    )
    return st.binary(max_size=40) | assign(TEMPLATE_FIELDS) | assign(OPENAI_FIELDS) | surrogate | deep | huge


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_row_lines(), min_size=1, max_size=6))
def test_fuzzed_rows_each_become_a_job_or_an_error_record_and_a_writable_record(lines):
    data = b"".join(l.replace(b"\n", b" ") + b"\n" for l in lines)
    numbered = [n for n, l in enumerate(data.split(b"\n")[:-1], start=1) if l.strip()]
    fmt = RecordFormat("template", "m")
    for reader in (lambda rows: template_jobs(rows, templates(), {}), lambda rows: openai_jobs(rows, {})):
        items = list(reader(read_rows(io.BytesIO(data))))
        assert [i.line for i in items] == numbered  # one each, in order, none lost
        for item in items:
            if isinstance(item, Job):
                _ = item.request_hash  # hashing and encoding a job's own record cannot fail
                record = fmt.result_record(
                    item, Result(0, 1, 0, [Completion(item.messages[-1]["content"], [1], "stop")])
                )
            else:
                record = fmt.error_record(item)
            assert json.loads(encode_record(record))["line"] == item.line


def test_a_kv_budget_too_small_for_a_rows_samples_is_said_once(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from chunkgen.cli import app

    template = tmp_path / "t.toml"
    template.write_text('system = "S"\nuser = "{q}"\n')
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps({"id": f"r{i}", "q": f"Is {i} odd?", "n": 8}) + "\n" for i in range(3)))
    args = base_args(
        tiny_model, tmp_path / "out.jsonl", queries, template, kv_memory="96KiB", quiet=None, max_new_tokens=40
    )
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    warnings = [l for l in res.output.splitlines() if "cannot hold line" in l]
    assert len(warnings) == 1, res.output
    assert "8 sample(s)" in warnings[0] and "KiB would hold them" in warnings[0]


def test_a_kv_budget_too_small_for_the_batchs_prompts_is_said_once(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from chunkgen.cli import app

    template = tmp_path / "t.toml"
    template.write_text('system = "S"\nuser = "{q}"\n')
    queries = tmp_path / "q.jsonl"
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    rows = [{"id": f"r{i}", "q": " ".join(words[(i + j) % 10] for j in range(8)) + f" {i}"} for i in range(24)]
    queries.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = base_args(
        tiny_model,
        tmp_path / "out.jsonl",
        queries,
        template,
        kv_memory="96KiB",
        quiet=None,
        max_new_tokens=4,
        max_batch=24,
    )
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    warnings = [l for l in res.output.splitlines() if "rows wait for memory" in l]
    assert len(warnings) == 1, res.output
    assert "--max-batch allows 24" in warnings[0] and "would hold 24 rows" in warnings[0]
    assert len(records(tmp_path / "out.jsonl")) == 24  # nothing lost: every row answered, only later
