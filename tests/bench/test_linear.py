"""`bench linear`: every cell timed against the fp32 product on the same shape and rows (and the bf16
one where the CPU has a bf16 path); a K-quant left out where k is not whole super-blocks."""

from __future__ import annotations

import pytest
import torch

from chunkgen._native import native_cpu_available

pytestmark = pytest.mark.skipif(
    not native_cpu_available() or not hasattr(torch.ops.chunkgen, "quant_linear"),
    reason="chunkgen's CPU kernels are not built",
)


def test_rows_against_fp32_and_bf16():
    from chunkgen.bench.linear import run_linear
    from chunkgen.model.llama import decode_product_available

    bf16 = decode_product_available()
    rows = run_linear(((16, 256), (8, 96)), (1, 5), ("q4_k", "q8_0", "int8"), min_seconds=0.0)
    cells = {(r["n"], r["k"], r["rows"], r["type"]) for r in rows}
    types = ("fp32", "q4_k", "q8_0", "int8") + (("bf16",) if bf16 else ())
    assert cells == {(n, k, m, t) for n, k in ((16, 256), (8, 96)) for m in (1, 5) for t in types} - {
        (8, 96, m, "q4_k") for m in (1, 5)
    }
    for r in rows:
        assert r["ms"] > 0 and r["gflops"] == pytest.approx(2 * r["n"] * r["k"] * r["rows"] / r["ms"] / 1e6)
        if r["type"] == "fp32":
            assert r["vs_fp32"] == 1.0
        assert (r["vs_bf16"] is not None) == bf16
        if r["type"] == "bf16":
            assert r["vs_bf16"] == 1.0


def test_cli_refuses_bad_types_and_shapes():
    from tests.helpers import run_cli

    result = run_cli("bench", "linear", "--types", "q3_k")
    assert result.exit_code != 0 and "--types takes a subset of" in result.output
    result = run_cli("bench", "linear", "--shapes", "8x100")
    assert result.exit_code != 0 and "multiple of 32" in result.output


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_products_run_as_an_engine_with_the_same_batch_invariance_runs_them(monkeypatch, batch_invariant):
    """With batch-invariant numerics every float call takes chunkgen's packed product (a bench that
    timed oneDNN's instead hid a 30% loss at k = 2,048); the process's own setting comes back."""
    from chunkgen.bench.linear import run_linear
    from chunkgen.kernels import invariant
    from chunkgen.model import llama

    seen = []
    call = llama.Linear.__call__

    def spy(self, x):
        seen.append(invariant.enabled())
        return call(self, x)

    monkeypatch.setattr(llama.Linear, "__call__", spy)
    before = invariant.enabled()
    run_linear(((16, 64),), (40,), ("int8",), min_seconds=0.0, batch_invariant=batch_invariant)
    assert seen and set(seen) == {batch_invariant}
    assert invariant.enabled() == before
