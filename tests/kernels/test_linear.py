"""chunkgen's decode products against a float64 x W^T: bf16 (csrc/cpu/linear.cpp) on every bf16
path this machine has (AMX, AVX512_BF16), fp32 (csrc/cpu/linear_fp32.cpp) on the build's vectors;
and the model's Linear choosing them only where they apply."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkgen.kernels import invariant
from chunkgen.model import llama
from tests.helpers import PATHS, forced

BF16_PATHS = [p for p in PATHS if p in ("amx", "avx512_bf16")]
needs_bf16 = pytest.mark.skipif(not BF16_PATHS, reason="no AMX or AVX512_BF16 path on this machine")


def packed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    packed = torch.ops.chunkgen.pack_linear.default(w)
    return torch.ops.chunkgen.packed_linear.default(x, packed, w.shape[0])


@needs_bf16
@settings(max_examples=80, deadline=None)
@given(
    path=st.sampled_from(BF16_PATHS or ["none"]),
    rows=st.one_of(st.integers(0, 32), st.integers(33, 300)),
    n=st.sampled_from([1, 16, 31, 32, 33, 80, 576]),
    k=st.sampled_from([1, 31, 32, 40, 64, 200, 576, 2048]),  # 2,048: rows 4 KiB apart
    strided=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_the_product_is_x_times_w_transposed(path, rows, n, k, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = (
        torch.randn(k, rows, generator=gen).bfloat16().t()
        if strided
        else torch.randn(rows, k, generator=gen).bfloat16()
    )
    with forced(path):
        got = packed_linear(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    want = x.double() @ w.double().t()
    # fp32 sums of bf16 products, rounded once to bf16: within bf16's rounding of the result
    # plus fp32's of a sum of k terms
    bound = want.abs() * 2**-8 + (x.double().abs() @ w.double().abs().t()) * k * 2**-23 + 1e-30
    assert ((got.double() - want).abs() <= bound).all()


@needs_bf16
@pytest.mark.parametrize("path", BF16_PATHS)
def test_a_rows_result_does_not_depend_on_the_calls_rows(path):
    """AMX takes panels of 256 rows, 32 at a time over each weight block (a last partial tile
    from a zero-padded copy), the AVX512_BF16 product any rows in groups of 14 per weight block: a
    row's output is bit-identical in calls of 1 to 300 rows, wherever it falls. k = 2,048
    puts rows 4 KiB apart, which the product reads from a copy whose rows are not (a lone row as
    it is)."""
    for k in (200, 2048):
        w = torch.randn(100, k).bfloat16()
        x = torch.randn(300, k).bfloat16()
        with forced(path):
            full = packed_linear(x, w)
            for rows in (1, 7, 14, 15, 33, 256):
                for start in (0, 5, 300 - rows):
                    assert torch.equal(packed_linear(x[start : start + rows], w), full[start : start + rows])


@needs_bf16
@pytest.mark.parametrize("path", BF16_PATHS)
def test_rows_in_several_spread_panels_keep_their_bits(path):
    """k = 8,192 puts rows 16 KiB apart: the AVX512_BF16 product reads them from per-thread copies
    of 512 rows at a time; a row's output is the same in whichever panel it falls."""
    w = torch.randn(40, 8192).bfloat16()
    x = torch.randn(1100, 8192).bfloat16()
    with forced(path):
        full = packed_linear(x, w)
        for start, rows in ((0, 1), (500, 20), (100, 1000), (1099, 1)):
            assert torch.equal(packed_linear(x[start : start + rows], w), full[start : start + rows])
    want = x.double() @ w.double().t()
    bound = want.abs() * 2**-8 + (x.double().abs() @ w.double().abs().t()) * 8192 * 2**-23
    assert ((full.double() - want).abs() <= bound).all()


@needs_bf16
@pytest.mark.parametrize("path", BF16_PATHS)
@pytest.mark.parametrize("n", [3072, 3080])
def test_a_large_output_keeps_its_bits(path, n):
    """300 rows of 3,072 columns (1.8 MiB) go out as streaming stores (csrc/cpu/output_lines.h),
    3,080 columns (rows not whole cache lines) and a call of a few rows through the cache: every
    row has the bits it has alone, and is x W^T."""
    w = torch.randn(n, 576).bfloat16()
    x = torch.randn(300, 576).bfloat16()
    with forced(path):
        full = packed_linear(x, w)
        for start, rows in ((0, 7), (150, 1), (290, 10)):
            assert torch.equal(packed_linear(x[start : start + rows], w), full[start : start + rows])
    want = x.double() @ w.double().t()
    bound = want.abs() * 2**-8 + (x.double().abs() @ w.double().abs().t()) * 576 * 2**-23
    assert ((full.double() - want).abs() <= bound).all()


