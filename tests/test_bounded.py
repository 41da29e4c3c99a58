"""Reading without trusting sizes or encodings: endless devices, overlong lines, UTF-16 and binary
files, duplicate JSON keys, unused fields and long lists of choices, each one line."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chunkgen.bounded import ROW_BYTES, Overlong, TooLarge, bad_byte, first_bad_line, lines, read_text
from chunkgen.jobs.requests import ErrorRecord, Job, template_jobs
from chunkgen.jobs.templates import load_templates
from tests.cli.test_mistakes import _env
from tests.helpers import PROMPTS, rows_of


def test_a_device_or_an_endless_file_is_refused_not_read():
    with pytest.raises(TooLarge, match="is a device"):
        read_text("/dev/zero")


def test_a_file_past_the_limit_stops_there(tmp_path):
    sparse = tmp_path / "sparse.toml"
    with open(sparse, "wb") as f:
        f.truncate(10 << 30)  # 10 GiB of holes: nothing is read past the limit
    t0 = time.perf_counter()
    with pytest.raises(TooLarge, match="larger than 1.0 MiB"):
        read_text(sparse, limit=1 << 20)
    assert time.perf_counter() - t0 < 2


def test_utf16_is_named_as_such(tmp_path):
    path = tmp_path / "t.toml"
    path.write_bytes('user = "{q}"\n'.encode("utf-16"))
    with pytest.raises(ValueError, match="UTF-16 text, not UTF-8"):
        read_text(path)


def test_latin1_text_is_refused_at_its_line_column_and_byte(tmp_path):
    """A Latin-1 file (a Windows editor's) names where UTF-8 breaks, as an editor would show it."""
    path = tmp_path / "t.toml"
    path.write_bytes('name = "t"\nsystem = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"is not UTF-8 text \(line 2 has the byte 0xe9 at column 14\)"):
        read_text(path)
    assert bad_byte(b"ab\ncd\xe9", 5, line=10) == "line 11 has the byte 0xe9 at column 3"
    assert first_bad_line(path) == "line 2 has the byte 0xe9 at column 14"
    path.write_bytes(b"fine\n")
    assert first_bad_line(path) is None


def test_an_overlong_line_is_skipped_in_bounded_memory():
    stream = io.BytesIO(b'{"a": 1}\n' + b"x" * 5000 + b"\n" + b'{"b": 2}\n')
    got = list(lines(stream, limit=1000))
    assert got[0] == b'{"a": 1}\n' and got[2] == b'{"b": 2}\n'
    assert isinstance(got[1], Overlong) and got[1].size == 5001 and len(got[1]) <= 1024


def _jobs(*lines_: str, templates=None, on_note=None):
    templates = templates or load_templates(PROMPTS / "arithmetic_cot.toml")
    return list(template_jobs(rows_of(*lines_), templates, {}, on_note=on_note))


def test_a_duplicate_key_is_an_error_record_naming_it():
    (item,) = _jobs('{"id": "a", "question": "x", "question": "y"}')
    assert isinstance(item, ErrorRecord) and item.field == "question" and "twice" in item.message


def test_an_unused_field_is_said_once_per_job():
    notes: list[str] = []
    items = _jobs(*[json.dumps({"question": f"q{i}", "logit_bias": {"1": 5}}) for i in range(5)], on_note=notes.append)
    assert all(isinstance(i, Job) for i in items)
    assert len(notes) == 1 and "'logit_bias' is not used" in notes[0] and "line 1" in notes[0]


def test_choices_in_an_error_are_a_few(tmp_path):
    for i in range(300):
        (tmp_path / f"t{i}.toml").write_text(f'name = "t{i}"\nuser = "{{q}}"\n')
    (item,) = _jobs('{"template": "t29x", "q": "hi"}', templates=load_templates(tmp_path))
    assert isinstance(item, ErrorRecord) and "(300 in all)" in item.message and item.message.count("'t") <= 7
    assert "'t29'" in item.message  # the closest first


def _rss_run(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, int]:
    """A CLI run in a child, with its peak RSS in bytes (measured by a wrapper around it)."""
    wrapper = (
        "import resource, subprocess, sys;"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True);"
        "sys.stderr.write(p.stderr); sys.stdout.write(p.stdout);"
        "print('RSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss);"
        "sys.exit(p.returncode)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, sys.executable, "-m", "chunkgen", "run", "--quiet", *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    rss = int(proc.stdout.split("RSS")[-1]) * 1024
    return proc, rss


def test_a_200mb_row_and_dev_zero_are_refused_in_bounded_memory(tiny_model, tmp_path):
    common = ["-t", str(PROMPTS / "arithmetic_cot.toml"), "--model", str(tiny_model), "--max-new-tokens", "2"]
    common += ["--kv-memory", "64MiB", "--chunk-size", "16", "--order", "input"]
    normal = tmp_path / "normal.jsonl"
    normal.write_text('{"id": "a", "question": "What is 2 + 2?"}\n{"id": "b", "question": "Is 7 prime?"}\n')
    ok, base = _rss_run(["-q", str(normal), "-o", str(tmp_path / "o1.jsonl"), *common], tmp_path)
    assert ok.returncode == 0, ok.stderr
    huge = tmp_path / "huge.jsonl"
    with open(huge, "wb") as f:  # written in pieces: the test holds none of it
        f.write(b'{"id": "a", "question": "What is 2 + 2?"}\n{"id": "big", "question": "')
        for _ in range(200):
            f.write(b"x" * (1 << 20))
        f.write(b'"}\n')
    assert huge.stat().st_size > 200 << 20 > ROW_BYTES
    big, rss = _rss_run(["-q", str(huge), "-o", str(tmp_path / "o2.jsonl"), *common], tmp_path)
    recs = [json.loads(l) for l in (tmp_path / "o2.jsonl").read_text().splitlines()]
    assert big.returncode == 3 and [r.get("error") is None for r in recs].count(True) == 1, big.stderr
    (bad,) = [r for r in recs if r.get("error")]
    assert bad["line"] == 2 and "skipped unread" in bad["error"]["message"]
    assert rss < 1.5 * base, (rss, base)
    for option in ("-q", "-t"):
        args = ["-q", str(normal), "-o", str(tmp_path / "o3.jsonl"), *common]
        args[args.index(option) + 1] = "/dev/zero"
        zero, rss = _rss_run(args, tmp_path)
        lines_ = [l for l in zero.stderr.splitlines() if l.strip()]
        assert zero.returncode in (1, 2) and len(lines_) == 1 and "/dev/zero" in lines_[0], zero.stderr
        assert rss < 1.5 * base
