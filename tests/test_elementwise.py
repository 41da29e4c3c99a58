"""The fused elementwise ops against the unfused torch compositions they replace in the decode
forward: bit for bit in fp32 and bf16 (fp16 too), on random inputs of the shapes that matter (a hidden
size with a scalar tail past the 8-float vectors, long rows that take the sum's multi-level path)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chunkgen.kernels.elementwise import add_rms_norm, rotary, silu_mul

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (signed zeros included); NaN where the other has NaN (its payload
    is whatever the conversion picks: ATen's vector and scalar paths differ there themselves)."""
    as_int = {2: torch.int16, 4: torch.int32}
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return torch.equal(a[keep].contiguous().view(as_int[a.element_size()]),
                       b[keep].contiguous().view(as_int[b.element_size()]))


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
        assert bits_equal(got[:, :hq * d], qkv[:, :hq * d])  # q's heads in qkv are left alone
        assert bits_equal(got[:, (hq + hk) * d :], qkv[:, (hq + hk) * d :])  # v untouched


def test_rotary_rejects_a_position_outside_the_table():
    qkv = torch.randn(2, 3 * 16)
    cos = sin = torch.ones(4, 1, 16)
    with pytest.raises(ValueError, match="outside the rotary table"):
        rotary(qkv, torch.tensor([1, 4], dtype=torch.int32), cos, sin, 1, 1, torch.empty(2, 1, 16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_bitwise_the_torch_composition(dtype):
    """exp included: the kernel evaluates it as ATen's vectorised kernel does; the ends of its
    range (overflow, underflow, infinities, NaN) too."""
    g = torch.Generator().manual_seed(2)
    rows, n = 33, 1536
    gate_up = (torch.randn(rows, 2 * n, generator=g) * 6).to(dtype)
    gate_up[0, :10] = torch.tensor([float("nan"), float("inf"), -float("inf"), 200, -200, 88.5, -88.5, 0.0, -0.0, 104.5])
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    out = torch.empty(rows, n, dtype=dtype)
    silu_mul(gate_up, out)
    assert bits_equal(out, want), int((out != want).sum())


def test_ops_check_their_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, None, torch.ones(7), 1e-5, torch.empty_like(x))
    with pytest.raises(TypeError, match="delta must be"):
        add_rms_norm(x, x.double(), torch.ones(8), 1e-5, torch.empty_like(x))
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(torch.randn(4, 9), torch.empty(4, 4))
