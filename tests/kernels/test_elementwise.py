"""The fused elementwise ops against the unfused torch compositions they replace in the decode
forward: bit for bit in fp32 and bf16 (fp16 too), on random inputs of the shapes that matter (a hidden
size with a scalar tail past the 8-float vectors, long rows that take the sum's multi-level path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chunkgen.kernels.elementwise import KVWrite, add_rms_norm, gelu_tanh_mul, rotary, silu_mul

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (signed zeros included); NaN where the other has NaN (its payload
    is whatever the conversion picks: ATen's vector and scalar paths differ there themselves)."""
    as_int = {2: torch.int16, 4: torch.int32}
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return torch.equal(
        a[keep].contiguous().view(as_int[a.element_size()]), b[keep].contiguous().view(as_int[b.element_size()])
    )


def rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """What the forward computed before the fused op (and transformers' LlamaRMSNorm does)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x, (x.shape[-1],), None, eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (33, 960), (3, 4100), (2, 70000)])
def test_add_rms_norm_is_bitwise_the_torch_composition(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    y = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (1 + torch.randn(hidden, generator=g) * 0.2).to(dtype)
    eps = 1e-5
    want_res = x + y
    want = rms_reference(want_res, w, eps)
    res, out = x.clone(), torch.empty_like(x)
    add_rms_norm(res, y, w, eps, out)
    assert bits_equal(res, want_res)
    assert bits_equal(out, want), (out.float() - want.float()).abs().max()
    # Without a delta: the norm alone, residual untouched.
    out2 = torch.empty_like(x)
    add_rms_norm(x, None, w, eps, out2)
    assert bits_equal(out2, rms_reference(x, w, eps))
    # Gemma's norm: times (1 + weight), in fp32 until the one rounding.
    from chunkgen.model.llama import _rms

    res, out3 = x.clone(), torch.empty_like(x)
    add_rms_norm(res, y, w - 1, eps, out3, offset=True)
    assert bits_equal(out3, _rms(want_res, w - 1, eps, offset=True))


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_rotary_is_bitwise_the_torch_composition(dtype, pos_dtype):
    g = torch.Generator().manual_seed(1)
    rows, hq, hk, d, table = 13, 9, 3, 64, 300
    qkv = torch.randn(rows, (hq + 2 * hk) * d, generator=g).to(dtype)
    angles = torch.rand(table, 1, d, generator=g) * 40
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, table, (rows,), generator=g).to(pos_dtype)
    c, s = cos[positions.long()], sin[positions.long()]
    qk = rotate_reference(qkv[:, : (hq + hk) * d].view(rows, hq + hk, d), c, s)
    for q_dtype in (dtype, torch.float32):
        got = qkv.clone()
        q_out = torch.empty(rows, hq, d, dtype=q_dtype)
        rotary(got, positions, cos, sin, hq, hk, q_out)
        assert bits_equal(q_out, qk[:, :hq].to(q_dtype).contiguous())
        assert bits_equal(got[:, hq * d : (hq + hk) * d], qk[:, hq:].reshape(rows, -1))
        assert bits_equal(got[:, : hq * d], qkv[:, : hq * d])  # q's heads in qkv are left alone
        assert bits_equal(got[:, (hq + hk) * d :], qkv[:, (hq + hk) * d :])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_qk_norm_rotary_is_the_composition_it_replaces(dtype, offset, d):
    """Qwen3's (weight) and Gemma 3's (1 + weight) per-head norms of q and k, then rotary: bit for bit
    the torch norm (the model's _rms, as transformers rounds it) followed by the rotary op."""
    from chunkgen.model.llama import _rms

    g = torch.Generator().manual_seed(d + offset)
    rows, hq, hk, table, eps = 11, 6, 2, 200, 1e-6
    qkv = (torch.randn(rows, (hq + 2 * hk) * d, generator=g) * 3).to(dtype)
    angles = torch.rand(table, 1, d, generator=g) * 40
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, table, (rows,), generator=g)
    qn = (torch.randn(d, generator=g) * 0.3 + (0 if offset else 1)).to(dtype)
    kn = (torch.randn(d, generator=g) * 0.3 + (0 if offset else 1)).to(dtype)
    want = qkv.clone()
    q = want[:, : hq * d].view(rows, hq, d)
    k = want[:, hq * d : (hq + hk) * d].view(rows, hk, d)
    q.copy_(_rms(q, qn, eps, offset))
    k.copy_(_rms(k, kn, eps, offset))
    want_q = torch.empty(rows, hq, d, dtype=dtype)
    rotary(want, positions, cos, sin, hq, hk, want_q)
    got, got_q = qkv.clone(), torch.empty(rows, hq, d, dtype=dtype)
    rotary(got, positions, cos, sin, hq, hk, got_q, qn, kn, eps, offset)
    assert bits_equal(got_q, want_q), (got_q.float() - want_q.float()).abs().max()
    assert bits_equal(got[:, hq * d :], want[:, hq * d :])  # k normed and rotated in place, v as it was
    assert bits_equal(got[:, : hq * d], qkv[:, : hq * d])  # q's heads in qkv are left alone
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        rotary(got, positions, cos, sin, hq, hk, got_q, qn, None, eps)
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        rotary(got, positions, cos, sin, hq, hk, got_q, qn[:-1], kn[:-1], eps)


