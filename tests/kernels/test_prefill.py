"""Prefill attention (shared-prefix groups, own parts, lone sequences) against a naive dense
attention per sequence, on randomized waves."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from chunkgen.cache import ChunkPool
from chunkgen.kernels import invariant
from chunkgen.kernels.prefill import PrefillSpan, lone_spans, plan_groups, prefill_attention
from chunkgen.kernels.varlen import plan_wave
from tests.helpers import (
    PATHS,
    WINDOW_KINDS,
    dense_lse_reference,
    draw_window,
    forced,
    prefill_reference,
    random_wave,
    store_new_tokens,
)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(1, 8),
    chunk=st.sampled_from([8, 16, 64]),
    heads=st.sampled_from([(4, 4), (4, 2), (9, 3), (6, 1)]),
    head_dim=st.sampled_from([32, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_prefill_attention_matches_naive(seed, n_seqs, chunk, heads, head_dim, dtype):
    hq, hk = heads
    pool, spans, rows = random_wave(seed, n_seqs, chunk, hk, head_dim, dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(rows, hq, head_dim, generator=gen).to(dtype)
    k = torch.randn(rows, hk, head_dim, generator=gen).to(dtype)
    v = torch.randn(rows, hk, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    store_new_tokens(pool, spans, k, v)  # as the model does before attention
    out = torch.full((rows, hq, head_dim), float("nan"), dtype=dtype)
    prefill_attention(plan_groups(spans, chunk, dtype, q.device), 0, q, k, v, pool, scale, out)
    want = prefill_reference(q, k, v, pool, spans, scale)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), want, atol=tol, rtol=tol), (out.double() - want).abs().max()


@pytest.fixture
def invariant_on():
    """Batch-invariant numerics (the engine's default): bf16 lone sequences are read in place too."""
    invariant.set_enabled(True)
    yield
    invariant.set_enabled(False)


# The fixture sets one switch, the same for every example: not reset between them on purpose.
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(1, 8),
    chunk=st.sampled_from([16, 64]),
    heads=st.sampled_from([(4, 4), (9, 3), (6, 1)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    alone=st.booleans(),
    window=st.sampled_from([0, 5, 16, 40]),
    softcap=st.sampled_from([0.0, 4.0]),
)
def test_lone_sequences_in_one_call_give_the_bits_of_one_call_each(
    invariant_on, seed, n_seqs, chunk, heads, dtype, alone, window, softcap
):
    """A wave's lone sequences through one causal_attention call (lone_spans) against the same
    groups one prefix_attention call each: equal bits, every sequence's rows, whatever the wave, with
    or without a window and soft-capping; and within tolerance of the naive reference."""
    hq, hk = heads
    pool, spans, rows = random_wave(seed, n_seqs, chunk, hk, 64, dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    q, k, v = (torch.randn(rows, h, 64, generator=gen).to(dtype) for h in (hq, hk, hk))
    store_new_tokens(pool, spans, k, v)
    groups = plan_groups(spans, chunk, dtype, q.device, alone=alone)
    each, batched = (torch.full((rows, hq, 64), float("nan"), dtype=dtype) for _ in range(2))
    prefill_attention(groups, 0, q, k, v, pool, 0.125, each, window, softcap)
    lone = lone_spans(groups)
    assert lone is not None or not alone
    prefill_attention(groups, 0, q, k, v, pool, 0.125, batched, window, softcap, lone=lone)
    assert torch.equal(batched, each)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    want = prefill_reference(q, k, v, pool, spans, 0.125, window, softcap)
    assert torch.allclose(batched.double(), want, atol=tol, rtol=tol)


def test_one_causal_call_refuses_spans_that_do_not_fit():
    from chunkgen._native import native

    k_layer, v_layer = torch.zeros(4, 2, 32, 16), torch.zeros(4, 2, 16, 32)
    q, out, slots = torch.zeros(6, 4, 32), torch.zeros(6, 4, 32), torch.tensor([0, 1, 2], dtype=torch.int32)
    op = native().causal_attention

    def spans(*rows):
        return torch.tensor(rows, dtype=torch.long)

    op(q, k_layer, v_layer, slots, spans((0, 3, 13, 0), (3, 3, 0, 2)), 1.0, out)  # 16 tokens: 1 chunk; 3: 1
    with pytest.raises(ValueError, match="overlaps an earlier span"):
        op(q, k_layer, v_layer, slots, spans((0, 3, 0, 0), (2, 3, 0, 1)), 1.0, out)
    with pytest.raises(ValueError, match="leaves q's 6 rows"):
        op(q, k_layer, v_layer, slots, spans((4, 3, 0, 0)), 1.0, out)
    with pytest.raises(ValueError, match=r"needs slots \[2, 4\) of 3"):
        op(q, k_layer, v_layer, slots, spans((0, 3, 14, 2)), 1.0, out)  # 17 tokens: 2 chunks
    with pytest.raises(ValueError, match="out must be"):
        op(q, k_layer, v_layer, slots, spans((0, 3, 0, 0)), 1.0, out[:5])
    with pytest.raises(ValueError, match="spans int64"):
        op(q, k_layer, v_layer, slots, spans((0, 3, 0, 0)).int(), 1.0, out)
    with pytest.raises(ValueError, match="outside the pool layer"):
        op(q, k_layer, v_layer, torch.tensor([0, 9], dtype=torch.int32), spans((0, 3, 0, 0)), 1.0, out)


def test_a_shared_prefix_is_one_group_read_once():
    """Sequences that cached the same full chunks attend to them in one product; one that cached
    other chunks stands alone."""
    pool = ChunkPool(1, 1, 8, 4, torch.float32, budget_bytes=1 << 20)
    shared = [pool.allocate() for _ in range(2)]
    own = [pool.allocate() for _ in range(4)]
    spans = [
        PrefillSpan(9, shared + [own[0], own[1]], 0, 3),
        PrefillSpan(8, shared + [own[2]], 3, 2),
        PrefillSpan(5, [own[3], shared[0]], 5, 1),
    ]
    groups = plan_groups(spans, 4, torch.float32, torch.device("cpu"))
    sizes = sorted((g.prefix_len, len(g.rows)) for g in groups)
    assert sizes == [(5, 1), (8, 5)]


BF16_PATHS = [p for p in PATHS if p in ("amx", "avx512_bf16")]  # the prefix product's bf16 paths


def scattered_path(gen, n_tokens: int, chunk: int, hk: int, head_dim: int, dtype: torch.dtype):
    """One pool layer (k_layer [S, Hk, d, C], v_layer [S, Hk, C, d]) holding a path of n_tokens in
    scattered slots (int32), the last one partly filled: NaN past its tokens, so reading them fails."""
    n_chunks = -(-n_tokens // chunk)
    k_layer = torch.randn(n_chunks + 5, hk, head_dim, chunk, generator=gen).to(dtype)
    v_layer = torch.randn(n_chunks + 5, hk, chunk, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(n_chunks + 5, generator=gen)[:n_chunks].to(torch.int32)
    tail = n_tokens - (n_chunks - 1) * chunk
    k_layer[slots[-1].long(), :, :, tail:] = float("nan")
    v_layer[slots[-1].long(), :, tail:] = float("nan")
    return k_layer, v_layer, slots


def path_reference(q, k_layer, v_layer, slots, n_tokens: int, scale: float, visible=None, softcap: float = 0.0):
    """(softmax(q K^T * scale) V [R, Hq, d], the scores [Hq, R, n]) over the path's first n_tokens
    in float64; visible [R, n] masks keys per query; softcap > 0 caps each scaled score s as
    softcap * tanh(s / softcap)."""
    hk, head_dim = k_layer.shape[1], k_layer.shape[2]
    keys = k_layer[slots.long()].permute(1, 0, 3, 2).reshape(hk, -1, head_dim)[:, :n_tokens].double()
    values = v_layer[slots.long()].permute(1, 0, 2, 3).reshape(hk, -1, head_dim)[:, :n_tokens].double()
    group = q.shape[1] // hk
    s = torch.einsum("rhd,hnd->hrn", q.double(), keys.repeat_interleave(group, 0)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if visible is not None:
        s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hrn,hnd->rhd", s.softmax(-1), values.repeat_interleave(group, 0)), s


@pytest.mark.parametrize("path", ["fp32"] + BF16_PATHS)
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 70),
    n_tokens=st.integers(1, 300),
    chunk=st.sampled_from([16, 64]),
    heads=st.sampled_from([(4, 4), (9, 3), (6, 1)]),
    head_dim=st.sampled_from([32, 64, 80]),
)
def test_the_prefix_product_reads_the_pool_in_place(path, seed, rows, n_tokens, chunk, heads, head_dim):
    """native prefix_attention (the prefill's prefix product; fp32, and bf16 on each bf16 path the
    CPU has): every query against a prefix held in scattered pool slots, the last one partly filled
    (NaN past its tokens: never read), against float64 on the same (rounded) inputs; its
    log-sum-exp too."""
    from chunkgen._native import native

    hq, hk = heads
    dtype = torch.float32 if path == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    k_layer, v_layer, slots = scattered_path(gen, n_tokens, chunk, hk, head_dim, dtype)
    q = (torch.randn(rows, hq, head_dim, generator=gen) * 2).to(dtype)
    scale = head_dim**-0.5
    if path == "fp32":
        o, lse = native().prefix_attention(q, k_layer, v_layer, slots, n_tokens, scale)
    else:
        with forced(path):
            o, lse = native().prefix_attention(q, k_layer, v_layer, slots, n_tokens, scale)
    assert o.dtype == dtype and lse.dtype == torch.float32
    want, s = path_reference(q, k_layer, v_layer, slots, n_tokens, scale)
    # bf16: the probabilities are rounded to bf16 for the P.V product (relative 2^-9 each) and the
    # output once more.
    o_tol, lse_tol = (2e-5, 1e-5) if dtype == torch.float32 else (2e-2, 4e-3)
    torch.testing.assert_close(o.double(), want, atol=o_tol, rtol=o_tol * 5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1).t(), atol=lse_tol, rtol=lse_tol)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 150),
    first=st.integers(0, 200),
    chunk=st.sampled_from([16, 64]),
    heads=st.sampled_from([(4, 4), (9, 3), (6, 1)]),
    head_dim=st.sampled_from([32, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_the_causal_path_product_sees_each_position_up_to_itself(seed, rows, first, chunk, heads, head_dim, dtype):
    """native prefix_attention with first >= 0 (a lone sequence's whole path; bf16 on the bf16
    products where the CPU has them): query r at position first + r against positions [0, first +
    r] of a path held in scattered slots, blocks of queries crossing chunk boundaries, NaN past the
    last token; against float64. A position's bits are the same in a product that starts later
    (other blocks of queries, other rows beside it)."""
    from chunkgen._native import native

    hq, hk = heads
    n_tokens = first + rows
    gen = torch.Generator().manual_seed(seed)
    k_layer, v_layer, slots = scattered_path(gen, n_tokens, chunk, hk, head_dim, dtype)
    q = (torch.randn(rows, hq, head_dim, generator=gen) * 2).to(dtype)
    scale = head_dim**-0.5
    o, _ = native().prefix_attention(q, k_layer, v_layer, slots, n_tokens, scale, first)
    visible = torch.arange(n_tokens)[None, :] <= first + torch.arange(rows)[:, None]  # [rows, n]
    want, _ = path_reference(q, k_layer, v_layer, slots, n_tokens, scale, visible)
    # bf16: q and the probabilities rounded to bf16 before the products, the output rounded to bf16
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(o.double(), want, **tol)
    start = rows // 3
    later, _ = native().prefix_attention(q[start:], k_layer, v_layer, slots, n_tokens, scale, first + start)
    assert torch.equal(later, o[start:])


@pytest.mark.parametrize("path", ["fp32"] + [f"bf16-{p}" for p in PATHS])
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 150),
    first=st.integers(0, 200),
    chunk=st.sampled_from([16, 64]),
    heads=st.sampled_from([(4, 4), (9, 3), (6, 1)]),
    window_kind=st.sampled_from(WINDOW_KINDS),
    softcap=st.sampled_from([0.0, 2.0, 30.0]),
)
def test_the_causal_path_product_takes_a_window_and_a_cap(path, seed, rows, first, chunk, heads, window_kind, softcap):
    """The causal product with a sliding window and/or soft-capped scores (fp32; bf16 on each path
    the CPU has: the bf16 products, or bf16 read in fp32 arithmetic): query r at position first + r against positions
    [first + r - window + 1, first + r], scores capped, against float64. The chunks that end before
    the first query's window are NaN (never read). A position's bits are the same in a product that
    starts later."""
    from chunkgen._native import native

    rnd = random.Random(seed)
    window = draw_window(rnd, window_kind, chunk)
    assume(window or softcap)
    hq, hk = heads
    dtype = torch.float32 if path == "fp32" else torch.bfloat16
    n_tokens = first + rows
    gen = torch.Generator().manual_seed(seed)
    k_layer, v_layer, slots = scattered_path(gen, n_tokens, chunk, hk, 32, dtype)
    q = (torch.randn(rows, hq, 32, generator=gen) * 2).to(dtype)
    scale = 32**-0.5
    key_pos, q_pos = torch.arange(n_tokens)[None, :], first + torch.arange(rows)[:, None]
    visible = (key_pos <= q_pos) & ((key_pos > q_pos - window) if window else True)  # [rows, n]
    want, _ = path_reference(q, k_layer, v_layer, slots, n_tokens, scale, visible, softcap)
    unread = slots[: max(0, first - window + 1) // chunk].long() if window else slots[:0].long()
    k_layer[unread], v_layer[unread] = float("nan"), float("nan")
    with forced(path.removeprefix("bf16-")) if dtype == torch.bfloat16 else contextlib.nullcontext():
        o, _ = native().prefix_attention(q, k_layer, v_layer, slots, n_tokens, scale, first, window, softcap)
        start = rows // 3
        later, _ = native().prefix_attention(
            q[start:], k_layer, v_layer, slots, n_tokens, scale, first + start, window, softcap
        )
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(o.double(), want, **tol)
    assert torch.equal(later, o[start:])


def test_the_prefix_product_refuses_what_does_not_fit():
    from chunkgen._native import native

    k_layer, v_layer = torch.zeros(4, 2, 32, 16), torch.zeros(4, 2, 16, 32)
    q, slots = torch.zeros(3, 4, 32), torch.tensor([0, 1], dtype=torch.int32)
    op = native().prefix_attention
    with pytest.raises(ValueError, match="cannot hold a prefix of 40 tokens"):
        op(q, k_layer, v_layer, slots, 40, 1.0)
    with pytest.raises(ValueError, match="outside the pool layer"):
        op(q, k_layer, v_layer, torch.tensor([0, 9], dtype=torch.int32), 20, 1.0)
    with pytest.raises(TypeError, match="all float32 or all bfloat16"):
        op(q.bfloat16(), k_layer, v_layer, slots, 20, 1.0)
    bf16 = (q.bfloat16(), k_layer.bfloat16(), v_layer.bfloat16(), slots, 20, 1.0)
    with forced(PATHS[-1]):  # no bf16 products: bf16 read, fp32 arithmetic (on every CPU)
        got = op(*bf16)[0].float()
    want = op(q.bfloat16().float(), k_layer.bfloat16().float(), v_layer.bfloat16().float(), slots, 20, 1.0)[0]
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="shapes do not fit"):
        op(torch.zeros(3, 3, 32), k_layer, v_layer, slots, 20, 1.0)
    with pytest.raises(ValueError, match="must be inside the 20 tokens"):
        op(q, k_layer, v_layer, slots, 20, 1.0, 18)  # positions 18..20: one past the path
    causal = op(*bf16, 0)[0].float()  # causal in bf16 too (the same fp32 arithmetic)
    want = op(q.bfloat16().float(), k_layer.bfloat16().float(), v_layer.bfloat16().float(), slots, 20, 1.0, 0)[0]
    torch.testing.assert_close(causal, want, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="multiples of 16"):
        op(q, torch.zeros(4, 2, 32, 8), torch.zeros(4, 2, 8, 32), torch.tensor([0, 1, 2], dtype=torch.int32), 20, 1.0)
    with pytest.raises(ValueError, match="needs a causal product"):
        op(q, k_layer, v_layer, slots, 20, 1.0, -1, 4)  # a window over a group's prefix: positions unknown
    with pytest.raises(ValueError, match="must be >= 0"):
        op(q, k_layer, v_layer, slots, 20, 1.0, 0, 0, -1.0)


# -- the GPU's path (torch's fused kernels that return the log-sum-exp), run here on the CPU --------


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 3),
    heads=st.sampled_from([(4, 4), (9, 3), (6, 1), (8, 2)]),
    t=st.integers(1, 40),
    extra=st.integers(0, 50),
    head_dim=st.sampled_from([32, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    kind=st.sampled_from(["prefix", "causal", "causal_longer_keys", "mask"]),
)
def test_fused_attention_lse_matches_float64(seed, batch, heads, t, extra, head_dim, dtype, kind):
    """Every shape of product the GPU path asks for: a prefix (GQA folded into the query rows), a
    causal one (K/V expanded), causal with more keys than queries (aligned to the last rows), and an
    additive mask; the output in q's dtype and the log-sum-exp in fp32."""
    from chunkgen.kernels.prefill import fused_attention_lse

    hq, hk = heads
    gen = torch.Generator().manual_seed(seed)
    s = t + (0 if kind == "causal" else extra)
    q = torch.randn(batch, hq, t, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, hk, s, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, hk, s, head_dim, generator=gen).to(dtype)
    mask = None
    if kind == "mask":  # each query sees a random non-empty prefix of the keys
        limit = torch.randint(0, s, (batch, 1, t, 1), generator=gen)
        mask = torch.zeros(batch, 1, t, s, dtype=dtype).masked_fill_(torch.arange(s) > limit, float("-inf"))
    causal = kind.startswith("causal")
    scale = head_dim**-0.5
    o, lse = fused_attention_lse(q, k, v, scale, causal=causal, mask=mask)
    want_o, want_lse = dense_lse_reference(q, k, v, scale, causal, mask)
    assert o.dtype == dtype and o.shape == q.shape and lse.dtype == torch.float32
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o.double(), want_o, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)


def test_a_bias_is_aligned_for_the_memory_efficient_kernel():
    """Rows padded to 16 elements and viewed back (values unchanged), heads broadcast by stride."""
    from chunkgen.kernels.prefill import aligned_bias

    mask = torch.randn(3, 1, 5, 37).to(torch.bfloat16)
    bias = aligned_bias(mask, 3, 9)
    assert bias.shape == (3, 9, 5, 37) and bias.stride(-2) % 16 == 0 and bias.stride(1) == 0
    assert torch.equal(bias[:, 4], mask[:, 0])
    aligned = torch.randn(2, 1, 4, 32)
    assert aligned_bias(aligned, 2, 3).data_ptr() == aligned.data_ptr()  # already aligned: no copy


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(1, 8),
    chunk=st.sampled_from([8, 16, 64]),
    heads=st.sampled_from([(4, 4), (4, 2), (9, 3), (6, 1)]),
    head_dim=st.sampled_from([32, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_prefill_on_the_fused_path_matches_naive(seed, n_seqs, chunk, heads, head_dim, dtype):
    """The whole wave as the GPU runs it (every product through fused_attention_lse, the prefix
    gathered rather than read in place, parts merged by their log-sum-exp) against naive dense
    attention per sequence, on randomized trees."""
    from unittest import mock

    from chunkgen.kernels import prefill

    hq, hk = heads
    pool, spans, rows = random_wave(seed, n_seqs, chunk, hk, head_dim, dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(rows, hq, head_dim, generator=gen).to(dtype)
    k = torch.randn(rows, hk, head_dim, generator=gen).to(dtype)
    v = torch.randn(rows, hk, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    store_new_tokens(pool, spans, k, v)
    out = torch.full((rows, hq, head_dim), float("nan"), dtype=dtype)
    fused = mock.Mock(wraps=prefill.fused_attention_lse)
    with (
        mock.patch.object(prefill, "attention_lse", fused),
        mock.patch.object(prefill, "_prefix_in_place", lambda *a: False),
        mock.patch.object(prefill, "_gathers_whole_path", lambda q: True),
    ):
        prefill_attention(plan_groups(spans, chunk, dtype, q.device), 0, q, k, v, pool, scale, out)
    assert fused.call_count >= len(plan_groups(spans, chunk, dtype, q.device))
    want = prefill_reference(q, k, v, pool, spans, scale)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), want, atol=tol, rtol=tol), (out.double() - want).abs().max()


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(1, 6),
    chunk=st.sampled_from([8, 16]),
    heads=st.sampled_from([(4, 2), (9, 3)]),
    window_kind=st.sampled_from(["none", "inside", "across"]),
    softcap=st.sampled_from([0.0, 5.0]),
)
def test_a_lone_sequence_off_the_cpu_is_its_whole_path_in_one_product(seed, n_seqs, chunk, heads, window_kind, softcap):
    """As the GPU runs a wave of lone sequences (batch-invariant numerics make every sequence
    one): each over its whole path gathered from the pool, cached and new tokens alike, in one
    product with no merge (the fused causal one, or the masked one for a window or a cap), against
    naive attention."""
    from unittest import mock

    from chunkgen.kernels import prefill

    hq, hk = heads
    dtype, head_dim = torch.float32, 32
    pool, spans, rows = random_wave(seed, n_seqs, chunk, hk, head_dim, dtype)
    window = {"none": 0, "inside": 3 * chunk, "across": chunk // 2 + 1}[window_kind]
    gen = torch.Generator().manual_seed(seed + 1)
    q, k, v = (torch.randn(rows, h, head_dim, generator=gen) for h in (hq, hk, hk))
    store_new_tokens(pool, spans, k, v)
    out = torch.full((rows, hq, head_dim), float("nan"))
    whole = mock.Mock(wraps=prefill._whole_path)
    merged = mock.Mock(wraps=prefill.merge)
    with (
        mock.patch.object(prefill, "_prefix_in_place", lambda *a: False),
        mock.patch.object(prefill, "_gathers_whole_path", lambda q: True),
        mock.patch.object(prefill, "_whole_path", whole),
        mock.patch.object(prefill, "merge", merged),
    ):
        groups = plan_groups(spans, chunk, dtype, q.device, alone=True)
        prefill_attention(groups, 0, q, k, v, pool, head_dim**-0.5, out, window=window, softcap=softcap)
    assert whole.call_count == len(spans) and merged.call_count == 0
    want = prefill_reference(q, k, v, pool, spans, head_dim**-0.5, window=window, softcap=softcap)
    assert torch.allclose(out.double(), want, atol=1e-4, rtol=1e-4), (out.double() - want).abs().max()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(1, 8),
    chunk=st.sampled_from([8, 16, 64]),
    heads=st.sampled_from([(4, 4), (9, 3), (6, 1)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    alone=st.booleans(),
    with_groups=st.booleans(),
)
def test_a_wave_off_the_cpu_is_a_few_variable_length_products(seed, n_seqs, chunk, heads, dtype, alone, with_groups):
    """As the GPU runs a wave (varlen.plan_wave): its lone sequences (with batch-invariant numerics
    every sequence) in one variable-length causal product over their whole paths; its groups
    (with_groups: as the GPU plans them in fp16 and bf16) in two, every member's rows over the
    group's prefix and each member over its own part, merged by their log-sum-exp; else the
    groups one at a time as before. Against naive attention, with NaN wherever the pool holds no
    token, so a key gathered from another sequence's path or past a run's end shows."""
    from unittest import mock

    from chunkgen.kernels import prefill, varlen

    hq, hk = heads
    head_dim = 32
    pool, spans, rows = random_wave(seed, n_seqs, chunk, hk, head_dim, dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    q, k, v = (torch.randn(rows, h, head_dim, generator=gen).to(dtype) for h in (hq, hk, hk))
    store_new_tokens(pool, spans, k, v)
    out = torch.full((rows, hq, head_dim), float("nan"), dtype=dtype)
    groups = plan_groups(spans, chunk, dtype, q.device, alone=alone)
    wave = plan_wave(groups, chunk, q.device, with_groups)
    lone = [g for g in groups if g.key_idx is None]
    shared = [g for g in groups if g.key_idx is not None]
    assert (wave is None) == (not lone and not (shared and with_groups))
    products = mock.Mock(wraps=varlen.varlen_attention)
    whole = mock.Mock(wraps=prefill._whole_path)
    own = mock.Mock(wraps=prefill._own_parts)
    with (
        mock.patch.object(prefill, "_prefix_in_place", lambda *a: False),
        mock.patch.object(prefill, "_gathers_whole_path", lambda q: True),
        mock.patch.object(varlen, "varlen_attention", products),
        mock.patch.object(prefill, "_whole_path", whole),
        mock.patch.object(prefill, "_own_parts", own),
    ):
        prefill_attention(groups, 0, q, k, v, pool, head_dim**-0.5, out, varlen=wave)
    planned_groups = bool(shared) and with_groups
    assert products.call_count == bool(lone) + 2 * planned_groups and whole.call_count == 0
    assert own.call_count == (0 if with_groups else len(shared))
    if wave is not None and wave.lone is not None:
        assert wave.lone.cu_q[-1] == sum(g.contiguous[1] - g.contiguous[0] for g in lone)
        assert wave.lone.cu_k[-1] == sum(g.prefix_len + g.contiguous[1] - g.contiguous[0] for g in lone)
    want = prefill_reference(q, k, v, pool, spans, head_dim**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), want, atol=tol, rtol=tol), (out.double() - want).abs().max()


def test_a_varlen_wave_keeps_each_part_at_its_rows():
    """Lone sequences around a group of two that share a full chunk: the lone product's rows are
    the lone ones only, in order (an index, not a range), its keys each one's whole path; the
    group's prefix run is both members' rows over the shared chunk, its own runs each member's
    tokens past it."""
    C = 8
    pool = ChunkPool(1, 2, 16, C, torch.float32, budget_bytes=1 << 22)
    shared = pool.allocate()
    a, b, c, d = ([pool.allocate() for _ in range(n)] for n in (2, 1, 1, 1))
    spans = [
        PrefillSpan(0, a, 0, 10),  # fresh: rows 0-9, keys 0-9 of its two chunks
        PrefillSpan(C + 2, [shared] + b, 10, 3),  # these two share `shared`: a group
        PrefillSpan(C + 1, [shared] + c, 13, 4),
        PrefillSpan(3, d, 17, 2),  # 3 cached tokens of its own chunk: lone, rows 17-18
    ]
    wave = plan_wave(plan_groups(spans, C, torch.float32, "cpu"), C, "cpu", with_groups=True)
    assert wave.lone_rows.tolist() == list(range(10)) + [17, 18]
    assert wave.lone.cu_q.tolist() == [0, 10, 12] and wave.lone.cu_k.tolist() == [0, 10, 15]
    assert (wave.lone.max_q, wave.lone.max_k, wave.lone.causal) == (10, 10, True)
    assert wave.lone.key_slots.tolist() == [a[0]] * 8 + [a[1]] * 2 + [d[0]] * 5
    assert wave.lone.key_offsets.tolist() == list(range(8)) + [0, 1] + list(range(5))
    assert wave.group_rows == slice(10, 17)
    assert wave.prefix.cu_q.tolist() == [0, 7] and wave.prefix.cu_k.tolist() == [0, 8] and not wave.prefix.causal
    assert wave.prefix.key_slots.tolist() == [shared] * 8
    assert wave.own.cu_q.tolist() == [0, 3, 7] and wave.own.cu_k.tolist() == [0, 5, 10] and wave.own.causal
    assert wave.own.key_slots.tolist() == [b[0]] * 5 + [c[0]] * 5
    assert wave.own.key_offsets.tolist() == [0, 1, 2, 3, 4] * 2
    alone = plan_wave(plan_groups(spans, C, torch.float32, "cpu", alone=True), C, "cpu", with_groups=True)
    assert alone.lone_rows == slice(0, 19) and alone.lone.cu_k.tolist() == [0, 10, 23, 36, 41]
    assert alone.prefix is None and not alone.groups
    assert plan_wave(plan_groups(spans[1:3], C, torch.float32, "cpu"), C, "cpu", with_groups=False) is None
