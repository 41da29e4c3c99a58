"""The README's first set-up command, `make demo`, as a fresh checkout runs it: its output folder
does not exist yet (results/ is ignored by git)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_runs_the_main_job_into_a_new_folder(default_model_dir, tmp_path):
    venv = Path(sys.prefix)
    if not (venv / ".installed").exists() or (ROOT / ".venv").resolve() != venv.resolve():
        pytest.skip("runs inside the project's own .venv (make test's), where make demo installs nothing")
    out = tmp_path / "not" / "yet" / "answers.jsonl"
    queries = ROOT / "prompts" / "tool_dispatcher.queries.jsonl"
    proc = subprocess.run(["make", "-s", "demo", f"OUT={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == sum(1 for line in queries.read_text().splitlines() if line.strip())
