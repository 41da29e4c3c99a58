"""Batch-invariant numerics at the kernel level: a row's output bits do not depend on the other rows
of the call (how many, which, how they share chunks), on the decode kernel's phase (chunk-first or
paged), on the thread count, (linear layers) on the row count, or (prefill with windows and
soft-capping) on how much of its path came from the cache."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from chunkgen._native import native
from chunkgen.cache import ChunkPool, KernelContext, PrefixTree
from chunkgen.kernels import decode_attention, invariant
from chunkgen.kernels.prefill import PrefillSpan, lone_spans, plan_groups, prefill_attention
from chunkgen.model.llama import Linear
from tests.helpers import build_tree


@pytest.fixture(autouse=True)
def invariant_on():
    invariant.set_enabled(True)
    yield
    invariant.set_enabled(False)  # the process default: later tests must not inherit the mode


def _decode(pool, tree, queries: dict, chunk_first: bool) -> dict:
    ctx = KernelContext(tree, chunk_first=chunk_first)
    q = torch.stack([queries[s] for s in ctx.order])
    out = decode_attention(q, pool.k[0], pool.v[0], ctx, q.shape[-1] ** -0.5)
    return {s: out[i] for i, s in enumerate(ctx.order)}


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(2, 14),
    shared_len=st.integers(0, 300),
    chunk=st.sampled_from([16, 32, 64]),
    heads=st.sampled_from([(4, 4), (8, 4), (9, 3), (6, 1)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    q_dtype=st.sampled_from(["float32", "pool"]),
    decode_steps=st.integers(0, 3),
    rising=st.booleans(),
)
def test_a_rows_decode_attention_is_the_same_in_any_batch(
    seed, n_seqs, shared_len, chunk, heads, dtype, q_dtype, decode_steps, rising
):
    """With `rising`, keys grow from slot to slot, so that rows' maxima keep moving past a block's
    first chunk (the bf16 products then take the rest of the block one chunk at a time)."""
    q_heads, kv_heads = heads
    d = 64
    pool, tree = build_tree(
        seed, n_seqs, shared_len, chunk, kv_heads, d, dtype, max_private=200, decode_steps=decode_steps
    )
    if rising:
        n = pool.capacity
        pool.k[0, :n] *= (torch.arange(n, dtype=torch.float32) * 1.5 + 0.5).to(dtype)[:, None, None, None]
    gen = torch.Generator().manual_seed(seed + 1)
    qd = torch.float32 if q_dtype == "float32" else dtype
    queries = {s: torch.randn(q_heads, d, generator=gen).to(qd) for s in range(n_seqs)}
    full = _decode(pool, tree, queries, chunk_first=True)
    rnd = random.Random(seed)
    # The paged kernel reads the same chunks in the same order: the same bits.
    for s, o in _decode(pool, tree, queries, chunk_first=False).items():
        assert torch.equal(o, full[s]), s
    # Fewer threads (no segments to merge in another order) and fewer rows (other sharing).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for s, o in _decode(pool, tree, queries, chunk_first=True).items():
            assert torch.equal(o, full[s]), s
    finally:
        torch.set_num_threads(threads)
    gone = rnd.sample(range(n_seqs), rnd.randrange(1, n_seqs))
    for s in gone:
        tree.remove(s)
    for s, o in _decode(pool, tree, queries, chunk_first=rnd.random() < 0.5).items():
        assert torch.equal(o, full[s]), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (6, 1)])
def test_rows_that_share_every_chunk_keep_their_bits_whatever_their_number(dtype, heads):
    """n rows of one prompt, every chunk shared (phase 1 reads each for blocks of rows whose size
    follows n and the thread count): row 0's output has the same bits for n = 1..12, with one thread
    and two, at three prompt lengths. The fp32 online softmax, instantiated per row-block size, once
    rounded o * alpha + p * v one way in some block sizes and the other way in others (AVX2's blocks
    of 6 rows): a 98-token prompt's row 0 differed among 1 and 2 rows by an ulp."""
    q_heads, kv_heads = heads
    d, chunk = 64, 16
    threads = torch.get_num_threads()
    for length in (6 * chunk + 2, 7 * chunk - 5, 3 * chunk + 9):
        pool = ChunkPool(1, kv_heads, d, chunk, dtype, budget_bytes=1 << 24)
        tree = PrefixTree(pool)
        for s in range(12):
            tree.insert(s, list(range(length)))  # one prompt: its partial last chunk is shared too
            tree.mark_ready(s)
        gen = torch.Generator().manual_seed(length)
        pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen).to(dtype))
        pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen).to(dtype))
        queries = {s: torch.randn(q_heads, d, generator=gen) for s in range(12)}
        seen = []
        try:
            for n in range(12, 0, -1):
                for t in sorted({1, threads}):
                    torch.set_num_threads(t)
                    seen.append((n, t, _decode(pool, tree, {s: queries[s] for s in range(n)}, chunk_first=True)[0]))
                tree.remove(n - 1)
        finally:
            torch.set_num_threads(threads)
        alone = seen[-1][2]
        for n, t, o in seen:
            assert torch.equal(o, alone), f"{length} tokens: row 0 among {n} rows on {t} threads"


