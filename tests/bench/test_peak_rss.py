"""benchmarks/peak_rss.py on the default model's GGUF: one JSON line with the peaks after the load
and the job, the K/V it wrote, and peak less K/V over the file's size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peak_rss.py"


@pytest.mark.real_model
def test_a_small_job_reports_its_peaks():
    from chunkgen.model import ModelNotFound
    from chunkgen.model.loading import default_gguf

    try:
        gguf = default_gguf()
    except ModelNotFound as exc:
        pytest.skip(str(exc))
    args = [str(gguf), "--shared", "100", "--rows", "3", "--new", "2"]
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["file_gib"] == round(gguf.stat().st_size / 2**30, 3)
    assert 0 < report["after_load"]["rss_gib"] <= report["after_job"]["peak_gib"]
    assert report["kv_written_gib"] > 0
    expected = (report["after_job"]["peak_gib"] - report["kv_written_gib"]) / report["file_gib"]
    assert report["peak_less_kv_over_file"] == pytest.approx(expected, abs=1e-3)
