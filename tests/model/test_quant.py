"""Quantized linear layers against an independent reference: every GGUF type's repacked weights
equal gguf's own dequantizer, and the kernel's product equals dequantize(W) @ x in float64 within
the bound the int8 quantization of x allows, on every path this machine has (AMX, AVX512_VNNI,
AVX-VNNI, AVX2, the AMX tile emulated, and the scalar reference)."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkgen._native import native_cpu_available
from chunkgen.model import quant

pytestmark = pytest.mark.skipif(
    not native_cpu_available() or not hasattr(torch.ops.chunkgen, "quant_linear"),
    reason="chunkgen's CPU kernels are not built (or built before csrc/cpu/quant_linear.cpp: rebuild)",
)

TYPES = list(quant.GGUF_TYPES.values())
K_QUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)


# best first; amx_emulated (the AMX tile with its instructions done in C++, on any AVX512_VNNI CPU)
# before the scalar reference
PATHS = ("amx", "avx512_vnni", "avx_vnni", "avx2", "amx_emulated", "scalar")


def _paths() -> list[str]:
    """The kernel's paths this build and CPU run, best first: each that CHUNKGEN_QUANT_ISA can select
    (it lowers the path; a path the build lacks, e.g. AVX-VNNI on Zen 4, falls to a lower one; scalar
    is the reference)."""
    if not native_cpu_available() or not hasattr(torch.ops.chunkgen, "quant_isa"):
        return ["scalar"]
    old = os.environ.get("CHUNKGEN_QUANT_ISA")
    found = []
    try:
        for name in PATHS:
            os.environ["CHUNKGEN_QUANT_ISA"] = name
            if torch.ops.chunkgen.quant_isa() == name:
                found.append(name)
    finally:
        os.environ.pop("CHUNKGEN_QUANT_ISA")
        if old is not None:
            os.environ["CHUNKGEN_QUANT_ISA"] = old
    return found


@pytest.fixture(params=_paths())
def path(request, monkeypatch):
    monkeypatch.setenv("CHUNKGEN_QUANT_ISA", request.param)
    assert torch.ops.chunkgen.quant_isa() == request.param
    return request.param


def _weight(qtype, n: int, k: int, seed: int) -> tuple[quant.QuantWeight, np.ndarray]:
    raw = quant.random_gguf(qtype, n, k, 0.05, np.random.default_rng(seed))
    reference = dequantize(raw, qtype).astype(np.float64).reshape(n, k)
    return quant.from_gguf(raw, qtype, n, k), reference


def _check_product(w: quant.QuantWeight, reference: np.ndarray, x: torch.Tensor) -> None:
    """y within the bound of the activations' quantization: each x value is off by at most half its
    block's step (max|block| / 254), so |y - W x| <= |W| (step / 2), plus fp32 rounding."""
    y = quant.quantized_linear(x, w).double().numpy()
    xd = x.double().numpy()
    step = np.abs(xd).reshape(len(xd), -1, 32).max(-1) / 127.0
    half = np.repeat(step / 2, 32, axis=1)
    exact = xd @ reference.T
    bound = half @ np.abs(reference).T + 1e-5 * (np.abs(xd) @ np.abs(reference).T) + 1e-30
    excess = np.abs(y - exact) / bound
    assert excess.max() <= 1.0, f"{w.source}: error {excess.max():.3f} of its bound"
    # and not a trivial pass: the bound is a small part of the product
    assert np.median(bound) < 0.05 * np.median(np.abs(xd) @ np.abs(reference).T)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_repacked_weights_equal_gguf_dequantize(qtype):
    for n, k in ((3, 256), (5, 768)):
        w, reference = _weight(qtype, n, k, seed=n * k)
        np.testing.assert_allclose(w.dequantize().double().numpy(), reference, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_product_matches_dequantized_weights(qtype, path):
    w, reference = _weight(qtype, 37, 512, seed=1)
    x = torch.randn(9, 512)
    x[0] = 0.0  # an all-zero row: scale 0, no division by it
    x[1, :32] *= 1e3  # one loud block does not drown the others (scales are per block)
    _check_product(w, reference, x)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_product_on_tile_edges(qtype, path):
    """Rows not a multiple of the kernel's tiles (4 rows on AVX2; 8, 6 or 5, 4, 2, 1 on
    AVX512_VNNI) and channels not a multiple of its groups (8 channels, the packed layout's padding;
    on AVX512_VNNI a pair of groups, or two pairs for the unsigned kinds, so a lone last group or
    pair too), each alone and together; with k = 4096 a thread's pairs span panels of a few pairs,
    so panels end on a lone pair."""
    for n, rows, k in (
        (19, 6, 256),
        (8, 4, 256),
        (1, 1, 256),
        (13, 9, 256),
        (24, 15, 256),
        (16, 8, 256),
        (40, 7, 256),
        (33, 3, 256),
        (72, 11, 256),
        (200, 13, 4096),
    ):
        w, reference = _weight(qtype, n, k, seed=n + rows)
        _check_product(w, reference, torch.randn(rows, k))


# The bytes of each type's values in a GGUF block, and a fill that puts every value at the end of
# its range the kernel's integer sums find hardest (largest |w|): int16 sums must not saturate.
_EXTREMES = {
    GGMLQuantizationType.Q8_0: [(slice(2, 34), 0x80)],  # -128
    GGMLQuantizationType.Q4_0: [(slice(2, 18), 0xFF)],  # 15
    GGMLQuantizationType.Q4_1: [(slice(4, 20), 0xFF)],
    GGMLQuantizationType.Q4_K: [(slice(16, 144), 0xFF)],
    GGMLQuantizationType.Q5_K: [(slice(16, 176), 0xFF)],  # 31
    GGMLQuantizationType.Q6_K: [(slice(0, 192), 0x00)],  # 0, stored as -32
}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_extreme_values_do_not_saturate(qtype, path):
    """Every weight at its largest magnitude against x at +-127 everywhere: the largest block sums
    the kernel forms (in int16 where it sums a block's pairs before widening) stay exact."""
    n, k = 16, 512
    raw = quant.random_gguf(qtype, n, k, 0.05, np.random.default_rng(7))
    blocks = raw.reshape(-1, quant.GGML_QUANT_SIZES[qtype][1])
    for where, byte in _EXTREMES[qtype]:
        blocks[:, where] = byte
    reference = dequantize(raw, qtype).astype(np.float64).reshape(n, k)
    x = torch.ones(5, k)
    x[1] = -1.0
    x[2, ::2] = -1.0  # mixed signs as well
    _check_product(quant.from_gguf(raw, qtype, n, k), reference, x)


@contextlib.contextmanager
def _on_path(name: str):
    """Runs the kernel on path `name` inside a hypothesis test (a fixture would not change per example)."""
    old = os.environ.get("CHUNKGEN_QUANT_ISA")
    os.environ["CHUNKGEN_QUANT_ISA"] = name
    try:
        yield
    finally:
        os.environ.pop("CHUNKGEN_QUANT_ISA")
        if old is not None:
            os.environ["CHUNKGEN_QUANT_ISA"] = old


@settings(max_examples=40, deadline=None)
@given(
    qtype=st.sampled_from(TYPES),
    n=st.integers(1, 41),
    blocks=st.integers(1, 3),
    rows=st.integers(1, 20),
    seed=st.integers(0, 2**31),
    path=st.sampled_from(_paths()),
)
def test_product_on_random_shapes(qtype, n, blocks, rows, seed, path):
    k = blocks * (256 if qtype in K_QUANTS else 64)
    w, reference = _weight(qtype, n, k, seed)
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32))
    with _on_path(path):
        _check_product(w, reference, x)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_paths_agree_within_fp32_rounding(qtype):
    """Every path quantizes x to the same int8 values and forms the same integer block sums; only
    the order of fp32 sums differs. Rows and channels past the fast paths' tiles included."""
    k = 1024 if qtype in K_QUANTS else 512
    w, _ = _weight(qtype, 37, k, seed=3)
    x = torch.randn(19, k)
    with _on_path("scalar"):
        slow = quant.quantized_linear(x, w)
    for path in _paths()[:-1]:
        with _on_path(path):
            torch.testing.assert_close(quant.quantized_linear(x, w), slow, rtol=1e-5, atol=1e-5, msg=path)


