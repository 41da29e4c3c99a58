"""The native two-phase kernel against the naive reference, on randomized prefix trees: every CPU
path this machine has (AMX, AVX512_BF16, the fp32 path), q and out in fp32 or the model's bf16."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkgen._native import native
from chunkgen.cache import ChunkPool, KernelContext, PrefixTree
from chunkgen.kernels import decode_attention, decode_step_attention, invariant, workspace_for
from chunkgen.kernels.reference import reference_decode_attention
from tests.helpers import PATHS, build_tree, forced, nan_outside_windows


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
    scale = head_dim**-0.5
    out = decode_attention(q, pool.k[0], pool.v[0], ctx, scale)
    ref = reference_decode_attention(q, pool, tree, 0, ctx.order, scale)
    torch.testing.assert_close(out.double(), ref, **tolerance(native().cpu_kernel_isa(), dtype, q.dtype))


@pytest.mark.parametrize("case", ["batch1_many_chunks", "all_identical", "no_sharing", "empty_private"])
def test_kernel_edge_trees(case):
    chunk, kvh, hq, d = 64, 3, 9, 64
    pool = ChunkPool(1, kvh, d, chunk, torch.float32, budget_bytes=1 << 27)
    tree = PrefixTree(pool)

    def insert(s, toks):
        return (tree.insert(s, toks), tree.mark_ready(s))

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


# ---- the CPU kernel's paths ---------------------------------------------------------------------


def tolerance(path: str, kv_dtype: torch.dtype, q_dtype: torch.dtype, q_scale: float = 1.0) -> dict:
    """fp32 everything: float rounding only. bf16 out: its rounding (half an ulp, 2^-9 relative).
    bf16 products (AMX / AVX512_BF16 paths, bf16 KV): q (when fp32) and the probabilities are
    rounded to bf16 before the products, sums stay fp32: a few 1e-3 on outputs of order 1 for
    queries of order 1; q's rounding moves each score in proportion to q (q_scale: the queries'
    scale), and the probabilities with them."""
    if path in ("amx", "avx512_bf16") and kv_dtype == torch.bfloat16:
        return {"atol": 1e-2 * q_scale, "rtol": 2e-2 * q_scale}
    if q_dtype == torch.bfloat16:
        return {"atol": 2e-3, "rtol": 8e-3}
    return {"atol": 2e-5, "rtol": 1e-4}


def test_the_best_path_is_reported_and_lower_ones_can_be_forced(monkeypatch):
    assert PATHS[-1] in ("avx512", "avx2", "avx", "sse", "generic")
    for path in PATHS:
        monkeypatch.setenv("CHUNKGEN_CPU_ISA", path)
        assert native().cpu_kernel_isa() == path
    monkeypatch.setenv("CHUNKGEN_CPU_ISA", "no_such_isa")
    with pytest.raises(ValueError, match="no_such_isa"):
        native().cpu_kernel_isa()


@pytest.mark.parametrize("cpu_path", PATHS)
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(1, 40),
    shared_len=st.integers(0, 300),
    chunk=st.sampled_from([16, 32, 64, 128]),
    heads=st.sampled_from([(4, 4), (8, 2), (9, 3), (6, 1)]),
    head_dim=st.sampled_from([64, 80, 128]),
    q_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    decode_steps=st.integers(0, 3),
    chunk_first=st.booleans(),
    batch_invariant=st.booleans(),
)
def test_every_cpu_path_matches_reference_in_bf16(
    cpu_path, seed, n_seqs, shared_len, chunk, heads, head_dim, q_dtype, decode_steps, chunk_first, batch_invariant
):
    """Both plans: the fast one (per-chunk partials merged) and the batch-invariant one (each row's
    state continued chunk by chunk through both phases)."""
    q_heads, kv_heads = heads
    pool, tree = build_tree(
        seed, n_seqs, shared_len, chunk, kv_heads, head_dim, torch.bfloat16, max_private=150, decode_steps=decode_steps
    )
    ctx = KernelContext(tree, chunk_first=chunk_first)
    q = torch.randn(ctx.batch_size, q_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(q_dtype)
    scale = head_dim**-0.5
    invariant.set_enabled(batch_invariant)
    try:
        with forced(cpu_path):
            out = decode_attention(q, pool.k[0], pool.v[0], ctx, scale)
    finally:
        invariant.set_enabled(False)  # the process default
    assert out.dtype == q_dtype
    ref = reference_decode_attention(q, pool, tree, 0, ctx.order, scale)
    torch.testing.assert_close(out.double(), ref, **tolerance(cpu_path, torch.bfloat16, q_dtype))


@pytest.mark.parametrize("cpu_path", PATHS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_the_step_shape_long_shared_prompt(cpu_path, q_dtype):
    """The default model's decode shape: 32 rows, a 2,048-token shared prompt (32 full chunks, one
    online softmax across them), 20..80 private tokens each (partial last chunks)."""
    rnd = random.Random(3)
    pool = ChunkPool(1, 3, 64, 64, torch.bfloat16, budget_bytes=1 << 26)
    tree = PrefixTree(pool)
    for s in range(32):
        tree.insert(s, list(range(2048)) + [5000 + 100 * s + i for i in range(rnd.randrange(20, 81))])
        tree.mark_ready(s)
    g = torch.Generator().manual_seed(3)  # fixed data: the test's outcome must not hang on earlier tests
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    ctx = KernelContext(tree)
    q = torch.randn(ctx.batch_size, 9, 64, generator=torch.Generator().manual_seed(3)).to(q_dtype) * 3
    with forced(cpu_path):
        out = decode_attention(q, pool.k[0], pool.v[0], ctx, 0.125)
    ref = reference_decode_attention(q, pool, tree, 0, ctx.order, 0.125)
    torch.testing.assert_close(out.double(), ref, **tolerance(cpu_path, torch.bfloat16, q_dtype))


@pytest.mark.parametrize("cpu_path", PATHS)
@pytest.mark.parametrize("keys", ["rising", "spike"])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_later_blocks_far_above_the_first_rescale(cpu_path, keys, batch_invariant):
    """The bf16 softmax takes a later block's probabilities against the row's max so far: keys that
    grow along the shared prompt (every block far above the last) or one late token with scores far
    above all others must move that max, not overflow or lose the earlier blocks (batch-invariant:
    a row whose max moves inside a block takes the rest of it one chunk at a time)."""
    invariant.set_enabled(batch_invariant)
    try:
        _later_blocks_far_above_the_first(cpu_path, keys)
    finally:
        invariant.set_enabled(False)


def _later_blocks_far_above_the_first(cpu_path: str, keys: str) -> None:
    pool = ChunkPool(1, 3, 64, 64, torch.bfloat16, budget_bytes=1 << 26)
    tree = PrefixTree(pool)
    for s in range(8):
        tree.insert(s, list(range(2048)) + [5000 + 100 * s + i for i in range(10 + s)])
        tree.mark_ready(s)
    gen = torch.Generator().manual_seed(5)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    slots, offsets = tree.positions(0, 0, 2048)
    slots, offsets = torch.tensor(slots), torch.tensor(offsets)
    # Scores reach hundreds: probabilities against an early max would overflow fp32 and bf16.
    if keys == "rising":  # score spread grows 40x from the first block to the last
        grow = torch.linspace(1, 40, 2048)
        pool.k[0, slots, :, :, offsets] *= grow[:, None, None].to(torch.bfloat16)
    else:
        pool.k[0, slots[1900], :, :, offsets[1900]] *= 100
    ctx = KernelContext(tree)
    q = (torch.randn(ctx.batch_size, 9, 64, generator=gen) * 3).to(torch.bfloat16)
    with forced(cpu_path):
        out = decode_attention(q, pool.k[0], pool.v[0], ctx, 0.125)
    assert torch.isfinite(out).all()
    ref = reference_decode_attention(q, pool, tree, 0, ctx.order, 0.125)
    torch.testing.assert_close(out.double(), ref, **tolerance(cpu_path, torch.bfloat16, q.dtype))


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_the_op_writes_the_steps_kv_rows(src_dtype):
    """The op's K/V write: row b's k, v land at (write_slot[b], write_offset[b]) of the layer, as
    the pool's dtype, from strided views; nothing else in the pool changes."""
    pool, tree = build_tree(1, 6, 100, 32, 2, 64, torch.bfloat16)
    for s in range(6):
        tree.append(s, 1)
    ctx = KernelContext(tree)
    slots, offsets = [], []
    for s in ctx.order:
        n = tree.lengths[s]
        sl, of = tree.positions(s, n - 1, n)
        slots.append(sl[0])
        offsets.append(of[0])
    ctx.set_step([1] * len(slots), [0] * len(slots), list(zip(slots, offsets)))
    rows = len(slots)
    kv = torch.randn(rows, 2, 2, 64).to(src_dtype)  # one buffer: k and v are strided views of it
    k, v = kv[:, 0], kv[:, 1]
    before_k, before_v = pool.k.clone(), pool.v.clone()
    q = torch.randn(ctx.batch_size, 4, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    decode_step_attention(
        q, k, v, pool.k, pool.v, 0, ctx.arrays(), workspace_for(ctx, 4, 64, q.device), out, 0.125, True
    )
    s, o = torch.tensor(slots), torch.tensor(offsets)
    assert torch.equal(pool.k[0, s, :, :, o], k.to(torch.bfloat16))
    assert torch.equal(pool.v[0, s, :, o], v.to(torch.bfloat16))
    before_k[0, s, :, :, o] = k.to(torch.bfloat16)
    before_v[0, s, :, o] = v.to(torch.bfloat16)
    assert torch.equal(pool.k.view(torch.int16), before_k.view(torch.int16))  # NaN-safe comparison
    assert torch.equal(pool.v.view(torch.int16), before_v.view(torch.int16))


def test_bad_dtypes_raise_python_errors():
    pool, tree = build_tree(0, 3, 100, 32, 2, 64, torch.float32)
    ctx = KernelContext(tree)
    q = torch.randn(ctx.batch_size, 4, 64)
    with pytest.raises(TypeError, match="float32 or the pool's dtype"):  # bf16 q on an fp32 pool
        decode_attention(q.bfloat16(), pool.k[0], pool.v[0], ctx, 1.0)
    with pytest.raises(TypeError, match="out must have q's dtype"):
        decode_attention(q, pool.k[0], pool.v[0], ctx, 1.0, out=torch.empty_like(q, dtype=torch.bfloat16))
    pool16, tree16 = build_tree(0, 3, 100, 32, 2, 64, torch.bfloat16)
    ctx16 = KernelContext(tree16)
    q16 = torch.randn(ctx16.batch_size, 4, 64)
    with pytest.raises(TypeError, match="out must have q's dtype"):  # bf16 q, fp32 out
        decode_attention(q16.bfloat16(), pool16.k[0], pool16.v[0], ctx16, 1.0, out=torch.empty_like(q16))
    with pytest.raises(TypeError, match="float32 or the pool's dtype"):  # fp16 q on a bf16 pool
        decode_attention(q16.half(), pool16.k[0], pool16.v[0], ctx16, 1.0)


# ---- sliding windows and soft-capping -----------------------------------------------------------


def window_for(chunk: int, kind: str, rnd: random.Random) -> int:
    """Windows against the chunk: inside one, exactly one, across several, or any."""
    return {
        "below_chunk": rnd.randrange(1, chunk),
        "one_chunk": chunk,
        "several_chunks": rnd.randrange(chunk + 1, 4 * chunk),
        "any": rnd.randrange(1, 400),
    }[kind]


@pytest.mark.parametrize("cpu_path", PATHS)
@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(1, 24),
    shared_len=st.integers(0, 400),
    chunk=st.sampled_from([16, 32, 64]),
    heads=st.sampled_from([(4, 4), (8, 2), (9, 3)]),
    head_dim=st.sampled_from([64, 80]),
    kv_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    q_bf16=st.booleans(),
    window_kind=st.sampled_from(["below_chunk", "one_chunk", "several_chunks", "any", "none"]),
    softcap=st.sampled_from([0.0, 0.0, 2.0, 30.0]),
    decode_steps=st.integers(0, 2),
    chunk_first=st.booleans(),
)
def test_windows_and_softcap_match_reference(
    cpu_path,
    seed,
    n_seqs,
    shared_len,
    chunk,
    heads,
    head_dim,
    kv_dtype,
    q_bf16,
    window_kind,
    softcap,
    decode_steps,
    chunk_first,
):
    """Sliding windows smaller than a chunk, equal to one and spanning several, on shared and
    private chunks, with and without soft-capping, against the float64 reference; the chunks that
    no row's window reaches are NaN, so reading one fails."""
    rnd = random.Random(seed)
    window = 0 if window_kind == "none" else window_for(chunk, window_kind, rnd)
    q_heads, kv_heads = heads
    pool, tree = build_tree(
        seed, n_seqs, shared_len, chunk, kv_heads, head_dim, kv_dtype, max_private=150, decode_steps=decode_steps
    )
    ctx = KernelContext(tree, chunk_first=chunk_first)
    q = torch.randn(ctx.batch_size, q_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)) * 3
    q = q.to(torch.bfloat16 if q_bf16 and kv_dtype == torch.bfloat16 else torch.float32)
    scale = head_dim**-0.5
    ref = reference_decode_attention(q, pool, tree, 0, ctx.order, scale, window=window, softcap=softcap)
    if window:
        nan_outside_windows(pool, tree, ctx.order, window)
    with forced(cpu_path):
        out = decode_attention(q, pool.k[0], pool.v[0], ctx, scale, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), ref, **tolerance(cpu_path, kv_dtype, q.dtype, q_scale=3))


