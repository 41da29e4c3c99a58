"""Naive decode attention, independent of the kernels: dense K/V per sequence, plain softmax."""

from __future__ import annotations

import torch

from chunkgen.cache.pool import ChunkPool
from chunkgen.cache.tree import PrefixTree, SeqId


def dense_kv(pool: ChunkPool, tree: PrefixTree, layer: int, seq: SeqId) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V `[kv_heads, tokens, head_dim]` of one sequence, read token by token through its path."""
    n = tree.lengths[seq]
    slots, offsets = tree.positions(seq, 0, n)
    s, o = torch.tensor(slots), torch.tensor(offsets)
    k = pool.k[layer, s, :, :, o]  # [tokens, kv_heads, head_dim]
    v = pool.v[layer, s, :, o]
    return k.transpose(0, 1), v.transpose(0, 1)


def reference_decode_attention(
    q: torch.Tensor,
    pool: ChunkPool,
    tree: PrefixTree,
    layer: int,
    order: list[SeqId],
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """softmax(q K^T * scale) V per sequence in float64; q `[batch, q_heads, head_dim]` in `order`.

    The query is the sequence's last token (position n - 1). window > 0 keeps the keys at positions
    p with p > n - 1 - window (transformers' sliding-window mask: the last `window` positions);
    softcap > 0 maps each scaled score s to softcap * tanh(s / softcap) before the softmax."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for row, seq in enumerate(order):
        k, v = dense_kv(pool, tree, layer, seq)
        group = q.shape[1] // k.shape[0]
        k = k.double().repeat_interleave(group, dim=0)
        v = v.double().repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,htd->ht", q[row].double(), k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if window > 0:
            n = scores.shape[1]
            positions = torch.arange(n)
            scores = scores.masked_fill(positions <= n - 1 - window, float("-inf"))
        out[row] = torch.einsum("ht,htd->hd", scores.softmax(-1), v)
    return out