AMX_PATHS = [p for p in ("amx", "amx_emulated") if p in _paths()]


@pytest.mark.skipif(
    not AMX_PATHS, reason="no AMX tile here: neither an AMX CPU nor the AVX512_VNNI one it is emulated beside"
)
@pytest.mark.parametrize("qtype", [*TYPES, "int8"], ids=lambda t: getattr(t, "name", t))
def test_amx_tile_gives_a_row_the_vnni_tiles_bits(qtype):
    """From 16 rows (Q8_0, int8) or 64 (the other kinds) the AMX path runs tiles of 16 rows x 16
    channels (the rest of the rows on the VNNI tile): the same integer block sums and the same fp32
    steps as the VNNI tile, so every row has the same bits on either path and alone (one row: the
    VNNI tile), in fp32 and bf16; and the product is within the activations' quantization bound of
    dequantize(W) @ x. Channels past the last full pair (37: a pair of 5) and rows past the last full
    tile (20, 70, 93) included."""
    k = 512 if qtype in K_QUANTS else 320
    if qtype == "int8":
        w = quant.int8_per_channel(torch.randn(37, k) * 0.05)
        reference = w.dequantize().double().numpy()
    else:
        w, reference = _weight(qtype, 37, k, seed=5)
    generator = torch.Generator().manual_seed(7)
    for rows, dtype in ((20, torch.bfloat16), (64, torch.float32), (70, torch.bfloat16), (93, torch.float32)):
        x = torch.randn(rows, k, generator=generator).to(dtype)
        with _on_path("avx512_vnni"):
            vnni = quant.quantized_linear(x, w)
            alone = [quant.quantized_linear(x[i : i + 1], w) for i in (0, 17, rows - 1)]
        for path in AMX_PATHS:
            with _on_path(path):
                y = quant.quantized_linear(x, w)
            assert torch.equal(y, vnni), (path, rows)
            for i, one in zip((0, 17, rows - 1), alone):
                assert torch.equal(y[i : i + 1], one), (path, rows, i)
    with _on_path(AMX_PATHS[0]):
        _check_product(w, reference, torch.randn(80, k, generator=generator))


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 8), blocks=st.integers(1, 6), seed=st.integers(0, 2**31), scalar=st.booleans())
def test_activation_quantization_error_bound(rows, blocks, seed, scalar):
    """Each value within half a step of its block's int8 grid, the step max|block| / 127; the
    block sums the kernel keeps for mins are scale * sum(q)."""
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, 32 * blocks)).astype(np.float32))
    x *= torch.rand(rows, blocks).repeat_interleave(32, 1) * 10
    with _on_path("scalar" if scalar else _paths()[0]):
        q, scale, qsum = torch.ops.chunkgen.quantize_rows(x)
    step = x.abs().view(rows, blocks, 32).amax(-1) / 127
    torch.testing.assert_close(scale, step)
    back = q.float().view(rows, blocks, 32) * scale[..., None]
    assert ((back - x.view(rows, blocks, 32)).abs() <= step[..., None] / 2 * (1 + 1e-5) + 1e-12).all()
    assert q.abs().max() <= 127
    torch.testing.assert_close(qsum, scale * q.float().view(rows, blocks, 32).sum(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [3, 100])  # one thread's share, and several threads'
def test_activation_quantization_reads_each_dtype_as_its_fp32_values(dtype, rows):
    """x in bf16 or fp16 is quantized as its exact fp32 values would be, on every path (the vector
    paths read it in its own dtype, the scalar one widens it), with the same bits as the scalar path."""
    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=generator) * torch.rand(rows, 1, generator=generator) * 8).to(dtype)
    x[0, :32] = 0  # an all-zero block: scale 0
    with _on_path("scalar"):
        want = torch.ops.chunkgen.quantize_rows(x.float())
    for path in _paths():
        with _on_path(path):
            got = torch.ops.chunkgen.quantize_rows(x)
        for g, w, name in zip(got, want, ("q", "scale", "qsum")):
            assert torch.equal(g, w), (path, name)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_of_a_packed_weight(qtype):
    """An embedding lookup in the packed output layer it is tied to (`pack` undone for the rows
    asked, any order, repeats, the padded last group) gives the row layout's rows and values."""
    w = _weight(qtype, 21, 512, seed=11)[0]
    index = torch.tensor([20, 0, 7, 8, 20, 13, 16])
    rows = quant.packed_rows(quant.pack(w), index)
    expected = w.rows(index)
    for name in ("qs", "scales", "mins", "scale_d", "min_d"):
        got, want = getattr(rows, name), getattr(expected, name)
        assert (got is None) == (want is None), name
        if want is not None:
            assert torch.equal(got.reshape(want.shape), want), name
    lookup = quant.QuantEmbedding(quant.pack(w), torch.float32)(index.view(1, -1))
    torch.testing.assert_close(lookup[0], w.dequantize()[index], rtol=0, atol=0)