@pytest.mark.parametrize("cpu_path", PATHS)
@pytest.mark.parametrize("window", [1, 40, 64, 200])
def test_a_long_shared_prompt_outside_the_window_is_not_read(cpu_path, window):
    """Rows on a 2,048-token shared prompt with short private tails: a window shorter than the
    tails leaves the whole prompt unread (it is NaN here), a longer one reaches its last chunks."""
    pool = ChunkPool(1, 2, 64, 64, torch.bfloat16, budget_bytes=1 << 26)
    tree = PrefixTree(pool)
    for s in range(12):
        tree.insert(s, list(range(2048)) + [5000 + 100 * s + i for i in range(50 + 3 * s)])
        tree.mark_ready(s)
    gen = torch.Generator().manual_seed(7)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    ctx = KernelContext(tree)
    q = (torch.randn(ctx.batch_size, 8, 64, generator=gen) * 3).to(torch.bfloat16)
    ref = reference_decode_attention(q, pool, tree, 0, ctx.order, 0.125, window=window, softcap=20.0)
    nan_outside_windows(pool, tree, ctx.order, window)
    with forced(cpu_path):
        out = decode_attention(q, pool.k[0], pool.v[0], ctx, 0.125, window=window, softcap=20.0)
    torch.testing.assert_close(out.double(), ref, **tolerance(cpu_path, torch.bfloat16, q.dtype))


