"""The decode forward's elementwise work as fused ops (torch.ops.chunkgen; native CPU and CUDA
implementations, fake ones for tracing): residual add + RMSNorm, rotary embedding in place on the
qkv product, SiLU(gate) * up and tanh-GELU(gate) * up (Gemma's GeGLU). Each writes into buffers it is given and returns nothing, so a step
allocates its buffers once and every layer reuses them.

They round as the torch composition they replace does (fp32 math, each stored intermediate rounded
to the model's dtype), so a bf16 model gives the same tokens; tests/test_elementwise.py checks it bit
for bit against those compositions."""
from __future__ import annotations

import torch

from chunkgen._native import native


def _register_fake() -> None:
    try:
        native()  # loading the extension defines the ops (TORCH_LIBRARY in csrc/bindings.cpp)
    except ImportError:
        return  # not built: the first call says how to fix it

    @torch.library.register_fake("chunkgen::add_rms_norm")
    def _(residual, delta, weight, eps, out) -> None:
        return None

    @torch.library.register_fake("chunkgen::rotary")
    def _(qkv, positions, cos, sin, q_heads, kv_heads, q_out) -> None:
        return None

    @torch.library.register_fake("chunkgen::silu_mul")
    def _(gate_up, out) -> None:
        return None

    @torch.library.register_fake("chunkgen::gelu_tanh_mul")
    def _(gate_up, out) -> None:
        return None


_register_fake()


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor) -> None:
    """residual += delta (when given), then out = RMSNorm(residual) * weight, as
    `weight * F.rms_norm(residual, None, eps)` rounds in 16-bit (and `F.rms_norm(residual, weight)`
    in fp32). residual, delta, out: [rows, hidden] with contiguous rows."""
    torch.ops.chunkgen.add_rms_norm.default(residual, delta, weight, eps, out)


def rotary(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int,
           kv_heads: int, q_out: torch.Tensor) -> None:
    """Rotate the q and k heads of each row of qkv `[rows, (q_heads + 2 kv_heads) * d]` by its
    position: k in place, q into q_out `[rows, q_heads, d]` (any float dtype). cos, sin: the tables of
    every position, `[positions, ..., d]` in qkv's dtype; positions int32 or int64."""
    torch.ops.chunkgen.rotary.default(qkv, positions, cos, sin, q_heads, kv_heads, q_out)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """out `[rows, n]` = SiLU(gate) * up for gate_up `[rows, 2n]` = [gate | up]."""
    torch.ops.chunkgen.silu_mul.default(gate_up, out)


def gelu_tanh_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """out `[rows, n]` = GELU_tanh(gate) * up for gate_up `[rows, 2n]` = [gate | up] (transformers'
    gelu_pytorch_tanh, each product rounded as the torch composition rounds it)."""
    torch.ops.chunkgen.gelu_tanh_mul.default(gate_up, out)