KV_WRITE_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
]


@pytest.mark.parametrize("dtype,pool_dtype", KV_WRITE_DTYPES)
@pytest.mark.parametrize("norms", [False, True])
def test_rotary_stores_the_steps_kv_as_the_pool_write_does(dtype, pool_dtype, norms):
    check_rotary_kv_write(dtype, pool_dtype, norms, "cpu")


def check_rotary_kv_write(dtype: torch.dtype, pool_dtype: torch.dtype, norms: bool, device: str) -> None:
    """With a KVWrite, rotary also stores the first len(write_slot) rows' rotated k and their v in
    the pool's layer (the GPU's decode step, one kernel a layer fewer): the same bits as rotary
    followed by the pool's own write; the other rows, layers and slots untouched; qkv and q as
    without it. (Run on a GPU by tests/kernels/test_cuda.py.)"""
    from chunkgen._native import native

    g = torch.Generator().manual_seed(7 + norms)
    rows, hq, hk, d, chunk, slots, table = 6, 9, 3, 64, 16, 9, 100
    qkv = (torch.randn(rows, (hq + 2 * hk) * d, generator=g) * 3).to(dtype).to(device)
    angles = torch.rand(table, 1, d, generator=g) * 40
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    positions = torch.randint(0, table, (rows,), generator=g, dtype=torch.int32).to(device)
    qk_norms = ((torch.randn(d, generator=g) * 0.3 + 1).to(dtype).to(device),) * 2 if norms else (None, None)
    slot = torch.tensor([4, 0, 8, 2, 5], dtype=torch.int32)  # 5 of 6 rows: a mixed step's decode rows
    offset = torch.tensor([0, 15, 3, 7, 1], dtype=torch.int32)
    pool = lambda shape: torch.full((2, slots, hk, *shape), float("nan"), dtype=pool_dtype, device=device)  # noqa: E731
    k_cache, v_cache = pool((d, chunk)), pool((chunk, d))
    got, q = qkv.clone(), torch.empty(rows, hq, d, dtype=dtype, device=device)
    write = KVWrite(k_cache, v_cache, 1, slot.to(device), offset.to(device))
    rotary(got, positions, cos, sin, hq, hk, q, *qk_norms, 1e-6, False, write)
    want, want_q = qkv.clone(), torch.empty(rows, hq, d, dtype=dtype, device=device)
    rotary(want, positions, cos, sin, hq, hk, want_q, *qk_norms, 1e-6)
    want_k, want_v = pool((d, chunk)), pool((chunk, d))
    n = len(slot)
    k = want[:n, hq * d : (hq + hk) * d].view(n, hk, d)
    v = want[:n, (hq + hk) * d :].view(n, hk, d)
    native().write_kv(k, v, want_k[1], want_v[1], slot.to(device), offset.to(device))
    assert bits_equal(got.cpu(), want.cpu()) and bits_equal(q.cpu(), want_q.cpu())
    assert bits_equal(k_cache.cpu(), want_k.cpu()) and bits_equal(v_cache.cpu(), want_v.cpu())
    assert int(k_cache.isnan().logical_not().sum()) == int(v_cache.isnan().logical_not().sum()) == n * hk * d


