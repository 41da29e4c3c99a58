"""Decode attention over the prefix tree: one entry point, dispatched to the native kernel."""
from __future__ import annotations

import torch

from chunkgen._native import native
from chunkgen.cache.context import KernelContext


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: KernelContext,
    scale: float,
    chunk_first: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its whole path in the tree.

    q `[batch, q_heads, head_dim]` fp32 in `ctx.order`; k, v one layer of the pool
    (`pool.k[layer]`, `pool.v[layer]`), on the CPU or a CUDA device (the context stays on the
    host; the GPU keeps a copy refreshed only when `ctx.stamp` changes). chunk_first=False runs
    the paged baseline.
    """
    return native().decode_attention(
        q, k, v,
        ctx.shared_slot, ctx.shared_len, ctx.shared_begin, ctx.shared_end,
        ctx.seq_shared_ptr, ctx.seq_shared_idx,
        ctx.priv_slot, ctx.priv_count, ctx.priv_last_len,
        float(scale), ctx.chunk_first if chunk_first is None else chunk_first, out, ctx.stamp,
    )
