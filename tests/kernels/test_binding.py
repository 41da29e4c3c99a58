"""The native binding refuses kernel contexts that break the header's promises, before any kernel runs."""

from __future__ import annotations

import pytest
import torch

from chunkgen.cache import ChunkPool, KernelContext, PrefixTree
from chunkgen.kernels import decode_attention

HEADS, D, C = 2, 16, 16


def two_groups() -> tuple[ChunkPool, KernelContext]:
    """Rows 0-1 share prefix A, rows 2-3 share prefix B: two shared chunks with disjoint rows."""
    pool = ChunkPool(1, HEADS, D, C, torch.float32, budget_bytes=1 << 22)
    tree = PrefixTree(pool)
    for s in range(4):
        tree.insert(s, [100 + s // 2] * C + [s])
        tree.mark_ready(s)
    pool.k.normal_()
    pool.v.normal_()
    ctx = KernelContext(tree)
    ctx.check()
    assert len(ctx.shared_chunks) == 2
    return pool, ctx


def run(pool: ChunkPool, ctx: KernelContext) -> torch.Tensor:
    q = torch.randn(ctx.batch_size, HEADS, D)
    return decode_attention(q, pool.k[0], pool.v[0], ctx, D**-0.5)


def test_the_unmodified_context_runs():
    pool, ctx = two_groups()
    assert torch.isfinite(run(pool, ctx)).all()


def test_an_empty_shared_chunk_is_refused():
    pool, ctx = two_groups()
    ctx.shared_len[0] = 0  # would be a softmax over no scores: NaN in the CPU kernel
    with pytest.raises(ValueError, match="shared_len"):
        run(pool, ctx)


def test_a_row_may_list_only_shared_chunks_that_cover_it():
    pool, ctx = two_groups()
    row = int(ctx.shared_begin[0])  # a row of the first chunk's range...
    other = 1 if int(ctx.shared_begin[1]) > row else 0
    assert not int(ctx.shared_begin[other]) <= row < int(ctx.shared_end[other])
    first = int(ctx.seq_shared_ptr[row])
    ctx.seq_shared_idx[first] = other  # ...now names the chunk of the other group
    with pytest.raises(ValueError, match=f"row {row} lists shared chunk {other}"):
        run(pool, ctx)


def test_shared_indices_need_shared_chunks():
    pool = ChunkPool(1, HEADS, D, C, torch.float32, budget_bytes=1 << 22)
    tree = PrefixTree(pool)
    tree.insert(0, list(range(20)))
    tree.mark_ready(0)
    ctx = KernelContext(tree)
    assert len(ctx.shared_chunks) == 0
    assert ctx.shared_slot.numel() > 0  # entries at capacity, none in use
    ctx.seq_shared_ptr[1] = 1  # row 0 now lists entry 0, which is unused (it covers no row)
    with pytest.raises(ValueError, match=r"row 0 lists shared chunk 0, which covers rows \[0, 0\)"):
        run(pool, ctx)
    ctx.seq_shared_ptr[1] = 0
    ctx.seq_shared_idx[0] = 5
    ctx.seq_shared_ptr[1] = ctx.seq_shared_idx.numel() + 1  # past the index array's end
    with pytest.raises(ValueError, match="seq_shared_ptr"):
        run(pool, ctx)
