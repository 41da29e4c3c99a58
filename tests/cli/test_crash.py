"""Crash consistency of the output file: `--resume` runs killed with SIGKILL at random moments,
including inside the end-of-run rewrite, then resumed to the end, leave every row's record exactly
once, the same answers as an uninterrupted run, and no temporary file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import PROMPTS, ROOT


def test_kill_9_at_random_moments_then_resume_loses_and_duplicates_nothing(tiny_model, tmp_path):
    queries = tmp_path / "q.jsonl"
    lines = []
    for i in range(240):
        if i % 25 == 7:
            lines.append(json.dumps({"id": f"bad{i}", "question": "x", "temperature": -1}))  # an error record each run
        elif i % 25 == 13:
            lines.append("not json")
        else:
            lines.append(json.dumps({"id": f"r{i}", "question": f"What is {i} + {i % 7}?"}))
    queries.write_text("\n".join(lines) + "\n")
    out, reference = tmp_path / "out" / "out.jsonl", tmp_path / "ref" / "ref.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.cli.crash_driver",
            "--model",
            str(tiny_model),
            "--queries",
            str(queries),
            "--template",
            str(PROMPTS / "arithmetic_cot.toml"),
            "--out",
            str(out),
            "--reference",
            str(reference),
            "--kills",
            "22",
            "--seed",
            "29",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = json.loads(proc.stdout.splitlines()[-1])
    kills = [e for e in log if e["killed"]]
    assert len(kills) >= 22
    in_rewrite = [e for e in kills if e["kind"] != "timer"]
    assert len(in_rewrite) >= 5 and any(e["leftover_copy"] for e in in_rewrite), log
    cut_mid_job = [e for e in kills if e["kind"] in ("timer", "mid-job") and 0 < e["lines"] < len(lines)]
    assert len(cut_mid_job) >= 5 and len({e["lines"] for e in cut_mid_job}) >= 5, (
        log
    )  # the job itself was cut several times, not only its rewrite

    def by_row(path: Path) -> dict:
        recs = [json.loads(l) for l in path.read_text().splitlines()]
        keys = [r["id"] if r["id"] is not None else f"line:{r['line']}" for r in recs]
        assert len(keys) == len(set(keys)), "a row has two records"
        return dict(zip(keys, recs))

    got, want = by_row(out), by_row(reference)
    assert set(got) == set(want) and len(got) == len(lines)
    for key, rec in want.items():
        assert got[key].get("text") == rec.get("text") and got[key].get("error") == rec.get("error"), key
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.jsonl"]
