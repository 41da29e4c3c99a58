"""Quantized weights kept as shipped: GGUF blocks repacked once, at load, into the layouts the CPU
kernel (csrc/cpu/quant_linear.cpp) streams, and per-output-channel int8 made from float weights.

Every type becomes blocks of 32 values along k with block scales (and mins where the type has
them), the values kept at their own width: 4-bit types (Q4_0, Q4_1, Q4_K) as nibbles, Q5_K as
nibbles and a plane of fifth bits, wider ones (Q6_K, Q8_0, int8) as int8 (QuantWeight, row by
row). The scales are fp32, or for the K-types factored as the file has them: an int8 per block (or
half) under an fp16 per super-block of 256 values (the same fp32 products, exactly, at a quarter
of the bytes). A product packs them once more, 8 output channels interleaved (PackedWeight, what
the kernel streams). Nothing is expanded to floats, except by `dequantize` where a caller needs
floats (the GPU, which runs bf16, and the embedding rows a batch looks up).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

U4, S8, S8_HALF, U5 = 0, 1, 2, 3  # the kernel's layouts (csrc/cpu/quant_layout.h)
PAIRED = (S8, S8_HALF)  # layouts whose groups go in pairs, units interleaved (csrc/cpu/quant_layout.h)
BLOCK = 32
GROUP = 8  # output channels the packed layout interleaves
UNIT = 32  # bytes of a packed unit: 8 channels x 4 values (csrc/cpu/quant_layout.h)
QK_K = 256
SUPER = QK_K // BLOCK  # blocks under one factored super-block scale

# The GGUF types the kernel runs as shipped, by the names --quantize and the load line use.
GGUF_TYPES = {
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
    "q4_k": GGMLQuantizationType.Q4_K,
    "q5_k": GGMLQuantizationType.Q5_K,
    "q6_k": GGMLQuantizationType.Q6_K,
}
TYPE_NAMES = {v: k for k, v in GGUF_TYPES.items()}


@dataclass
class _Blocks:
    """Block-quantized W [n, k]: its bytes, block scales and mins (the subclasses say in which layout)."""

    kind: int
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    n: int
    k: int
    source: str  # what it was made from: a GGUF type name ("q4_1") or "int8"
    scale_d: torch.Tensor | None = None  # factored scales' super-block factors
    min_d: torch.Tensor | None = None  # factored mins' super-block factors

    @property
    def nbytes(self) -> int:
        parts = (self.qs, self.scales, self.mins, self.scale_d, self.min_d)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    @property
    def factored(self) -> bool:
        return self.scale_d is not None


@dataclass
class QuantWeight(_Blocks):
    """W [n, k] row by row: qs bytes ([n, k/2] nibbles for U4; for U5 20 bytes a block, its 16 of
    nibbles and a 32-bit word of fifth bits, bit j for value j; else [n, k] int8), scales [n, k/32]
    ([n, k/16] for S8_HALF) and mins [n, k/32] or None, all contiguous. Scales and mins are fp32,
    or factored: int8, times scale_d (min_d) [n, k/256] fp16 (the file's own) for the 8 blocks of a
    super-block.
    `pack` makes the layout the kernel reads."""

    def block_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fp32 scales [n, k/32 or k/16] and mins [n, k/32] (or None) of every block."""
        return _unfactor(self.scales, self.scale_d, self.n), (
            None if self.mins is None else _unfactor(self.mins, self.min_d, self.n)
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W as floats (fp32 arithmetic, then `dtype`): for the GPU and for tests."""
        scales, mins = self.block_scales()
        q = _values(self).float().view(self.n, -1, 16 if self.kind == S8_HALF else BLOCK)
        w = q * scales.view(self.n, -1, 1)
        if mins is not None:
            w = w.view(self.n, -1, BLOCK) + mins.view(self.n, -1, 1)
        return w.reshape(self.n, self.k).to(dtype)

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The rows `index` of W (an embedding lookup's rows, a permutation of output channels)."""
        pick = lambda t: None if t is None else t.index_select(0, index).contiguous()  # noqa: E731
        return QuantWeight(
            self.kind,
            pick(self.qs),
            pick(self.scales),
            pick(self.mins),
            len(index),
            self.k,
            self.source,
            pick(self.scale_d),
            pick(self.min_d),
        )


def _unfactor(values: torch.Tensor, d: torch.Tensor | None, n: int) -> torch.Tensor:
    """fp32 block values [n, blocks] from plain (fp32) or factored (int8 under d [n, k/256]) ones:
    the products the kernel makes, exact in fp32 (int8 times an fp16 value)."""
    if d is None:
        return values
    per_super = values.shape[-1] // d.shape[-1]
    return (values.view(n, -1, per_super).float() * d.view(n, -1, 1).float()).view(n, -1)


def _values(w: QuantWeight) -> torch.Tensor:
    """The integer values of W [n, k] (int16: nibbles (and fifth bits) unsigned, bytes signed)."""
    if w.kind in (U4, U5):
        b = w.qs.view(w.n, -1, 16 if w.kind == U4 else 20)
        values = torch.cat([b[..., :16] & 0x0F, b[..., :16] >> 4], dim=-1).to(torch.int16)
        if w.kind == U5:
            values += torch.from_numpy(_unpack_bits(b[..., 16:].numpy())).to(torch.int16) << 4
        return values.reshape(w.n, w.k)
    return w.qs.view(torch.int8).to(torch.int16)


def _pack_bits(bits: np.ndarray) -> np.ndarray:
    """Bits [..., 8 m] (0 or 1) -> [..., m] bytes, little-endian: bit j of the run from element j
    (32 bits: a little-endian 32-bit word)."""
    return np.packbits(bits.astype(np.uint8), axis=-1, bitorder="little")


def _unpack_bits(words: np.ndarray) -> np.ndarray:
    """_pack_bits undone: [..., m] bytes -> [..., 8 m] bits."""
    return np.unpackbits(np.ascontiguousarray(words), axis=-1, bitorder="little")


@dataclass
class PackedWeight(_Blocks):
    """W [n, k] as the kernel streams it (csrc/cpu/quant_linear.cpp): channels in groups of 8
    (the last padded with zero rows), each group's blocks of 32 values along k with its 8 channels'
    values interleaved 4 at a time, in units of 32 bytes: qs [groups, k/32, units * 32], or for the
    signed kinds (PAIRED) [pairs, k/32, units, 2, 32], the groups in pairs (the last padded with a
    zero group), a block's units of the two side by side; scales
    [groups, k/32, halves, 8], mins [groups, k/32, 8]. Factored
    ones put the groups in pairs, 16 channels side by side (csrc/cpu/quant_layout.h): scales
    [pairs, k/32, halves, 16], mins [pairs, k/32, 16], scale_d and min_d [pairs, k/256, 16]."""


def pack(w: QuantWeight) -> PackedWeight:
    """W's bytes, scales and mins interleaved by groups of 8 channels (a copy; W can be dropped)."""
    groups, nb = -(-w.n // GROUP), w.k // BLOCK
    pad = groups * GROUP - w.n

    def grouped(t: torch.Tensor, inner: int, blocks: int = nb) -> torch.Tensor:
        """t [n, blocks * inner] -> [groups, blocks, ..., 8 channels, ...] as the kernel reads it."""
        t = t.reshape(w.n, blocks, inner)
        if pad:
            t = torch.cat([t, t.new_zeros(pad, blocks, inner)])
        return t.view(groups, GROUP, blocks, inner)

    if w.kind == U4:  # 16 bytes a block: chunk c, byte t of a channel = the block's byte 4 c + t
        qs = grouped(w.qs, 16).view(groups, GROUP, nb, 4, 4).permute(0, 2, 3, 1, 4)
    elif w.kind == U5:  # U4's 128 bytes, then the plane of fifth bits (csrc/cpu/quant_linear.cpp)
        rows = grouped(w.qs, 20)
        nibbles = rows[..., :16].reshape(groups, GROUP, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, 128)
        # value j = 16 h + 4 c + t of channel r -> byte 4 r + t, bit 2 c + h
        bits = _unpack_bits(rows[..., 16:].numpy()).reshape(groups, GROUP, nb, 2, 4, 4).transpose(0, 2, 1, 5, 4, 3)
        plane = _pack_bits(bits.reshape(groups, nb, 32, 8))
        qs = torch.cat([nibbles, torch.from_numpy(plane.reshape(groups, nb, 32))], dim=-1)
    else:  # 32 values a block: step s, byte t of a channel = value 4 s + t
        qs = grouped(w.qs, 32).view(groups, GROUP, nb, 8, 4).permute(0, 2, 3, 1, 4)
    qs = qs.reshape(groups, nb, -1)
    if w.kind in PAIRED:
        qs = _pair_units(qs)

    def lanes(t: torch.Tensor | None, inner: int, blocks: int = nb) -> torch.Tensor | None:
        """t's values [groups, blocks, inner, 8 channels]; factored, a pair of groups' 16 side by side."""
        if t is None:
            return None
        t = grouped(t, inner, blocks).permute(0, 2, 3, 1)
        if not w.factored:
            return t.contiguous()
        if groups % 2:
            t = torch.cat([t, t.new_zeros(1, *t.shape[1:])])
        return (
            t.reshape(-1, 2, blocks, inner, GROUP)
            .permute(0, 2, 3, 1, 4)
            .reshape(-1, blocks, inner, 2 * GROUP)
            .contiguous()
        )

    scales = lanes(w.scales, 2 if w.kind == S8_HALF else 1)
    d_blocks = nb // SUPER
    return PackedWeight(
        w.kind,
        qs.contiguous(),
        scales.contiguous(),
        lanes(w.mins, 1),
        w.n,
        w.k,
        w.source,
        lanes(w.scale_d, 1, d_blocks),
        lanes(w.min_d, 1, d_blocks),
    )


def _pair_units(qs: torch.Tensor) -> torch.Tensor:
    """Groups' blocks [groups, nb, units * 32] -> [pairs, nb, units, 2, 32]: the groups in pairs
    (the last padded with a zero group), each block's 32-byte units of the two side by side, so one
    64-byte load reads a unit of 16 channels (csrc/cpu/quant_layout.h: the signed kinds, PAIRED)."""
    groups, nb, size = qs.shape
    if groups % 2:
        qs = torch.cat([qs, qs.new_zeros(1, nb, size)])
    return qs.reshape(-1, 2, nb, size // UNIT, UNIT).permute(0, 2, 3, 1, 4)


def _channel_units(w: PackedWeight, g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Channel c of group g, for each (g, c): its 4 bytes of every unit [rows, nb, units, 4], read
    from the packed bytes in place (no group's other channels copied)."""
    if w.kind in PAIRED:
        pairs, nb, units = w.qs.shape[:3]
        return w.qs.view(pairs, nb, units, 2, GROUP, 4)[g // 2, :, :, g % 2, c, :]
    groups, nb = w.qs.shape[:2]
    return w.qs.view(groups, nb, -1, GROUP, 4)[g, :, :, c, :]


def packed_rows(w: PackedWeight, index: torch.Tensor) -> QuantWeight:
    """The rows (output channels) `index` of a packed W in row layout: `pack` undone for those rows
    only (an embedding lookup from the output layer's weight it is tied to)."""
    g, c = index // GROUP, index % GROUP
    units = _channel_units(w, g, c)
    rows, nb = units.shape[:2]
    if w.kind == U5:  # 4 units of nibbles, then the plane of fifth bits
        nibbles = units[:, :, :4].reshape(rows, nb, 16)
        bits = _unpack_bits(units[:, :, 4].numpy()[..., None]).reshape(rows, nb, 4, 4, 2)  # [rows, nb, t, c, h]
        words = _pack_bits(bits.transpose(0, 1, 4, 3, 2).reshape(rows, nb, 32))  # value 16 h + 4 c + t
        qs = torch.cat([nibbles, torch.from_numpy(words)], dim=-1).reshape(rows, -1)
    else:  # [rows, nb, 4 or 8 units, 4]: a row's bytes in order
        qs = units.reshape(rows, -1)
    at, lane = (g // 2, g % 2 * GROUP + c) if w.factored else (g, c)  # factored: groups in pairs
    scales = w.scales[at, :, :, lane].reshape(len(index), -1)
    pick = lambda t: None if t is None else t[at, :, 0, lane].reshape(len(index), -1)  # noqa: E731
    return QuantWeight(w.kind, qs, scales, pick(w.mins), len(index), w.k, w.source, pick(w.scale_d), pick(w.min_d))


class QuantEmbedding:
    """Token embedding rows looked up in a quantized weight and dequantized to `dtype` (what
    transformers' embedding holds for a GGUF: the same fp32 products, rounded once): the row
    layout, or the packed weight of the output layer it is tied to (no second copy)."""

    def __init__(self, weight: QuantWeight | PackedWeight, dtype: torch.dtype) -> None:
        self.weight, self.dtype = weight, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        w = self.weight
        rows = packed_rows(w, flat) if isinstance(w, PackedWeight) else w.rows(flat)
        return rows.dequantize(self.dtype).view(*ids.shape, w.k)


def quantized_linear(x: torch.Tensor, w: QuantWeight | PackedWeight) -> torch.Tensor:
    """x [rows, k] times W^T, x quantized per row to int8 blocks of 32 -> [rows, n] in x's dtype."""
    if isinstance(w, QuantWeight):
        w = pack(w)
    return torch.ops.chunkgen.quant_linear.default(x, w.qs, w.scales, w.mins, w.kind, w.n, w.scale_d, w.min_d)


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)


def _f16(b: np.ndarray) -> np.ndarray:
    return _half(b).astype(np.float32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 6-bit sub-block scales and mins (8 of each in 12 bytes)."""
    from gguf.quants import Q4_K

    return Q4_K.get_scale_min(scales)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Values 0..15 [..., 32] -> 16 bytes a block: value j low, value j + 16 high."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def from_gguf(raw: np.ndarray, qtype: GGMLQuantizationType | int, n: int, k: int) -> QuantWeight:
    """A GGUF tensor's bytes (W [n, k] in ggml's row order, n rows of k values) repacked."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in TYPE_NAMES:
        raise ValueError(f"GGUF type {qtype.name} is not one chunkgen runs quantized ({', '.join(GGUF_TYPES)})")
    block, size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise ValueError(f"a {qtype.name} row of {k} values is not whole blocks of {block}")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * (k // block), size)
    mins = scale_d = min_d = None  # factored: scales (and mins) int8 under these
    if qtype == GGMLQuantizationType.Q8_0:
        kind, qs, scales = S8, b[:, 2:], _f16(b[:, :2])
    elif qtype == GGMLQuantizationType.Q4_0:
        d = _f16(b[:, :2])
        kind, qs, scales, mins = U4, b[:, 2:], d, -8.0 * d
    elif qtype == GGMLQuantizationType.Q4_1:
        kind, qs, scales, mins = U4, b[:, 4:], _f16(b[:, :2]), _f16(b[:, 2:4])
    elif qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        d, dmin = _half(b[:, :2]), _half(b[:, 2:4])
        sc, m = _k_scale_min(b[:, 4:16])
        scales, scale_d, mins, min_d = sc.astype(np.int8), d, -m.astype(np.int8), dmin
        if qtype == GGMLQuantizationType.Q4_K:
            # 32 bytes per 64 values: the low nibbles are the first 32, the high ones the next
            ql = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
            kind, qs = U4, _nibbles((ql & 0x0F).reshape(-1, 8, 32))
        else:  # Q5_K: the same nibbles, and bit i of qh's byte j is value j of sub-block i's fifth bit
            qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            ql = b[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
            kind = U5
            qs = np.concatenate([_nibbles((ql & 0x0F).reshape(-1, 8, 32)), _pack_bits(qh & 1)], axis=-1)
    else:  # Q6_K: 16 sub-blocks of 16, signed 6-bit values
        ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        q = (ql & 0x0F).reshape(-1, 2, 4, 32) | ((qh & 3) << 4).reshape(-1, 2, 4, 32)
        kind, qs = S8_HALF, (q.astype(np.int16) - 32).astype(np.int8)
        scales, scale_d = b[:, 192:208].view(np.int8), _half(b[:, 208:210])
    values = np.int8 if scale_d is not None else np.float32
    tensor = lambda a, dtype: None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype).reshape(n, -1))  # noqa: E731
    qs = torch.from_numpy(np.ascontiguousarray(qs).view(np.uint8).reshape(n, -1))
    return QuantWeight(
        kind,
        qs,
        tensor(scales, values),
        tensor(mins, values),
        n,
        k,
        TYPE_NAMES[qtype],
        tensor(scale_d, np.float16),
        tensor(min_d, np.float16),
    )


def int8_per_channel(w: torch.Tensor) -> QuantWeight:
    """Symmetric int8 per output channel (vLLM-CPU's and SGLang's W8A8 weights), refined to one
    scale per channel and block of 32 (Q8_0's grid, fp32 scales): q = round(w / s), s = max|block|
    / 127. The same kernel and bytes as one scale a channel, and a finer grid: one scale a whole
    channel lost +1.3% perplexity on the default model, over the +1% this mode is held to."""
    return int8_rows(lambda start, stop: w[start:stop], *w.shape)


def int8_rows(rows: Callable[[int, int], torch.Tensor], n: int, k: int) -> QuantWeight:
    """int8_per_channel of W [n, k] given as `rows(start, stop)`, W's rows start:stop (a slice of
    a tensor, or read from a mapped file): converted 1 MiB of fp32 rows at a time, so neither W
    nor an fp32 copy of it is ever held whole, and the temporaries stay small."""
    if k % BLOCK:
        raise ValueError(f"int8 weights need k a multiple of {BLOCK}, got {k}")
    qs = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // BLOCK, dtype=torch.float32)
    step = max(1, (1 << 18) // k)
    for i in range(0, n, step):
        part = rows(i, min(n, i + step)).float().view(-1, k // BLOCK, BLOCK)
        s = part.abs().amax(dim=-1) / 127.0
        scales[i : i + step] = s
        qs[i : i + step] = torch.round(part / torch.where(s > 0, s, 1.0)[..., None]).to(torch.int8).view(-1, k)
    return QuantWeight(S8, qs.view(torch.uint8), scales, None, n, k, "int8")


def random_gguf(qtype: GGMLQuantizationType | int, n: int, k: int, scale: float, generator: np.random.Generator):
    """Bytes of a GGUF tensor [n, k] of `qtype` with random values whose dequantized weights are of
    order `scale`: every bit pattern of the values and sub-block scales, the fp16 super-block
    scales set (random bytes there could be inf or NaN). For tests and --dummy-weights."""
    qtype = GGMLQuantizationType(qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    b = generator.integers(0, 256, size=(n * (k // block), size), dtype=np.uint8)
    count = len(b)

    def f16(lo: float, hi: float) -> np.ndarray:
        return generator.uniform(lo, hi, size=(count, 1)).astype(np.float16).view(np.uint8)

    if qtype == GGMLQuantizationType.Q8_0:
        b[:, :2] = f16(scale / 127, 2 * scale / 127)
    elif qtype == GGMLQuantizationType.Q4_0:
        b[:, :2] = f16(scale / 8, 2 * scale / 8)
    elif qtype == GGMLQuantizationType.Q4_1:
        b[:, :2] = f16(scale / 8, 2 * scale / 8)
        b[:, 2:4] = f16(-scale, 0)
    elif qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        levels = 15 if qtype == GGMLQuantizationType.Q4_K else 31
        b[:, :2] = f16(scale / (63 * levels), 2 * scale / (63 * levels))
        b[:, 2:4] = f16(scale / 63, 2 * scale / 63)
    else:
        b[:, 208:210] = f16(scale / (127 * 32), 2 * scale / (127 * 32))
    return b.reshape(n, -1)


class QuantLinear:
    """y = x W^T + b on quantized weights: the fused parts of one product (q/k/v, gate/up) in one
    weight where they share a layout, else one product each, concatenated."""

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None) -> None:
        groups: list[list[QuantWeight]] = []
        for part in parts:
            if groups and _layout(groups[-1][0]) == _layout(part):
                groups[-1].append(part)
            else:
                groups.append([part])
        self.weights = [pack(_concat(g)) for g in groups]
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features = sum(w.n for w in self.weights)
        self.source = "+".join(sorted({p.source for p in parts}))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ys = [quantized_linear(x, w) for w in self.weights]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y if self.bias is None else (y.float() + self.bias).to(y.dtype)


def _layout(w: QuantWeight) -> tuple[int, bool, bool]:
    """What weights must share to be one product: the kernel's layout, mins, factored scales."""
    return w.kind, w.mins is not None, w.factored


def _concat(parts: list[QuantWeight]) -> QuantWeight:
    if len(parts) == 1:
        return parts[0]
    cat = lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    n = sum(p.n for p in parts)
    first = parts[0]
    return QuantWeight(
        first.kind, cat("qs"), cat("scales"), cat("mins"), n, first.k, first.source, cat("scale_d"), cat("min_d")
    )


# A source of quantized weights: (the module's name in the transformers model, the module) -> its
# weight quantized, or None to keep that product in floats.
def quantized_linears(hf_model, source, float_linear):
    """A LinearFactory for LlamaModel: each product's modules from `source`, in floats (float_linear)
    where the source has no quantized weight for one of them. Counts what it made in .made; its
    .embedding(module, lm_head) gives the token embedding quantized where the source has it."""
    names = {id(m): name for name, m in hf_model.named_modules()}

    def make(modules: list):
        parts = [source(names.get(id(m), ""), m) for m in modules]
        if any(p is None for p in parts):
            make.made["float"] = make.made.get("float", 0) + 1
            return float_linear(modules)
        biases = [m.bias for m in modules]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [b if b is not None else torch.zeros(m.out_features) for b, m in zip(biases, modules)]
            ).float()
        linear = QuantLinear(parts, bias)
        make.made[linear.source] = make.made.get(linear.source, 0) + 1
        make.bytes += sum(w.nbytes for w in linear.weights)
        return linear

    def embedding(module, lm_head) -> QuantEmbedding | None:
        """The embedding quantized where its float weight was never made (a direct load)."""
        if module.weight.device.type != "meta":
            return None
        if getattr(source, "tied", False) and isinstance(lm_head, QuantLinear) and len(lm_head.weights) == 1:
            return QuantEmbedding(lm_head.weights[0], module.weight.dtype)
        weight = source.embedding()
        make.bytes += weight.nbytes
        return QuantEmbedding(weight, module.weight.dtype)

    make.made, make.bytes, make.embedding = {}, 0, embedding
    return make


def int8_source(name: str, module) -> QuantWeight | None:
    """int8 of a float model's loaded weight (a checkpoint without safetensors files, whose
    weights cannot be read a tensor at a time)."""
    return int8_per_channel(module.weight.detach()) if module.weight.shape[1] % BLOCK == 0 else None


class RandomSource:
    """Random weights of a GGUF type or int8 (--dummy-weights with --quantize q4_k, int8, ...),
    of the order of an initialised model's weights, one product at a time: a GGUF type drawn
    directly as blocks, int8 drawn in floats a slice of rows at a time and quantized at once."""

    tied = False

    def __init__(self, qtype_name: str, seed: int) -> None:
        self.qtype = None if qtype_name == "int8" else GGUF_TYPES[qtype_name]
        self.block = BLOCK if self.qtype is None else GGML_QUANT_SIZES[self.qtype][0]
        self.rng = np.random.default_rng(seed)

    def has(self, name: str, module) -> bool:
        return module.weight.shape[1] % self.block == 0

    def __call__(self, name: str, module) -> QuantWeight | None:
        if not self.has(name, module):
            return None
        n, k = module.weight.shape
        if self.qtype is None:
            generator = torch.Generator().manual_seed(int(self.rng.integers(1 << 62)))
            return int8_rows(lambda start, stop: torch.randn(stop - start, k, generator=generator) * 0.02, n, k)
        return from_gguf(random_gguf(self.qtype, n, k, 0.02, self.rng), self.qtype, n, k)

    def embedding(self) -> None:
        return None  # drawn in floats by the load (transformers' initialisation)


class Int8Source:
    """--quantize int8 of a checkpoint's float weights, never a float model: each linear weight
    read alone (from a folder's safetensors, a slice of rows at a time through the mapping; from a
    GGUF, its one tensor dequantized) and made per-channel int8 at once. `float_tensors(model)`
    binds it to the model's module tree and gives the load (model/skeleton.py) the same tensors
    for everything else; an output layer tied to the embedding is quantized from the embedding's
    tensor, which stays in floats for the lookup."""

    tied = False

    def __init__(self, tensors_of: Callable) -> None:
        self._tensors_of = tensors_of  # model -> tensors.FolderTensors or tensors.GGUFTensors
        self.tensors = None
        self.names: dict[str, str] = {}  # module name -> the tensor its weight is read from

    def float_tensors(self, model):
        self.tensors = self._tensors_of(model)
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        names = {id(m): name for name, m in model.named_modules()}
        tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
        if tied and head is not None and f"{names[id(head)]}.weight" not in self.tensors:
            self.names[names[id(head)]] = f"{names[id(embed)]}.weight"
        return self.tensors

    def _name(self, name: str) -> str:
        return self.names.get(name, f"{name}.weight")

    def has(self, name: str, module) -> bool:
        return self.tensors is not None and module.weight.shape[1] % BLOCK == 0 and self._name(name) in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors.shape(self._name(name))

    def __call__(self, name: str, module) -> QuantWeight | None:
        if not self.has(name, module):
            return None
        tensor = self._name(name)
        n, k = self.tensors.shape(tensor)
        return int8_rows(lambda start, stop: self.tensors.rows(tensor, start, stop), n, k)

    def embedding(self) -> None:
        return None  # read in floats by the load


class GGUFSource:
    """The linear weights of a GGUF file, as shipped, by the transformers module name they were
    converted to: q and k rows put back in the order transformers uses (llama.cpp's converter
    interleaves each head's rotary halves for the llama architecture). Its other tensors, in
    floats, through `float_tensors` (tensors.GGUFTensors)."""

    def __init__(self, path, config) -> None:
        import gguf

        from chunkgen.model.gguf_file import GGUFError, GGUFFile

        file = GGUFFile(path)  # maps the file: tensors are read when repacked
        self.file = file
        self.arch = file.field("general.architecture")
        arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.arch), None)
        if arch is None:
            raise GGUFError(f"{path}: architecture {self.arch!r} is not one the gguf package names")
        self.names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
        self.tensors = file.tensors
        self.config = config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        # the output layer is the token embedding (no output tensor of its own)
        self.tied = "output.weight" not in self.tensors and "token_embd.weight" in self.tensors

    def float_tensors(self, model):
        """The file's tensors in floats, by their names in `model` (the load's module tree)."""
        from chunkgen.model.tensors import GGUFTensors

        return GGUFTensors(self.tensors, self.arch, self.names, self.config, model)

    def _tensor(self, name: str):
        base = name[len("model.") :] if name.startswith("model.") else name
        key = self.names.get_name(f"model.{base}") or self.names.get_name(name)
        tensor = self.tensors.get(f"{key}.weight") if key else None
        if tensor is None and name == "lm_head":  # tied: the token embedding serves as the output
            tensor = self.tensors.get("token_embd.weight")
        if tensor is None or tensor.tensor_type not in TYPE_NAMES:
            return None
        return tensor

    def has(self, name: str, module) -> bool:
        return self._tensor(name) is not None

    def shape(self, name: str) -> tuple[int, ...]:
        """(n, k) of the tensor the product `name` is made from."""
        k, n = (int(d) for d in self._tensor(name).shape[:2])
        return n, k

    def __call__(self, name: str, module) -> QuantWeight | None:
        tensor = self._tensor(name)
        if tensor is None:
            return None
        n, k = self.shape(name)
        w = from_gguf(tensor.data, tensor.tensor_type, n, k)
        self.file.release(tensor)  # copied: its mapped pages no longer count in the process's memory
        if self.arch == "llama" and name.endswith(("q_proj", "k_proj")):
            heads = self.heads if name.endswith("q_proj") else self.kv_heads
            order = np.arange(n).reshape(heads, 2, n // heads // 2).swapaxes(1, 2).reshape(n)
            w = w.rows(torch.from_numpy(np.argsort(order)))
        return w

    def has_embedding(self) -> bool:
        tensor = self.tensors.get("token_embd.weight")
        return tensor is not None and tensor.tensor_type in TYPE_NAMES

    def embedding(self) -> QuantWeight | None:
        """The token embedding as shipped (row layout: rows are looked up, not multiplied)."""
        if not self.has_embedding():
            return None
        tensor = self.tensors["token_embd.weight"]
        k, n = (int(d) for d in tensor.shape[:2])
        w = from_gguf(tensor.data, tensor.tensor_type, n, k)
        self.file.release(tensor)
        return w


def weight_source(quantize: str, device: str, model_path, config, seed: int = 0):
    """Where `--quantize` takes this model's linear weights from, or None for float weights: auto
    runs a GGUF file's own types (the cache folder of a GGUF names its file, loading.gguf_of),
    int8 makes per-channel int8 weights from the file's float (or dequantized) tensors, a GGUF
    type name or int8 without a model (--dummy-weights) draws random weights of it. CPU only: on
    a GPU a GGUF's weights run dequantized to floats. Every source but int8_source needs no float
    model (`is_direct`: model/skeleton.py builds the rest)."""
    from chunkgen.model.loading import gguf_of
    from chunkgen.model.tensors import FolderTensors

    if needs_float_weights(quantize, device):
        return None
    if quantize in GGUF_TYPES or (quantize == "int8" and model_path is None):
        return RandomSource(quantize, seed)
    gguf_file = None if model_path is None else gguf_of(Path(model_path))
    if quantize == "int8":
        if gguf_file is not None:
            return Int8Source(GGUFSource(gguf_file, config).float_tensors)
        if next(Path(model_path).glob("*.safetensors"), None) is not None:
            return Int8Source(lambda model: FolderTensors(Path(model_path)))
        return int8_source  # pickled weights: the float model is loaded, then quantized
    return None if gguf_file is None else GGUFSource(gguf_file, config)


def needs_float_weights(quantize: str, device: str) -> bool:
    """Whether a load of a GGUF takes its float copy (loading.float_weights): where weight_source
    gives no source, the GGUF runs dequantized to floats."""
    return quantize == "none" or not str(device).startswith("cpu")


def is_direct(source) -> bool:
    """Whether the source makes its products without a float model (a GGUF's own blocks, random
    blocks, int8 read from the file tensor by tensor): model/skeleton.py builds the rest."""
    return isinstance(source, (GGUFSource, RandomSource, Int8Source))


def describe(make) -> str:
    """What runs quantized, for the load line: 'q4_1 (210 products), q8_0 (1), float (0); 62.1 MiB'."""
    if make is None:
        return "none"
    parts = ", ".join(f"{name} ({count})" for name, count in sorted(make.made.items()))
    return f"{parts}; {make.bytes / (1 << 20):.1f} MiB quantized"