def test_int8_per_channel_weights():
    w = torch.randn(48, 160) * torch.rand(48, 1)
    q = quant.int8_per_channel(w)
    step = (w.abs().view(48, -1, 32).amax(-1, keepdim=True) / 127).expand(-1, -1, 32).reshape(48, 160)
    # half a step, plus w's own fp32 rounding where it sits on a half-step boundary
    assert ((q.dequantize() - w).abs() <= step / 2 + w.abs() * 2**-22 + 1e-9).all()
    x = torch.randn(5, 160)
    _check_product(q, q.dequantize().double().numpy(), x)
    assert q.nbytes < w.numel() * 1.2  # bytes, plus one fp32 scale a block


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_bf16_rows_are_the_fp32_products_rounded(qtype, path):
    """bf16 x is quantized as it is (no fp32 copy) and the product written in bf16 as the tiles
    finish: the bits of the fp32 product rounded by torch, on tile edges, factored scales widened
    per panel (37 rows) or not, and at the edge of bf16's range; fp16 x as its fp32 product rounded."""
    for n, rows in ((19, 6), (40, 9), (8, 1), (21, 37)):
        w = _weight(qtype, n, 512, seed=n + 7)[0]
        x = torch.randn(rows, 512).bfloat16()
        x[0, :64] = 3e38  # products near or out of range (inf, NaN where an inf meets its negative)
        y = quant.quantized_linear(x, w)
        assert y.dtype == torch.bfloat16
        expected = quant.quantized_linear(x.float(), w).bfloat16()
        assert (~expected[0].isfinite() | (expected[0].abs() > 1e37)).any() and expected[1:].isfinite().all()
        nan = expected.isnan()
        assert torch.equal(y.isnan(), nan)
        assert torch.equal(y.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])
    w = _weight(GGMLQuantizationType.Q8_0, 8, 64, seed=5)[0]
    x16 = torch.randn(3, 64).half()
    y16 = quant.quantized_linear(x16, w)
    assert y16.dtype == torch.float16
    assert torch.equal(y16, quant.quantized_linear(x16.float(), w).half())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1056, 1064])
