"""benchmarks/decode_kernel_modes.py, the decode kernel's two modes side by side: a small run prints
one line per round and mode, each with the kernel's own split of the call."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from chunkgen._native import native_cpu_available

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_kernel_modes.py"


@pytest.mark.skipif(not native_cpu_available(), reason="the CPU decode kernel is not built")
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp32"])
def test_a_small_run_prints_both_modes_each_round(kv_dtype):
    args = ["--rows", "5", "--shared", "130", "--heads", "2,6,64", "--layers", "2", "--steps", "1", "--rounds", "2"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--kv-dtype", kv_dtype], capture_output=True, text=True, check=True
    ).stdout
    lines = re.findall(r"round (\d) invariant (on |off): +(\d+) us a layer \(plan \d+, chunk-first (\d+), ", out)
    assert [(r, m.strip()) for r, m, _, _ in lines] == [("1", "on"), ("1", "off"), ("2", "on"), ("2", "off")]
    assert all(int(total) >= int(cf) for _, _, total, cf in lines)
    assert f"{kv_dtype} K/V" in out