def test_rotary_checks_its_kv_write():
    qkv, cos, q = torch.randn(3, 4 * 16), torch.ones(8, 1, 16), torch.empty(3, 1, 16)
    pos = torch.zeros(3, dtype=torch.int32)
    k_cache, v_cache = torch.empty(2, 4, 1, 16, 8), torch.empty(2, 4, 1, 8, 16)
    idx = torch.zeros(3, dtype=torch.int32)
    cases = [
        (KVWrite(k_cache, None, 0, idx, idx), "go together"),
        (KVWrite(k_cache, v_cache, 2, idx, idx), "layer 2 is outside"),
        (KVWrite(k_cache, v_cache, 0, idx.long(), idx), "must be int32"),
        (KVWrite(k_cache, v_cache, 0, torch.zeros(4, dtype=torch.int32), idx), "write_slot has 4 rows"),
        (KVWrite(k_cache[:, :, :, :8], v_cache, 0, idx, idx), "pool's heads"),
    ]
    for write, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            rotary(qkv.clone(), pos, cos, cos, 1, 1, q, write=write)
    with pytest.raises(ValueError, match="cannot hold 1 \\+ 2 x 1 heads"):  # no room for v
        rotary(torch.randn(3, 2 * 16), pos, cos, cos, 1, 1, q, write=KVWrite(k_cache, v_cache, 0, idx, idx))


def test_rotary_rejects_a_position_outside_the_table():
    qkv = torch.randn(2, 3 * 16)
    cos = sin = torch.ones(4, 1, 16)
    with pytest.raises(ValueError, match="outside the rotary table"):
        rotary(qkv, torch.tensor([1, 4], dtype=torch.int32), cos, sin, 1, 1, torch.empty(2, 1, 16))


@pytest.mark.parametrize("n", [1536, 1541])  # 1541: whole vectors, then a tail of 5
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_bitwise_the_torch_composition(dtype, n):
    """exp included: the kernel evaluates it as ATen's vectorised kernel does; the ends of its
    range (overflow, underflow, infinities, NaN) too. A row's last n % 32 elements ATen computes
    with libm's expf, the kernel with the vector one: there, within a rounding."""
    g = torch.Generator().manual_seed(2)
    rows = 33
    gate_up = (torch.randn(rows, 2 * n, generator=g) * 6).to(dtype)
    gate_up[0, :10] = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 200, -200, 88.5, -88.5, 0.0, -0.0, 104.5]
    )
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    out = torch.empty(rows, n, dtype=dtype)
    silu_mul(gate_up, out)
    body = n - n % 32
    assert bits_equal(out[:, :body], want[:, :body]), int((out[:, :body] != want[:, :body]).sum())
    torch.testing.assert_close(out[:, body:], want[:, body:], rtol=2 * torch.finfo(dtype).eps, atol=0, equal_nan=True)