@needs_bf16
@pytest.mark.parametrize("path", BF16_PATHS)
def test_a_weight_with_nan_touches_only_its_own_columns(path):
    w = torch.randn(40, 64).bfloat16()
    w[33, 5] = float("nan")
    with forced(path):
        got = packed_linear(torch.randn(20, 64).bfloat16(), w)
    assert got[:, 33].isnan().all() and not got[:, :33].isnan().any() and not got[:, 34:].isnan().any()


@needs_bf16
def test_bad_arguments_are_refused():
    w = torch.randn(40, 64).bfloat16()
    packed = torch.ops.chunkgen.pack_linear.default(w)
    op = torch.ops.chunkgen.packed_linear.default
    x = torch.randn(70, 64).bfloat16()  # more than one pass's rows: panels, each row as alone
    assert torch.equal(op(x, packed, 40)[40:41], op(x[40:41], packed, 40))
    with pytest.raises(TypeError, match="bfloat16"):
        op(torch.randn(4, 64), packed, 40)
    with pytest.raises(ValueError, match="pack_linear of a"):
        op(torch.randn(4, 32).bfloat16(), packed, 40)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        torch.ops.chunkgen.pack_linear.default(w.half())


@pytest.fixture
def invariant_off():
    """The fast plan of each call (`--batch-invariant off`)."""
    invariant.set_enabled(False)
    yield
    invariant.set_enabled(False)