def test_window_and_softcap_arguments_are_checked():
    pool, tree = build_tree(0, 2, 20, 16, 2, 64, torch.float32)
    ctx = KernelContext(tree)
    q = torch.randn(ctx.batch_size, 2, 64)
    with pytest.raises(ValueError, match="window"):
        decode_attention(q, pool.k[0], pool.v[0], ctx, 0.125, window=-1)
    with pytest.raises(ValueError, match="softcap"):
        decode_attention(q, pool.k[0], pool.v[0], ctx, 0.125, softcap=-1.0)


def test_the_gpu_workspace_covers_the_partials_and_every_buckets_splits():
    """Sized once per context layout (meta device: sizes only): a row for each (row, shared chunk)
    pair the layout holds and query head, then SEQUENCE_SPLITS blocks' sums for each row of its
    largest bucket, so no bucket replayed on it runs out (the binding gives splits what is left)."""
    from chunkgen.kernels.decode import SEQUENCE_SPLITS

    pool = ChunkPool(1, 2, 64, 16, torch.float32, budget_bytes=1 << 24)
    tree = PrefixTree(pool)
    for s in range(3):
        tree.insert(s, list(range(40)) + [100 + s])
        tree.mark_ready(s)
    ctx = KernelContext(tree, buckets=[1, 2, 4, 8])
    assert ctx.rows == 4 and ctx.row_capacity == 8
    ws = workspace_for(ctx, 6, 64, torch.device("meta"), batch_invariant=False)
    pairs = ctx.arrays().seq_shared_idx.numel()
    assert ws.numel() == (pairs + 8 * SEQUENCE_SPLITS) * 6 * (64 + 2)
    assert workspace_for(ctx, 6, 64, torch.device("cpu")).numel() == 0  # the CPU kernel plans its own
    # Batch-invariant: a partial for each private chunk a row of the layout holds, where that is
    # more than the splits' room (the binding refuses a workspace without it).
    long = [list(range(40)) + [100 + s] * 16 * 20 for s in range(3)]
    tree2 = PrefixTree(pool)
    for s, toks in enumerate(long):
        tree2.insert(s, toks)
        tree2.mark_ready(s)
    ctx2 = KernelContext(tree2, buckets=[1, 2, 4, 8])
    assert ctx2.private_capacity > SEQUENCE_SPLITS
    pairs2 = ctx2.arrays().seq_shared_idx.numel()
    ws2 = workspace_for(ctx2, 6, 64, torch.device("meta"), batch_invariant=True)
    assert ws2.numel() == (pairs2 + 8 * ctx2.private_capacity) * 6 * (64 + 2)
    assert workspace_for(ctx, 6, 64, torch.device("meta"), batch_invariant=True).numel() == ws.numel()
