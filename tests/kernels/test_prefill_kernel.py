"""chunkgen's bf16 prefill attention kernel (native().prefill_attention) on every bf16 path this
machine has, against a float64 softmax(q k^T * scale + mask) v, output and log-sum-exp."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkgen._native import native
from chunkgen.kernels import invariant, prefill
from tests.helpers import PATHS, WINDOW_KINDS, draw_window, forced, prefill_reference, random_wave, store_new_tokens

BF16_PATHS = [p for p in PATHS if p in ("amx", "avx512_bf16")]
needs_bf16 = pytest.mark.skipif(not BF16_PATHS, reason="no AMX or AVX512_BF16 path on this machine")


def reference(q, k, v, scale, causal, mask):
    group = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) * scale
    t, n = s.shape[-2:]
    if causal:
        s = s.masked_fill(torch.ones(t, n, dtype=torch.bool).triu(n - t + 1), float("-inf"))
    if mask is not None:
        s = s + mask.double()
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ v.double().repeat_interleave(group, 1), lse


def random_problem(seed, batch, kv_heads, group, q_len, kv_len, head_dim, masked, strided):
    """q, k, v (as prefill passes them: [T, H, d] storage seen as [1, H, T, d] when `strided`) and
    an optional mask hiding random keys and whole columns, every row keeping key 0 (which a causal
    row sees too)."""
    gen = torch.Generator().manual_seed(seed)

    def tensor(heads, n):
        if strided:
            return torch.randn(batch, n, heads, head_dim, generator=gen).bfloat16().transpose(1, 2)
        return torch.randn(batch, heads, n, head_dim, generator=gen).bfloat16()

    q, k, v = tensor(kv_heads * group, q_len), tensor(kv_heads, kv_len), tensor(kv_heads, kv_len)
    mask = None
    if masked:
        hidden = torch.rand(batch, 1, q_len, kv_len, generator=gen) < 0.4
        hidden[..., torch.rand(kv_len, generator=gen) < 0.2] = True  # columns no query sees
        hidden[..., 0] = False
        mask = torch.zeros(hidden.shape, dtype=torch.bfloat16).masked_fill_(hidden, float("-inf"))
    return q, k, v, mask


def check(q, k, v, scale, causal, mask):
    o, lse = native().prefill_attention(q, k, v, scale, causal, mask)
    want_o, want_lse = reference(q, k, v, scale, causal, mask)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert o.shape == q.shape and lse.shape == q.shape[:-1]
    # bf16 products with fp32 sums; o is rounded to bf16 (see test_kernels.tolerance).
    assert torch.allclose(o.double(), want_o, atol=1e-2, rtol=2e-2), (o.double() - want_o).abs().max()
    assert torch.allclose(lse.double(), want_lse, atol=5e-3, rtol=1e-3), (lse.double() - want_lse).abs().max()


@needs_bf16
@settings(max_examples=150, deadline=None)
@given(
    path=st.sampled_from(BF16_PATHS or ["none"]),
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 3, 4]),
    q_len=st.sampled_from([1, 7, 33, 100, 130]),
    extra=st.sampled_from([0, 1, 31, 64, 200]),
    head_dim=st.sampled_from([16, 32, 48, 64, 128]),
    mode=st.sampled_from(["plain", "causal", "mask", "causal+mask"]),
    strided=st.booleans(),
)
def test_kernel_matches_reference(path, seed, batch, kv_heads, group, q_len, extra, head_dim, mode, strided):
    q, k, v, mask = random_problem(
        seed, batch, kv_heads, group, q_len, q_len + extra, head_dim, "mask" in mode, strided
    )
    with forced(path):
        check(q, k, v, head_dim**-0.5, "causal" in mode, mask)


@needs_bf16
@pytest.mark.parametrize("path", BF16_PATHS)
@pytest.mark.parametrize("q_len,kv_len,causal", [(513, 513, True), (200, 1100, False), (48, 48, False)])
def test_the_workload_shapes(path, q_len, kv_len, causal):
    """The prefill's three products at reduced size: a prompt causally, questions over it, and a
    masked batch of questions over their own tokens (several key blocks, ragged last ones)."""
    q, k, v, mask = random_problem(7, 1 if kv_len > 48 else 12, 3, 3, q_len, kv_len, 64, kv_len == 48, True)
    with forced(path):
        check(q, k, v, 0.125, causal, mask)


@needs_bf16
@pytest.mark.parametrize("path", BF16_PATHS)
def test_a_mask_broadcast_over_the_batch_and_rows_that_see_nothing(path):
    """A [1, 1, T, S] mask applies to every batch; a row whose keys are all hidden gets o = 0 and
    lse = -inf (its weight in a merge is 0), and does not disturb the other rows."""
    q, k, v, _ = random_problem(3, 2, 2, 3, 20, 70, 64, False, False)
    mask = torch.zeros(1, 1, 20, 70, dtype=torch.bfloat16)
    mask[..., 5, :] = float("-inf")
    mask[..., 6, 3:] = float("-inf")
    with forced(path):
        o, lse = native().prefill_attention(q, k, v, 0.125, False, mask)
    assert torch.equal(o[:, :, 5], torch.zeros_like(o[:, :, 5])) and bool((lse[:, :, 5] == float("-inf")).all())
    keep = [t for t in range(20) if t != 5]
    want_o, want_lse = reference(q, k, v, 0.125, False, mask.expand(2, 1, 20, 70))
    assert torch.allclose(o[:, :, keep].double(), want_o[:, :, keep], atol=1e-2, rtol=2e-2)
    assert torch.allclose(lse[:, :, keep].double(), want_lse[:, :, keep], atol=5e-3, rtol=1e-3)


@needs_bf16
def test_attention_lse_keeps_torchs_contract():
    """prefill.attention_lse gives what torch's fused kernel gives (shapes, dtypes, layout, values
    within bf16), on whichever path it takes here."""
    q, k, v, mask = random_problem(11, 4, 3, 3, 40, 40, 64, True, True)
    o, lse = prefill.attention_lse(q, k, v, 0.125, mask=mask)
    want_o, want_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=0.125
    )
    assert o.shape == want_o.shape and o.stride() == want_o.stride() and o.dtype == want_o.dtype
    assert lse.shape == want_lse.shape and lse.stride() == want_lse.stride() and lse.dtype == want_lse.dtype
    assert torch.allclose(o.float(), want_o.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(lse, want_lse, atol=5e-3, rtol=1e-3)


def test_lower_paths_fall_back_to_torch():
    """Without a bf16 path the kernel refuses (ValueError) and attention_lse takes torch's kernel."""
    q, k, v, _ = random_problem(1, 1, 1, 2, 8, 8, 64, False, False)
    with forced(PATHS[-1]):
        with pytest.raises(ValueError, match="AMX or AVX512_BF16"):
            native().prefill_attention(q, k, v, 0.125, True)
        o, lse = prefill.attention_lse(q, k, v, 0.125, causal=True)
    want_o, want_lse = reference(q, k, v, 0.125, True, None)
    assert torch.allclose(o.double(), want_o, atol=1e-2, rtol=2e-2)
    assert torch.allclose(lse.double(), want_lse, atol=5e-3, rtol=1e-3)


