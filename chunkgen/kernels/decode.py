"""Decode attention over the prefix tree: one op registered with torch (torch.ops.chunkgen), native
CPU and CUDA implementations behind it, a fake one for tracing."""

from __future__ import annotations

import torch

from chunkgen._native import native
from chunkgen.cache.context import ContextArrays, KernelContext, checks_enabled
from chunkgen.kernels import invariant


def _register_fake() -> None:
    """Shapes for tracing (torch.compile, fake tensors): the op writes the pool and `out` in place
    and returns nothing."""
    try:
        native()  # loading the extension defines the op (TORCH_LIBRARY in csrc/bindings.cpp)
    except ImportError:
        return  # not built: the first call says how to fix it

    @torch.library.register_fake("chunkgen::decode_attention")
    def _(
        q,
        k,
        v,
        k_cache,
        v_cache,
        layer,
        write_slot,
        write_offset,
        shared_slot,
        shared_len,
        shared_begin,
        shared_end,
        part_off,
        seq_shared_ptr,
        seq_shared_idx,
        priv_slot,
        priv_count,
        priv_last_len,
        workspace,
        out,
        scale,
        chunk_first,
        window=0,
        softcap=0.0,
        store_kv=True,
    ) -> None:
        return None


_register_fake()


# The most blocks the GPU's sequence-first phase splits a row's work over (flash-decoding), where
# (row, KV head) blocks alone would leave SMs idle: small batches, few KV heads, long private parts.
SEQUENCE_SPLITS = 8


def workspace_for(
    ctx: KernelContext, q_heads: int, head_dim: int, device: torch.device, batch_invariant: bool | None = None
) -> torch.Tensor:
    """Partial-result space of the GPU kernels, sized by the context's capacity: the chunk-first
    phase's partials (a row for each (row, shared chunk) pair), then room for SEQUENCE_SPLITS
    blocks' sums per row or, with batch-invariant numerics (default: the current mode), for a
    partial of each private chunk a row holds; the CPU kernel plans its own."""
    if torch.device(device).type == "cpu":
        return torch.empty(0, dtype=torch.float32)
    if batch_invariant is None:
        batch_invariant = invariant.enabled()
    pairs = max(ctx.arrays().seq_shared_idx.numel(), 1)
    per_row = max(SEQUENCE_SPLITS, ctx.private_capacity) if batch_invariant else SEQUENCE_SPLITS
    rows = pairs + ctx.row_capacity * per_row
    return torch.empty(rows * q_heads * (head_dim + 2), dtype=torch.float32, device=device)


def decode_step_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    arrays: ContextArrays,
    workspace: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    chunk_first: bool,
    window: int = 0,
    softcap: float = 0.0,
    store_kv: bool = True,
) -> None:
    """Store the step's k, v `[rows, kv_heads, head_dim]` in `layer` of the pool at the rows' write
    positions (store_kv=False: the rotary op stored them, `LlamaModel.rotary_writes_kv`), then attend q
    `[rows, q_heads, head_dim]` (fp32, or the pool's dtype; `out` the same) over each row's path
    into `out`.

    window > 0 makes it a sliding-window layer: a row whose current token is at position t attends
    positions max(0, t - window + 1)..t only (the last `window` positions, itself included), and
    chunks wholly before that are not read. softcap > 0 caps every scaled score s as
    softcap * tanh(s / softcap) before the softmax (Gemma 2's attention soft-capping)."""
    a = arrays
    torch.ops.chunkgen.decode_attention.default(
        q,
        k,
        v,
        k_cache,
        v_cache,
        layer,
        a.write_slot,
        a.write_offset,
        a.shared_slot,
        a.shared_len,
        a.shared_begin,
        a.shared_end,
        a.part_off,
        a.seq_shared_ptr,
        a.seq_shared_idx,
        a.priv_slot,
        a.priv_count,
        a.priv_last_len,
        workspace,
        out,
        scale,
        chunk_first,
        window,
        softcap,
        store_kv,
    )


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: KernelContext,
    scale: float,
    chunk_first: bool | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its whole path in the tree, nothing written.

    q `[rows, q_heads, head_dim]` (fp32 or the pool's dtype) in `ctx.order` (rows: the batch,
    padded to its bucket);
    k, v one layer of the pool (`pool.k[layer]`, `pool.v[layer]`) on the CPU or a CUDA device.
    chunk_first=False runs the paged baseline; window and softcap as in `decode_step_attention`;
    workspace from `workspace_for` (default: allocated here). For kernel tests and benchmarks: the
    model's decode step calls the op through `decode_step_attention` with the K/V write.

    A timed caller builds `ctx` on q's device and passes a workspace: a host context costs a copy
    of its arrays every call, which lands inside any timing of the kernel.
    """
    if checks_enabled():
        ctx.validate()
    arrays = ctx.arrays()
    if arrays.shared_slot.device != q.device:  # a host context driving a GPU kernel (tests)
        arrays = ctx.arrays_on(q.device)
    out = torch.empty_like(q) if out is None else out
    hk, d = k.shape[1], k.shape[2]
    none = torch.empty(0, hk, d, dtype=q.dtype, device=q.device)
    no_rows = torch.empty(0, dtype=torch.int32, device=q.device)
    decode_step_attention(
        q,
        none,
        none,
        k.unsqueeze(0),
        v.unsqueeze(0),
        0,
        arrays._replace(write_slot=no_rows, write_offset=no_rows),
        workspace_for(ctx, q.shape[1], q.shape[2], q.device) if workspace is None else workspace,
        out,
        scale,
        ctx.chunk_first if chunk_first is None else chunk_first,
        window,
        softcap,
    )
    return out
