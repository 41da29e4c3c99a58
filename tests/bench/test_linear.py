"""`bench linear`: every cell timed against the fp32 product on the same shape and rows; a K-quant
left out where k is not whole super-blocks."""

from __future__ import annotations

import pytest
import torch

from chunkgen._native import native_cpu_available

pytestmark = pytest.mark.skipif(
    not native_cpu_available() or not hasattr(torch.ops.chunkgen, "quant_linear"),
    reason="chunkgen's CPU kernels are not built",
)


def test_rows_against_fp32():
    from chunkgen.bench.linear import run_linear

    rows = run_linear(((16, 256), (8, 96)), (1, 5), ("q4_k", "q8_0", "int8"), min_seconds=0.0)
    cells = {(r["n"], r["k"], r["rows"], r["type"]) for r in rows}
    assert cells == {
        (n, k, m, t) for n, k in ((16, 256), (8, 96)) for m in (1, 5) for t in ("fp32", "q4_k", "q8_0", "int8")
    } - {(8, 96, m, "q4_k") for m in (1, 5)}
    for r in rows:
        assert r["ms"] > 0 and r["gflops"] == pytest.approx(2 * r["n"] * r["k"] * r["rows"] / r["ms"] / 1e6)
        if r["type"] == "fp32":
            assert r["vs_fp32"] == 1.0


def test_cli_refuses_bad_types_and_shapes():
    from tests.helpers import run_cli

    result = run_cli("bench", "linear", "--types", "q3_k")
    assert result.exit_code != 0 and "--types takes a subset of" in result.output
    result = run_cli("bench", "linear", "--shapes", "8x100")
    assert result.exit_code != 0 and "multiple of 32" in result.output