@needs_bf16
def test_the_model_uses_it_for_up_to_256_rows(monkeypatch, invariant_off):
    w = torch.randn(600, 512).bfloat16()  # above the size oneDNN and the AMX product are used for
    lin = llama.Linear(w, None)
    assert lin.decode_packed is not None
    calls = []
    real = torch.ops.chunkgen.packed_linear.default
    monkeypatch.setattr(
        llama.torch.ops.chunkgen.packed_linear, "default", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    for rows in (1, 32, 33, 256, 257):
        x = torch.randn(rows, 512).bfloat16()
        y = lin(x)
        want = x.double() @ w.double().t()
        assert y.shape == (rows, 600) and ((y.double() - want).abs() <= want.abs() * 2**-7 + 1e-2).all()
    assert calls == [1, 32, 33, 256]
    assert not llama.Linear(w, torch.zeros(600).bfloat16()).decode_fast  # biased: oneDNN's path
    monkeypatch.setenv("CHUNKGEN_DECODE_LINEAR", "0")
    assert llama.Linear(w, None).decode_packed is None
    monkeypatch.setenv("CHUNKGEN_DECODE_LINEAR", "1")
    monkeypatch.setenv("CHUNKGEN_CPU_ISA", "fp32")  # no bf16 arithmetic: oneDNN's path
    assert llama.Linear(w, None).decode_packed is None


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(0, 256),
    n=st.sampled_from([1, 15, 16, 17, 33, 80, 576]),
    k=st.sampled_from([1, 7, 64, 200, 576, 1024]),  # 1,024: rows 4 KiB apart
    strided=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_the_fp32_product_is_x_times_w_transposed(rows, n, k, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(k, rows, generator=gen).t() if strided else torch.randn(rows, k, generator=gen)
    got = packed_linear(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    want = x.double() @ w.double().t()
    bound = (x.double().abs() @ w.double().abs().t()) * k * 2**-23 + 1e-30  # fp32's rounding of k terms
    assert ((got.double() - want).abs() <= bound).all()


def test_an_fp32_rows_result_does_not_depend_on_the_calls_rows():
    """Panels of 256 rows, groups of 14 (6 below AVX-512); k = 1,024 puts rows 4 KiB apart, read
    from a copy whose rows are not (a lone row, and a group of 6, as they are)."""
    for k in (200, 1024):
        w = torch.randn(100, k)
        x = torch.randn(600, k)
        full = packed_linear(x, w)
        for rows in (1, 6, 7, 14, 15, 256, 257):
            for start in (0, 5, 600 - rows):
                assert torch.equal(packed_linear(x[start : start + rows], w), full[start : start + rows])


@pytest.mark.parametrize("n", [1024, 1028])
def test_a_large_fp32_output_keeps_its_bits(n):
    """300 rows of 1,024 fp32 columns (1.2 MiB) go out as streaming stores, 1,028 (rows not whole
    cache lines) and a call of a few rows through the cache: each row as alone, and x W^T."""
    w = torch.randn(n, 200)
    x = torch.randn(300, 200)
    full = packed_linear(x, w)
    for start, rows in ((0, 6), (150, 1), (290, 10)):
        assert torch.equal(packed_linear(x[start : start + rows], w), full[start : start + rows])
    want = x.double() @ w.double().t()
    assert ((full.double() - want).abs() <= (x.double().abs() @ w.double().abs().t()) * 200 * 2**-23).all()


def test_the_fp32_product_keeps_a_nan_in_its_own_column_and_refuses_bad_arguments():
    w = torch.randn(40, 64)
    w[33, 5] = float("nan")
    got = packed_linear(torch.randn(20, 64), w)
    assert got[:, 33].isnan().all() and not got[:, :33].isnan().any() and not got[:, 34:].isnan().any()
    packed = torch.ops.chunkgen.pack_linear.default(w)
    op = torch.ops.chunkgen.packed_linear.default
    x = torch.randn(600, 64)  # more than one pass's rows: panels, each row as alone
    torch.testing.assert_close(op(x, packed, 40)[300:301], op(x[300:301], packed, 40), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="pack_linear of a"):
        op(torch.randn(4, 32), packed, 40)
    with pytest.raises(TypeError, match="both bfloat16 or both float32"):
        op(torch.randn(4, 64).bfloat16(), packed, 40)


def test_the_model_uses_the_fp32_product_for_up_to_256_rows(monkeypatch, invariant_off):
    w = torch.randn(600, 512)
    lin = llama.Linear(w, None)
    assert lin.decode_packed is not None
    calls = []
    real = torch.ops.chunkgen.packed_linear.default
    monkeypatch.setattr(
        llama.torch.ops.chunkgen.packed_linear, "default", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    for rows in (1, 256, 257):
        x = torch.randn(rows, 512)
        want = x.double() @ w.double().t()
        assert ((lin(x).double() - want).abs() <= (x.double().abs() @ w.double().abs().t()) * 512 * 2**-23).all()
    assert calls == [1, 256]
    assert not llama.Linear(w, torch.zeros(600)).decode_fast  # biased: oneDNN's path
    monkeypatch.setenv("CHUNKGEN_DECODE_LINEAR", "0")
    assert llama.Linear(w, None).decode_packed is None


@pytest.fixture
def invariant_on():
    invariant.set_enabled(True)
    yield
    invariant.set_enabled(False)  # the process default, outside an engine


def test_with_batch_invariant_numerics_every_call_takes_the_packed_product(monkeypatch, invariant_on):
    w = torch.randn(600, 512)
    calls = []
    real = torch.ops.chunkgen.packed_linear.default
    monkeypatch.setattr(
        llama.torch.ops.chunkgen.packed_linear, "default", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    for lin in (llama.Linear(w, None), llama.Linear(w, torch.randn(600)), llama.Linear(torch.randn(8, 16), None)):
        k = lin.weight.shape[1]
        for rows in (1, 257, 700):
            x = torch.randn(rows, k)
            want = x.double() @ lin.weight.double().t() + (0 if lin.bias is None else lin.bias.double())
            assert (
                (lin(x).double() - want).abs() <= (x.double().abs() @ lin.weight.double().abs().t()) * k * 2**-23 + 1e-5
            ).all()
    assert calls == [1, 257, 700] * 3


@pytest.mark.parametrize("invariant_build", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_held_once_keeps_one_float_layout(invariant_build, bias, invariant_off):
    """held_once (a model built for a run): the as-loaded weight is dropped once packed, oneDNN's
    copy kept only where batch-invariant numerics are off at build, and the products equal those of
    a Linear that keeps every layout, on either setting of the switch at call time."""
    w, b = torch.randn(600, 512), (torch.randn(600) if bias else None)
    full = llama.Linear(w, b)
    held = llama.Linear(w, b, held_once=True, invariant=invariant_build)
    assert held.weight is None and held.decode_packed is not None
    assert (held.packed is None) == invariant_build
    layouts = 1 if invariant_build else 2
    assert held.nbytes <= layouts * w.numel() * w.element_size() * 1.05 < full.nbytes
    for on in (False, True):
        invariant.set_enabled(on)
        for rows in (1, 300):
            x = torch.randn(rows, 512)
            if on or invariant_build or rows <= 256 and not bias:  # the same product on both
                torch.testing.assert_close(held(x), full(x), rtol=0, atol=0)
            else:
                torch.testing.assert_close(held(x), full(x), rtol=1e-5, atol=1e-4)
    invariant.set_enabled(False)
    modules = [torch.nn.Linear(512, 300, bias=False), torch.nn.Linear(512, 300, bias=False)]
    fused = llama.float_linear(modules, held_once=True, invariant=True)
    assert all(m.weight is None for m in modules) and fused.out_features == 600