@pytest.mark.parametrize("n", [1536, 1541])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_is_the_torch_composition(dtype, n):
    """Gemma's GeGLU: within a rounding of the torch composition (the kernel evaluates 1 + tanh(y)
    as 2 / (1 + exp(-2y)); for very negative gates torch's 1 + tanh cancels, so a last-bit
    difference of its tanh shows as an absolute one of a few 1e-6), the ends of the range and NaN
    included."""
    g = torch.Generator().manual_seed(3)
    rows = 33
    gate_up = (torch.randn(rows, 2 * n, generator=g) * 4).to(dtype)
    gate_up[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 60, -60, 0.0, -0.0, 3.0])
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    out = torch.empty(rows, n, dtype=dtype)
    gelu_tanh_mul(gate_up, out)
    ulp = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out, want, rtol=ulp, atol=1e-5, equal_nan=True)
    with pytest.raises(ValueError, match="gate_up"):
        gelu_tanh_mul(gate_up, torch.empty(rows, n + 1, dtype=dtype))


def test_ops_check_their_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, None, torch.ones(7), 1e-5, torch.empty_like(x))
    with pytest.raises(TypeError, match="delta must be"):
        add_rms_norm(x, x.double(), torch.ones(8), 1e-5, torch.empty_like(x))
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(torch.randn(4, 9), torch.empty(4, 4))


def unfused_decode(model, step, k_cache, v_cache, workspace, chunk_first: bool) -> torch.Tensor:
    """The decode forward as torch ops (what it was before the fused ops): the reference the fused
    forward must equal bit for bit."""
    from chunkgen.kernels import decode_step_attention

    def rms(x, w):
        return (
            F.rms_norm(x, (x.shape[-1],), w, model.eps)
            if x.dtype == torch.float32
            else w * F.rms_norm(x, (x.shape[-1],), None, model.eps)
        )

    x = F.embedding(step.tokens, model.embed)
    rows, d = x.shape[0], model.head_dim
    cos, sin = (t[step.positions] for t in model.rope_tables["default"])
    q_dtype = x.dtype if x.dtype == k_cache.dtype else torch.float32  # as the model's decode passes q
    out = torch.empty(rows, model.q_heads, d, dtype=q_dtype)
    for i, layer in enumerate(model.layers):
        qkv = layer.qkv(rms(x, layer.ln_attn))
        n_qk = (model.q_heads + model.kv_heads) * d
        qk = rotate_reference(qkv[:, :n_qk].view(rows, -1, d), cos, sin)
        v = qkv[:, n_qk:].view(rows, model.kv_heads, d)
        decode_step_attention(
            qk[:, : model.q_heads].to(q_dtype).contiguous(),
            qk[:, model.q_heads :],
            v,
            k_cache,
            v_cache,
            i,
            step,
            workspace,
            out,
            model.scale,
            chunk_first,
        )
        x = x + layer.o(out.to(x.dtype).reshape(rows, -1))
        gate, up = layer.gate_up(rms(x, layer.ln_mlp)).chunk(2, dim=-1)
        x = x + layer.down(F.silu(gate) * up)
    return model.lm_head(rms(x, model.norm))  # logits in the model's dtype: the sampler widens them


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_decode_forward_is_bitwise_the_unfused_one(tiny_model, dtype):
    from chunkgen.engine import Request, SamplingParams
    from chunkgen.llm import LLM

    llm = LLM(model=str(tiny_model), chunk_size=16, kv_memory="64MiB", max_batch=8, dtype=dtype)
    engine = llm.new_engine()
    engine.add(
        [Request(i, [3 + i % 2] * 21 + [20 + i], SamplingParams(max_new_tokens=8, ignore_eos=True)) for i in range(6)]
    )
    while engine.num_waiting:
        engine.step()
    for _ in range(3):  # a few steps in, so positions and paths differ between rows
        engine.step()
    r = engine.runner
    args = (r.ctx.arrays(), r.pool.k, r.pool.v, r.workspace(), r.chunk_first)
    with torch.inference_mode():
        want = unfused_decode(llm.model, *args)
    got = llm.model.decode(*args)  # writes the same K/V to the same places: the pool is unchanged
    assert bits_equal(got, want), (got - want).abs().max()
