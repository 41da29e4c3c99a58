"""The CUDA path, on a GPU only: the kernel against the same naive reference as the CPU tests, and
the engine's greedy output against transformers. Skipped where there is no GPU or no CUDA build."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from chunkgen import native_cuda_available
from tests.test_cuda_emulated import TOLERANCE

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (torch.cuda.is_available() and native_cuda_available()),
                       reason="needs a CUDA GPU and chunkgen built with CUDA kernels"),
]


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000), n_seqs=st.integers(1, 24), shared_len=st.integers(0, 400),
    chunk=st.sampled_from([32, 64, 128]), heads=st.sampled_from([(8, 8), (8, 2), (9, 3), (32, 32)]),
    head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    chunk_first=st.booleans(),
)
def test_cuda_kernel_matches_reference(seed, n_seqs, shared_len, chunk, heads, head_dim, dtype, chunk_first):
    from chunkgen.cache import KernelContext
    from chunkgen.kernels import decode_attention
    from chunkgen.kernels.reference import reference_decode_attention
    from tests.test_kernels import build_tree

    q_heads, kv_heads = heads
    pool, tree = build_tree(seed, n_seqs, shared_len, chunk, kv_heads, head_dim, dtype, decode_steps=2)
    ctx = KernelContext(tree, chunk_first=chunk_first)
    q = torch.randn(ctx.batch_size, q_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    out = decode_attention(q.cuda(), pool.k[0].cuda(), pool.v[0].cuda(), ctx, head_dim ** -0.5).cpu()
    ref = reference_decode_attention(q, pool, tree, 0, ctx.order, head_dim ** -0.5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_cuda_engine_greedy_matches_transformers(tiny_model):
    from chunkgen.engine import SamplingParams
    from chunkgen.llm import LLM
    from tests.test_engine import assert_parity, template_prompts

    llm = LLM(model=str(tiny_model), dtype="fp32", device="cuda", chunk_size=32, kv_memory="256MiB")
    prompts = template_prompts("arithmetic_cot", 8)
    results = llm.generate(prompts, SamplingParams(max_new_tokens=16))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).cuda()
    for p, r in zip(prompts, results):
        ids = llm.encode(p)
        ref = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        assert_parity(hf, ids, r.token_ids, ref)
