"""benchmarks/linear_from_memory.py, a step's linear products with their weights from memory: a small
run prints the shape's products and one line per round, in each dtype the CPU runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from chunkgen._native import native_cpu_available
from chunkgen.model.llama import decode_product_available

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "linear_from_memory.py"


@pytest.mark.skipif(not native_cpu_available(), reason="the CPU kernels are not built")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_small_run_prints_each_round(dtype):
    if dtype == "bf16" and not decode_product_available():
        pytest.skip("the bf16 product needs AMX or AVX512_BF16")
    args = ["--model", "smollm2-135m", "--layers", "2", "--rows", "3", "--rounds", "2", "--dtype", dtype]
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=True).stdout
    # 2 layers x 4 products and the lm_head: 960x576, 576x576, 3072x576, 576x1536 twice, 49152x576
    mib = (2 * (960 + 576 + 3072) * 576 + 2 * 576 * 1536 + 49152 * 576) * (2 if dtype == "bf16" else 4) / 2**20
    assert f"smollm2-135m, 9 products, {mib:.0f} MiB of {dtype} weights, 3 rows" in out
    rounds = re.findall(r"round (\d): ([\d.]+) ms a step, (\d+) GFLOP/s", out)
    assert [r for r, _, _ in rounds] == ["1", "2"]
    assert all(float(ms) > 0 and int(rate) > 0 for _, ms, rate in rounds)
