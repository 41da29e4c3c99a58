"""`bench step` on quantized weights: the quantized products are timed and counted as linear layers."""

from __future__ import annotations

import pytest
import torch

from chunkgen._native import native_cpu_available
from chunkgen.engine.threads import configured_threads

pytestmark = pytest.mark.skipif(
    not native_cpu_available() or not hasattr(torch.ops.chunkgen, "quant_linear"),
    reason="chunkgen's CPU kernels are not built",
)


def test_step_profile_counts_quantized_products(tiny_model):
    from chunkgen.bench import step as bench
    from chunkgen.llm import LLM
    from chunkgen.model.quant import QuantLinear

    llm = LLM(str(tiny_model), quantize="int8", dtype="fp32", kv_memory="64MiB", chunk_size=16)
    m = llm.model
    linears = [w for layer in m.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [m.lm_head]
    assert all(isinstance(w, QuantLinear) for w in linears[:-1])
    prompts = [[5] * 32 + [20 + i] * 3 for i in range(3)]
    r = bench.profile_steps(llm, prompts, 2)

    def weights(w) -> int:
        return w.out_features * w.weights[0].k if isinstance(w, QuantLinear) else w.weight.numel()

    assert r["linear_gflop"] * 1e9 == pytest.approx(2 * len(prompts) * sum(weights(w) for w in linears))
    assert 0 < r["linear_ms"] <= r["step_ms"]
    assert 0 < r["engine_cpu_ms"] <= r["step_ms"]  # one thread's CPU time within the steps' wall time
    assert 0 < r["prefill_linear_s"] <= r["prefill_s"]
    assert r["threads"] and all(1 <= t <= configured_threads() for t in r["threads"])  # as the steps ran


def test_the_step_line_says_the_threads_the_steps_ran_on():
    from chunkgen.cli.bench import _on_threads

    assert _on_threads([2]) == " on 2 threads" and _on_threads([1]) == " on 1 thread"
    assert _on_threads([1, 2]) == " on 1-2 threads" and _on_threads([]) == ""