def test_a_large_bf16_output_keeps_its_bits(qtype, n, path):
    """300 rows of 1,056 bf16 channels (619 KiB, 66 pairs of groups: the second thread's first pair
    alone) go out whole lines at a time through a stage on the AMX path (csrc/cpu/output_lines.h);
    1,064 (rows not whole lines) through the cache: the bits of the fp32 product rounded, and of
    each row alone."""
    w = quant.pack(_weight(qtype, n, 512, seed=n)[0])
    x = torch.randn(300, 512).bfloat16()
    y = quant.quantized_linear(x, w)
    assert torch.equal(y, quant.quantized_linear(x.float(), w).bfloat16())
    for rows in (slice(0, 1), slice(150, 170), slice(299, 300)):
        assert torch.equal(quant.quantized_linear(x[rows], w), y[rows])


FACTORED = K_QUANTS


def _plain(w: quant.QuantWeight) -> quant.QuantWeight:
    """w with its scales and mins as fp32 per block: the plain form of the same weight."""
    scales, mins = w.block_scales()
    return quant.QuantWeight(w.kind, w.qs, scales.contiguous(), mins, w.n, w.k, w.source)


@pytest.mark.parametrize("qtype", FACTORED, ids=lambda t: t.name)
def test_factored_scales_give_the_plain_forms_bits(qtype, path):
    """The K-types' sub-block scales and mins kept as the file has them (int8 under the file's fp16
    per 256 values) give bit for bit the products of fp32 scales per block, on tile edges too: an
    int8 times an fp16 value is exact in fp32."""
    for n, rows in ((19, 6), (40, 9), (8, 1), (21, 37)):  # 37 rows: scales widened per panel first
        w = _weight(qtype, n, 512, seed=n)[0]
        assert w.factored and w.scales.dtype == torch.int8
        x = torch.randn(rows, 512)
        torch.testing.assert_close(quant.quantized_linear(x, w), quant.quantized_linear(x, _plain(w)), rtol=0, atol=0)