def _prefill_wave(pool: ChunkPool, paths: dict, queries: dict, wave: list, window: int, softcap: float) -> dict:
    """Prefill attention of a wave of (sequence, cached tokens) as the engine plans it with
    batch-invariant numerics (every sequence alone, the lone ones in one call): each sequence's
    output rows by position. Every path's K/V are in the pool already (new tokens stored first)."""
    C = pool.chunk_size
    spans, row = [], 0
    for seq, cached in wave:
        n = queries[seq].shape[0]
        spans.append(PrefillSpan(cached, paths[seq], row, n - cached))
        row += n - cached
    q = torch.cat([queries[seq][cached:] for seq, cached in wave])
    # the new tokens' K/V as the layer hands them over (the masked torch path reads them there)
    kv = [
        (pool.k[0, paths[seq][p // C], :, :, p % C], pool.v[0, paths[seq][p // C], :, p % C])
        for seq, cached in wave
        for p in range(cached, queries[seq].shape[0])
    ]
    k, v = torch.stack([a for a, _ in kv]), torch.stack([b for _, b in kv])
    groups = plan_groups(spans, C, pool.dtype, q.device, alone=True)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    prefill_attention(groups, 0, q, k, v, pool, q.shape[-1] ** -0.5, out, window, softcap, lone=lone_spans(groups))
    return {seq: out[sp.row : sp.row + sp.count] for (seq, _), sp in zip(wave, spans)}


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(2, 6),
    chunk=st.sampled_from([16, 64]),
    heads=st.sampled_from([(4, 4), (9, 3), (6, 1)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    window=st.sampled_from([0, 7, 16, 24, 100]),
    softcap=st.sampled_from([0.0, 5.0]),
)
def test_a_rows_windowed_or_capped_prefill_is_the_same_in_any_wave(seed, n_seqs, chunk, heads, dtype, window, softcap):
    """Prefill attention with a sliding window and/or soft-capping: a row's bits do not depend on
    the other sequences of the wave, their order, the thread count, or how much of its own path came
    from the cache (paths share a system prompt's chunks)."""
    assume(window or softcap)
    hq, hk = heads
    rnd = random.Random(seed)
    pool = ChunkPool(1, hk, 64, chunk, dtype, budget_bytes=1 << 26)
    system = [pool.allocate() for _ in range(rnd.randrange(0, 4))]
    paths, queries = {}, {}
    gen = torch.Generator().manual_seed(seed)
    for seq in range(n_seqs):
        n = rnd.randrange(1, 200)
        shared = system[: n // chunk]
        paths[seq] = shared + [pool.allocate() for _ in range(-(-n // chunk) - len(shared))]
        queries[seq] = (torch.randn(n, hq, 64, generator=gen) * 2).to(dtype)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    whole = _prefill_wave(pool, paths, queries, [(s, 0) for s in range(n_seqs)], window, softcap)
    for s in range(n_seqs):  # alone, the whole prompt new
        assert torch.equal(_prefill_wave(pool, paths, queries, [(s, 0)], window, softcap)[s], whole[s]), s
    others = rnd.sample(range(n_seqs), rnd.randrange(1, n_seqs + 1))
    wave = [(s, rnd.randrange(queries[s].shape[0])) for s in others]  # part of each path cached
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for s, o in _prefill_wave(pool, paths, queries, wave, window, softcap).items():
            assert torch.equal(o, whole[s][-o.shape[0] :]), s
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(96, 64), (1728, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_rows_linear_output_is_the_same_at_any_row_count(dtype, shape, bias):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    lin = Linear(w, b)
    assert lin.widened == (dtype == torch.float16)  # fp16: chunkgen's fp32 product, not torch's
    x = torch.randn(600, k, generator=gen).to(dtype)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(40)])
    for rows in (2, 7, 32, 33, 256, 257, 600):
        y = lin(x[:rows])
        assert torch.equal(y[: min(rows, 40)], alone[: min(rows, 40)]), rows
    # and the product is the layer's: y = x W^T + b within the dtype's rounding
    ref = x[:40].double() @ w.double().t() + (0 if b is None else b.double())
    tol = {torch.float32: 1e-4, torch.float16: 2e-3}.get(dtype, 2e-2)
    torch.testing.assert_close(alone.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "q8_0"])
def test_a_rows_quantized_product_is_the_same_at_any_row_count(qtype):
    """The quantized kernels tile rows of x by 4 and split output channels among threads; a row's
    sums (its own int8 activations, blocks in k order) must not see either."""
    import numpy as np

    from chunkgen.model import quant

    n, k = 264, 512  # channel groups of 8 over more than one thread panel; two K-quant super-blocks
    gguf_type = quant.GGUF_TYPES[qtype]
    w = quant.pack(quant.from_gguf(quant.random_gguf(gguf_type, n, k, 0.05, np.random.default_rng(5)), gguf_type, n, k))
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([quant.quantized_linear(x[i : i + 1], w) for i in range(9)])
    for rows in (2, 3, 5, 7, 32, 33, 300):
        assert torch.equal(quant.quantized_linear(x[:rows], w)[: min(rows, 9)], alone[: min(rows, 9)]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quant.quantized_linear(x[:33], w)[:9], alone)
    finally:
        torch.set_num_threads(threads)


def test_the_switch_reaches_the_kernels():
    invariant.set_enabled(False)
    assert not native().batch_invariant() and not invariant.enabled()
    invariant.set_enabled(True)
    assert native().batch_invariant() and invariant.enabled()


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(1, 8),
    shared_len=st.integers(0, 200),
    chunk=st.sampled_from([16, 64]),
    heads=st.sampled_from([(4, 4), (9, 3), (6, 1)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    decode_steps=st.integers(0, 2),
)
def test_a_rows_decode_attention_has_the_bits_of_its_prefill(
    seed, n_seqs, shared_len, chunk, heads, dtype, decode_steps
):
    """A preempted row recomputes its K/V by prefill, tokens it had decoded included, and the KV
    budget and the batch decide which rows are preempted: so a position's attention has the same
    bits whether a decode step or a prefill wave computes it (its last token's row, the rest of its
    path cached), on the products each takes on this CPU."""
    q_heads, kv_heads = heads
    pool, tree = build_tree(seed, n_seqs, shared_len, chunk, kv_heads, 64, dtype, decode_steps=decode_steps)
    gen = torch.Generator().manual_seed(seed + 2)
    queries = {s: torch.randn(q_heads, 64, generator=gen).to(dtype) for s in range(n_seqs)}
    decoded = _decode(pool, tree, queries, chunk_first=True)
    for s in range(n_seqs):
        n = tree.lengths[s]
        rows = torch.zeros(n, q_heads, 64, dtype=dtype)
        rows[-1] = queries[s]
        prefilled = _prefill_wave(pool, {s: tree.slots(s)}, {s: rows}, [(s, n - 1)], 0, 0.0)[s]
        assert torch.equal(prefilled[0], decoded[s]), s
