"""bench e2e's count of kernels a decode step: where it is counted, and what it leaves out."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from chunkgen.bench.e2e import decode_kernels_per_step, is_kernel


def engine_on(device: str, capture=None):
    runner = SimpleNamespace(device=torch.device(device), largest_capture=lambda: capture)
    return SimpleNamespace(runner=runner)


def test_kernels_are_counted_on_cuda_graphs_only_and_say_why_not():
    count, note = decode_kernels_per_step(engine_on("cpu"))
    assert count is None and "CUDA only" in note
    count, note = decode_kernels_per_step(engine_on("cuda"))  # stepped eagerly: no graph to count
    assert count is None and "eagerly" in note


def test_copies_and_fills_are_not_kernels():
    assert is_kernel("void chunkgen::(anonymous namespace)::sequence_first_kernel<__nv_bfloat16, false>(...)")
    assert is_kernel("sm90_xmma_gemm_bf16bf16_bf16f32")
    assert not is_kernel("Memcpy HtoD (Pinned -> Device)") and not is_kernel("Memset (Device)")