def test_bad_arguments_raise_python_errors():
    q = torch.zeros(1, 6, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 5, 64, dtype=torch.bfloat16)
    f = native().prefill_attention
    with pytest.raises(TypeError, match="bfloat16"):
        f(q.float(), k, k, 0.1)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        f(q, torch.zeros(1, 4, 5, 64, dtype=torch.bfloat16), torch.zeros(1, 4, 5, 64, dtype=torch.bfloat16), 0.1)
    with pytest.raises(ValueError, match="one shape"):
        f(q, k, k[:, :, :4], 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        f(q[..., :40], k[..., :40], k[..., :40], 0.1)
    with pytest.raises(ValueError, match="mask must be"):
        f(q, k, k, 0.1, False, torch.zeros(1, 1, 4, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="mask must be bfloat16"):
        f(q, k, k, 0.1, False, torch.zeros(1, 1, 4, 5))
    with pytest.raises(ValueError, match=r"\[batch, q_heads"):
        f(q[0], k, k, 0.1)


# ---- sliding windows and soft-capping over the prefix tree ---------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(1, 8),
    chunk=st.sampled_from([8, 16, 64]),
    heads=st.sampled_from([(4, 2), (9, 3)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    window_kind=st.sampled_from(WINDOW_KINDS),
    softcap=st.sampled_from([0.0, 3.0, 30.0]),
    batch_invariant=st.booleans(),
)
def test_prefill_windows_and_softcap_match_reference(
    seed, n_seqs, chunk, heads, dtype, window_kind, softcap, batch_invariant
):
    """Shared-prefix groups, own parts and lone sequences with windows below, at and across a
    chunk; prefix chunks that no member's window reaches are NaN, so gathering one fails. With
    batch-invariant numerics every sequence is planned alone and the lone ones go in one call, as
    the engine does (read in place, in fp32 and bf16)."""
    rnd = random.Random(seed)
    window = draw_window(rnd, window_kind, chunk)
    hq, hk = heads
    pool, spans, rows = random_wave(seed, n_seqs, chunk, hk, 32, dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(rows, hq, 32, generator=gen) * 2).to(dtype)
    k = torch.randn(rows, hk, 32, generator=gen).to(dtype)
    v = torch.randn(rows, hk, 32, generator=gen).to(dtype)
    want = prefill_reference(q, k, v, pool, spans, 32**-0.5, window, softcap)
    store_new_tokens(pool, spans, k, v)  # as the model does before attention
    groups = prefill.plan_groups(spans, chunk, dtype, q.device, alone=batch_invariant)
    if window:  # NaN into the chunks no new token's window reaches
        needed = {
            sp.path_slots[p // chunk] for sp in spans for p in range(max(0, sp.start - window + 1), sp.start + sp.count)
        }
        unread = [slot for slot in range(pool.capacity) if slot not in needed]
        if unread:
            pool.k[0, torch.tensor(unread)] = float("nan")
            pool.v[0, torch.tensor(unread)] = float("nan")
    out = torch.full((rows, hq, 32), float("nan"), dtype=dtype)
    invariant.set_enabled(batch_invariant)
    try:
        lone = prefill.lone_spans(groups) if batch_invariant else None
        prefill.prefill_attention(groups, 0, q, k, v, pool, 32**-0.5, out, window=window, softcap=softcap, lone=lone)
    finally:
        invariant.set_enabled(False)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), want, atol=tol, rtol=tol), (out.double() - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_windowed_prompt_reads_its_keys_by_blocks(dtype):
    """A lone 700-token prompt with a 100-token window (several query blocks, each needing only
    its window's keys) and one of 600 cached tokens plus 300 new ones whose early cached chunks no
    window reaches (NaN), against the float64 reference: in fp32 read in place, in bf16 (without
    batch-invariant numerics) on the masked torch path."""
    pool = prefill.ChunkPool(1, 2, 32, 16, dtype, budget_bytes=1 << 24)
    cached = [pool.allocate() for _ in range(-(-900 // 16))]
    fresh = [pool.allocate() for _ in range(-(-700 // 16))]
    spans = [prefill.PrefillSpan(0, fresh, 0, 700), prefill.PrefillSpan(600, cached, 700, 300)]
    gen = torch.Generator().manual_seed(4)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    q, k, v = (torch.randn(1000, h, 32, generator=gen).to(dtype) for h in (4, 2, 2))
    store_new_tokens(pool, spans, k, v)
    want = prefill_reference(q, k, v, pool, spans, 0.2, 100, 0.0)
    pool.k[0, torch.tensor(cached[: (600 - 99) // 16])] = float("nan")
    pool.v[0, torch.tensor(cached[: (600 - 99) // 16])] = float("nan")
    out = torch.full((1000, 4, 32), float("nan"), dtype=dtype)
    prefill.prefill_attention(prefill.plan_groups(spans, 16, dtype, q.device), 0, q, k, v, pool, 0.2, out, window=100)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), want, atol=tol, rtol=tol), (out.double() - want).abs().max()


@pytest.mark.parametrize(
    "dtype,batch_invariant,in_place",
    [(torch.float32, False, True), (torch.bfloat16, True, True), (torch.bfloat16, False, False)],
)
def test_windows_and_caps_take_the_in_place_fold_where_it_applies(dtype, batch_invariant, in_place):
    """With a window or soft-capping, lone sequences are read in place (fp32; bf16 with
    batch-invariant numerics), in one call where the wave gives its lone spans; a group of several
    members, and bf16 without batch-invariant numerics, take the masked torch path."""
    from unittest import mock

    pool, spans, rows = random_wave(5, 6, 16, 2, 32, dtype)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(rows, h, 32, generator=gen).to(dtype) for h in (4, 2, 2))
    store_new_tokens(pool, spans, k, v)
    groups = prefill.plan_groups(spans, 16, dtype, q.device, alone=batch_invariant)
    shared = sum(g.key_idx is not None for g in groups)
    out = torch.empty(rows, 4, 32, dtype=dtype)
    masked = mock.Mock(wraps=prefill._masked_group)
    invariant.set_enabled(batch_invariant)
    try:
        with mock.patch.object(prefill, "_masked_group", masked):
            prefill.prefill_attention(
                groups, 0, q, k, v, pool, 0.2, out, window=20, softcap=5.0, lone=prefill.lone_spans(groups)
            )
    finally:
        invariant.set_enabled(False)
    assert masked.call_count == (shared if in_place else len(groups))
    want = prefill_reference(q, k, v, pool, spans, 0.2, 20, 5.0)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), want, atol=tol, rtol=tol)