def test_k_quants_are_held_near_their_file_size():
    """Repacked K-types take about their GGUF bytes (factored scales, Q5_K's fifth bits as a plane
    of bits, the super-block factors fp16 as the file has them; fp32 block scales made Q4_K 1.33x
    and Q6_K 1.52x the file, int8 values Q5_K 1.82x, fp32 factors Q4_K 1.056x)."""
    n, k = 64, 4096
    for qtype, most in (
        (GGMLQuantizationType.Q4_K, 1.03),
        (GGMLQuantizationType.Q5_K, 1.03),
        (GGMLQuantizationType.Q6_K, 1.31),
    ):
        raw = quant.random_gguf(qtype, n, k, 0.05, np.random.default_rng(0))
        packed = quant.pack(quant.from_gguf(raw, qtype, n, k))
        assert packed.nbytes <= most * raw.nbytes, f"{qtype.name}: {packed.nbytes / raw.nbytes:.3f}x the file"


def test_bad_factored_scales_are_refused():
    w = quant.pack(_weight(GGMLQuantizationType.Q4_K, 8, 256, seed=5)[0])
    x = torch.randn(2, 256)
    op = torch.ops.chunkgen.quant_linear.default
    with pytest.raises(ValueError, match="scale_d must be"):
        op(x, w.qs, w.scales, w.mins, w.kind, w.n, w.scale_d[..., :4].contiguous(), w.min_d)
    with pytest.raises(ValueError, match="min_d must be"):
        op(x, w.qs, w.scales, w.mins, w.kind, w.n, w.scale_d, None)
    with pytest.raises(ValueError, match="scale_d must be .* float16"):  # the file's fp16, not widened
        op(x, w.qs, w.scales, w.mins, w.kind, w.n, w.scale_d.float(), w.min_d.float())
    with pytest.raises(ValueError, match="scales must be .* float32"):
        op(x, w.qs, w.scales, w.mins, w.kind, w.n)  # int8 scales without their factors
    q5 = quant.pack(_weight(GGMLQuantizationType.Q5_K, 8, 256, seed=5)[0])
    with pytest.raises(ValueError, match="layout 3 needs mins"):
        op(x, q5.qs, q5.scales, None, q5.kind, q5.n, q5.scale_d)
    q8 = quant.pack(_weight(GGMLQuantizationType.Q8_0, 8, 256, seed=5)[0])
    with pytest.raises(ValueError, match="factored scales are for"):
        op(x, q8.qs, q8.scales.to(torch.int8), None, q8.kind, q8.n, w.scale_d)


def test_bad_shapes_are_refused():
    w, _ = _weight(GGMLQuantizationType.Q8_0, 8, 64, seed=5)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantized_linear(torch.randn(2, 48), w)
    with pytest.raises(ValueError, match="qs must hold"):
        quant.quantized_linear(torch.randn(2, 96), w)
    with pytest.raises(ValueError, match="not one chunkgen runs"):
        quant.from_gguf(np.zeros((1, 64), np.uint8), GGMLQuantizationType.Q2_K, 1, 256)


