"""The decode forward's elementwise work as fused ops (torch.ops.chunkgen; native CPU and CUDA
implementations, fake ones for tracing): residual add + RMSNorm (Llama's or Gemma's 1 + weight),
per-head q/k RMSNorm + rotary embedding in place on the qkv product, SiLU(gate) * up and
tanh-GELU(gate) * up (Gemma's GeGLU). Each writes into buffers it is given and returns nothing, so a
step allocates its buffers once and every layer reuses them.

They round as the torch composition they replace does (fp32 math, each stored intermediate rounded
to the model's dtype), so a bf16 model gives the same tokens; tests/kernels/test_elementwise.py checks it bit
for bit against those compositions."""

from __future__ import annotations

from typing import NamedTuple

import torch

from chunkgen._native import native


def _register_fake() -> None:
    try:
        native()  # loading the extension defines the ops (TORCH_LIBRARY in csrc/bindings.cpp)
    except ImportError:
        return  # not built: the first call says how to fix it

    @torch.library.register_fake("chunkgen::add_rms_norm")
    def _(residual, delta, weight, eps, out, offset=False) -> None:
        return None

    @torch.library.register_fake("chunkgen::rotary")
    def _(
        qkv,
        positions,
        cos,
        sin,
        q_heads,
        kv_heads,
        q_out,
        q_norm=None,
        k_norm=None,
        eps=0.0,
        offset_norm=False,
        k_cache=None,
        v_cache=None,
        layer=0,
        write_slot=None,
        write_offset=None,
    ) -> None:
        return None

    @torch.library.register_fake("chunkgen::silu_mul")
    def _(gate_up, out) -> None:
        return None

    @torch.library.register_fake("chunkgen::gelu_tanh_mul")
    def _(gate_up, out) -> None:
        return None


_register_fake()


def add_rms_norm(
    residual: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    offset: bool = False,
) -> None:
    """residual += delta (when given), then out = RMSNorm(residual) * weight, as
    `weight * F.rms_norm(residual, None, eps)` rounds in 16-bit (and `F.rms_norm(residual, weight)`
    in fp32); offset: times (1 + weight) in fp32, rounded once (Gemma's norms). residual, delta,
    out: [rows, hidden] with contiguous rows."""
    torch.ops.chunkgen.add_rms_norm.default(residual, delta, weight, eps, out, offset)


class KVWrite(NamedTuple):
    """Where rotary stores a step's K/V: the whole pool, a layer of it, and one (slot, offset) a
    row (int32, on the pool's device) for the first `len(write_slot)` rows."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    layer: int
    write_slot: torch.Tensor
    write_offset: torch.Tensor


def rotary(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    q_out: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    offset_norm: bool = False,
    write: KVWrite | None = None,
) -> None:
    """Rotate the q and k heads of each row of qkv `[rows, (q_heads + 2 kv_heads) * d]` by its
    position: k in place, q into q_out `[rows, q_heads, d]` (any float dtype). cos, sin: the tables of
    every position, `[positions, ..., d]` in qkv's dtype; positions int32 or int64. With q_norm and
    k_norm `[d]` (Qwen3, Gemma 3) each head is RMS-normed first, rounded as add_rms_norm rounds.
    With `write`, its rows also store their rotated k and their v in the pool, as the decode op
    stores a step's K/V: on a GPU, the step's K/V write without a kernel of its own."""
    k_cache, v_cache, layer, write_slot, write_offset = write if write is not None else (None, None, 0, None, None)
    torch.ops.chunkgen.rotary.default(
        qkv,
        positions,
        cos,
        sin,
        q_heads,
        kv_heads,
        q_out,
        q_norm,
        k_norm,
        eps,
        offset_norm,
        k_cache,
        v_cache,
        layer,
        write_slot,
        write_offset,
    )


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """out `[rows, n]` = SiLU(gate) * up for gate_up `[rows, 2n]` = [gate | up]."""
    torch.ops.chunkgen.silu_mul.default(gate_up, out)


def gelu_tanh_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """out `[rows, n]` = GELU_tanh(gate) * up for gate_up `[rows, 2n]` = [gate | up] (transformers'
    gelu_pytorch_tanh, each product rounded as the torch composition rounds it)."""
    torch.ops.chunkgen.gelu_tanh_mul.default(gate_up, out)
