"""The native two-phase kernel against the naive reference, on randomized prefix trees."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from chunkgen.cache import ChunkPool, KernelContext, PrefixTree
from chunkgen.kernels import decode_attention
from chunkgen.kernels.reference import reference_decode_attention


def build_tree(seed, n_seqs, shared_len, chunk, kv_heads, head_dim, dtype, max_private=100, decode_steps=0):
    """A random tree: most prompts extend one system prompt, some stop inside it, some repeat an
    earlier prompt exactly (so a partly filled chunk is shared). K/V are random where tokens are and
    NaN everywhere else, like uninitialised pool memory: a kernel that reads past a chunk's length
    fails loudly."""
    rnd = random.Random(seed)
    pool = ChunkPool(1, kv_heads, head_dim, chunk, dtype, budget_bytes=1 << 27)
    tree = PrefixTree(pool)
    system = [rnd.randrange(50) for _ in range(shared_len)]
    prompts = []
    for s in range(n_seqs):
        if prompts and rnd.random() < 0.2:
            toks = list(rnd.choice(prompts))
        else:
            cut = rnd.randrange(0, shared_len + 1) if rnd.random() < 0.3 else shared_len
            toks = system[:cut] + [rnd.randrange(50) for _ in range(rnd.randrange(0 if cut else 1, max_private + 1))]
        prompts.append(toks)
        tree.insert(s, toks)
        tree.mark_ready(s)
    for _ in range(decode_steps):
        for s in range(n_seqs):
            tree.append(s, rnd.randrange(50))
    gen = torch.Generator().manual_seed(seed)
    n = pool.capacity
    written = torch.zeros(n, chunk, dtype=torch.bool)
    for s in range(n_seqs):
        slots, offsets = tree.positions(s, 0, tree.lengths[s])
        written[torch.tensor(slots), torch.tensor(offsets)] = True
    k = torch.randn(pool.k[0, :n].shape, generator=gen)  # [slots, kv_heads, head_dim, chunk]
    v = torch.randn(pool.v[0, :n].shape, generator=gen)  # [slots, kv_heads, chunk, head_dim]
    k.masked_fill_(~written[:, None, None, :], float("nan"))
    v.masked_fill_(~written[:, None, :, None], float("nan"))
    pool.k[0, :n], pool.v[0, :n] = k.to(dtype), v.to(dtype)
    return pool, tree


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(1, 12),
    shared_len=st.integers(0, 300),
    chunk=st.sampled_from([16, 32, 64, 128, 256]),
    heads=st.sampled_from([(4, 4), (8, 2), (9, 3), (6, 1)]),
    head_dim=st.sampled_from([64, 128, 80]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    decode_steps=st.integers(0, 3),
    chunk_first=st.booleans(),
)
def test_kernel_matches_reference(seed, n_seqs, shared_len, chunk, heads, head_dim, dtype, decode_steps, chunk_first):
    q_heads, kv_heads = heads
    pool, tree = build_tree(seed, n_seqs, shared_len, chunk, kv_heads, head_dim, dtype, decode_steps=decode_steps)
    ctx = KernelContext(tree, chunk_first=chunk_first)
    q = torch.randn(ctx.batch_size, q_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    scale = head_dim ** -0.5
    out = decode_attention(q, pool.k[0], pool.v[0], ctx, scale)
    ref = reference_decode_attention(q, pool, tree, 0, ctx.order, scale)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["batch1_many_chunks", "all_identical", "no_sharing", "empty_private"])
def test_kernel_edge_trees(case):
    chunk, kvh, hq, d = 64, 3, 9, 64
    pool = ChunkPool(1, kvh, d, chunk, torch.float32, budget_bytes=1 << 27)
    tree = PrefixTree(pool)
    insert = lambda s, toks: (tree.insert(s, toks), tree.mark_ready(s))
    if case == "batch1_many_chunks":
        insert(0, list(range(64 * 40 + 17)))
    elif case == "all_identical":
        for s in range(16):
            insert(s, list(range(300)))
    elif case == "no_sharing":
        for s in range(16):
            insert(s, [s + 1000] + list(range(200 + s)))
    else:  # prompts that end exactly on a shared full chunk: nothing private at all
        for s in range(5):
            insert(s, list(range(128)))
    pool.k.normal_()
    pool.v.normal_()
    ctx = KernelContext(tree)
    if case == "empty_private":
        assert int(ctx.priv_count.sum()) == 0
    q = torch.randn(ctx.batch_size, hq, d)
    for chunk_first in (True, False):
        out = decode_attention(q, pool.k[0], pool.v[0], ctx, 0.125, chunk_first=chunk_first)
        ref = reference_decode_attention(q, pool, tree, 0, ctx.order, 0.125)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


def test_bad_arguments_raise_python_errors():
    pool, tree = build_tree(0, 3, 100, 32, 2, 64, torch.float32)
    ctx = KernelContext(tree)
    q = torch.randn(ctx.batch_size, 4, 64)
    k, v = pool.k[0], pool.v[0]
    with pytest.raises(TypeError, match="float32"):
        decode_attention(q.double(), k, v, ctx, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, ctx, 1.0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        decode_attention(torch.randn(ctx.batch_size, 3, 64), k, v, ctx, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(torch.randn(ctx.batch_size, 4, 32), k, v, ctx, 1.0)
    with pytest.raises(ValueError):
        decode_attention(q[:1], k, v, ctx, 1.0)  # batch differs from the context
    ctx.priv_slot[int(ctx.priv_count.argmax()), 0] = 10**6  # a row that reads its first private slot
    with pytest.raises(ValueError, match="outside the pool"):
        decode_attention(q, k, v, ctx, 1.0)