def _swap_linears(hf, source) -> int:
    """Every nn.Linear of a transformers model run on quantized weights from `source` (for
    perplexity through transformers' own forward); returns how many were swapped."""
    swapped = 0
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear):
            w = source(name, module)
            if w is None:
                continue
            linear = quant.QuantLinear([w], module.bias)
            module.forward = lambda x, f=linear: f(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
            swapped += 1
    return swapped


def _perplexity(hf, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        return float(torch.exp(hf(ids[None], labels=ids[None]).loss))


@pytest.mark.real_model
def test_default_gguf_weights_as_shipped(default_model_dir):
    """The default model's GGUF tensors, repacked (q/k rows back in transformers' order), equal
    the weights transformers dequantized from the same file; and perplexity on a shipped text on
    them (4-bit Q4_1 and the Q8_0 output layer, activations in int8) and on int8 made from the
    fp32 weights stays within +4% and +1% of the fp32 model's."""
    import json

    from transformers import AutoModelForCausalLM

    from chunkgen.model.loading import SOURCE_FILE, load_tokenizer
    from tests.helpers import PROMPTS

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    gguf_file = json.loads((default_model_dir / SOURCE_FILE).read_text())["gguf"]
    source = quant.GGUFSource(gguf_file, hf.config)
    modules = dict(hf.named_modules())
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.5.self_attn.k_proj", "model.layers.29.mlp.down_proj"):
        w = source(name, modules[name])
        assert w.source == "q4_1"
        torch.testing.assert_close(w.dequantize(), modules[name].weight, rtol=0, atol=0)
    assert source("lm_head", modules["lm_head"]).source == "q8_0"

    text = (PROMPTS / "document_qa.toml").read_text()
    ids = torch.tensor(load_tokenizer(default_model_dir)(text)["input_ids"][:256])
    base = _perplexity(hf, ids)
    assert _swap_linears(hf, source) == 30 * 7 + 1
    shipped = _perplexity(hf, ids)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    _swap_linears(hf, quant.int8_source)
    int8 = _perplexity(hf, ids)
    assert shipped <= base * 1.04, (base, shipped)
    assert int8 <= base * 1.01, (base, int8)


def test_model_on_int8_weights(tiny_model):
    """--quantize int8 on a float checkpoint: every product runs quantized, and the logits of a
    prompt stay close to the float model's (per-channel int8 weights, int8 activations)."""
    from chunkgen.config import Config
    from chunkgen.engine import SamplingParams
    from chunkgen.llm import LLM

    llm = LLM(str(tiny_model), quantize="int8", dtype="fp32", kv_memory="64MiB")
    assert llm.quantized.startswith("int8 (") and "float" not in llm.quantized
    ref = LLM(str(tiny_model), dtype="fp32", kv_memory="64MiB")
    assert ref.quantized == "none"
    a = llm.generate(["hello there"], SamplingParams(max_new_tokens=4))[0]
    b = ref.generate(["hello there"], SamplingParams(max_new_tokens=4))[0]
    assert len(a.token_ids) == len(b.token_ids) == 4
    x = torch.randn(3, llm.model.config.hidden_size)
    qkv, fqkv = llm.model.layers[0].qkv, ref.model.layers[0].qkv
    torch.testing.assert_close(qkv(x), fqkv(x), rtol=0.05, atol=0.05 * fqkv(x).abs().max().item())
    with pytest.raises(Exception, match="is for --dummy-weights"):
        Config.resolve(str(tiny_model), quantize="q4_k")
    with pytest.raises(Exception, match="must be auto, none or int8"):
        Config.resolve(str(tiny_model), quantize="int4")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(qtype, path):
    """Batch-invariant numerics (the default) hold on quantized weights: each row is quantized on
    its own and its block sums are added in one order at any row count and tile position."""
    w = quant.pack(_weight(qtype, 72, 512, seed=3)[0])
    x = torch.randn(300, 512)
    full = quant.quantized_linear(x, w)
    for rows in (slice(0, 1), slice(5, 6), slice(0, 37), slice(299, 300), slice(3, 260)):
        torch.testing.assert_close(quant.quantized_linear(x[rows], w), full[rows], rtol=0, atol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_channels_product_does_not_depend_on_its_tile(qtype, path):
    """The tiles' shapes (AVX512_VNNI: two pairs of groups for the 4- and 5-bit types, one pair for a
    layer's last, a lone group) do a channel's arithmetic alike: the channels of a weight's rows
    sliced out give the bits they had inside the whole weight, wherever the tiles cut it."""
    n, k = 72, 512
    raw = quant.random_gguf(qtype, n, k, 0.05, np.random.default_rng(5))
    row_bytes = raw.size // n
    x = torch.randn(13, k)
    full = quant.quantized_linear(x, quant.from_gguf(raw, qtype, n, k))
    for lo, hi in ((0, 16), (16, 48), (40, 72), (8, 24), (64, 72), (3, 12)):
        part = quant.from_gguf(raw.reshape(-1)[lo * row_bytes : hi * row_bytes], qtype, hi - lo, k)
        torch.testing.assert_close(quant.quantized_linear(x, part), full[:, lo:hi], rtol=0, atol=0)
