"""`bench kernel`: chunkgen's op runs as an engine with the same --batch-invariant runs it."""

from __future__ import annotations

import pytest
import torch

from chunkgen._native import native_cpu_available

pytestmark = pytest.mark.skipif(not native_cpu_available(), reason="chunkgen's CPU kernels are not built")


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_the_op_runs_with_the_asked_numerics_and_the_setting_comes_back(monkeypatch, batch_invariant):
    from chunkgen.bench import kernel
    from chunkgen.kernels import invariant

    seen = []
    op = kernel.decode_attention

    def spy(*args, **kwargs):
        seen.append(invariant.enabled())
        return op(*args, **kwargs)

    monkeypatch.setattr(kernel, "decode_attention", spy)
    before = invariant.enabled()
    shape = kernel.Shape(batch=3, q_heads=4, kv_heads=2, head_dim=32, chunk=16, n_p=64, n_s=32)
    rows = kernel.run_grid([shape], torch.float32, repeats=1, impls=("paged", "chunk_tpp"),
                           batch_invariant=batch_invariant)  # fmt: skip
    assert {r["impl"] for r in rows} == {"paged", "chunk_tpp"}
    assert all(r["batch_invariant"] == batch_invariant for r in rows)
    assert seen and set(seen) == {batch_invariant}
    assert invariant.enabled() == before
