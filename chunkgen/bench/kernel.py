"""Decode attention microbenchmark after the paper's Table 3: every implementation of a row is
timed in the same run on the same data shape, so ratios are meaningful on a noisy machine."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from chunkgen.cache import ChunkPool, KernelContext, PrefixTree
from chunkgen.kernels import decode_attention

IMPLS = ("naive", "sdpa", "paged", "paged_shared", "chunk_tpp")


@dataclass(frozen=True)
class Shape:
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    chunk: int
    n_p: int
    n_s: int


def default_grid(quick: bool = False) -> list[Shape]:
    if quick:
        return [Shape(8, 32, 32, 128, 64, 1024, s) for s in (0, 1024)] + [
            Shape(8, 9, 3, 64, 64, 1024, s) for s in (0, 1024)]
    grid = []
    for n_p in (1024, 2048, 4096):
        for n_s in (0, n_p // 2, 3 * n_p // 4, n_p):
            grid.append(Shape(32, 32, 32, 128, 64, n_p, n_s))
    for n_s in (0, 1024, 2048):  # the default model's attention shape
        grid.append(Shape(32, 9, 3, 64, 64, 2048, n_s))
    return grid


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _tree(shape: Shape, dtype: torch.dtype, share: bool) -> tuple[ChunkPool, PrefixTree, KernelContext]:
    c = shape.chunk
    per_seq = -(-shape.n_p // c)
    slots = (per_seq if share else per_seq * shape.batch) + per_seq * shape.batch
    itemsize = torch.empty((), dtype=dtype).element_size()
    pool = ChunkPool(1, shape.kv_heads, shape.head_dim, c, dtype,
                     budget_bytes=slots * 2 * shape.kv_heads * shape.head_dim * c * itemsize, slab_slots=1 << 20)
    tree = PrefixTree(pool, share=share)
    system = list(range(shape.n_s))
    for b in range(shape.batch):
        private = [100_000 + b * shape.n_p + i for i in range(shape.n_p - shape.n_s)]
        tree.insert(b, system + private)
        tree.mark_ready(b)
    pool.k[:, : pool.capacity].uniform_(-1, 1)
    pool.v[:, : pool.capacity].uniform_(-1, 1)
    return pool, tree, KernelContext(tree)


def run_shape(shape: Shape, dtype: torch.dtype, repeats: int, impls=IMPLS) -> list[dict]:
    B, Hq, Hk, d, n = shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.n_p
    G = Hq // Hk
    scale = d ** -0.5
    q = torch.randn(B, Hq, d)
    rows = []

    def record(impl: str, us: float) -> None:
        rows.append({"n_p": shape.n_p, "n_s": shape.n_s, "batch": B, "q_heads": Hq, "kv_heads": Hk,
                     "head_dim": d, "chunk": shape.chunk, "dtype": str(dtype).replace("torch.", ""),
                     "impl": impl, "us": us})

    if "naive" in impls or "sdpa" in impls:
        k = torch.empty(B, Hk, n, d, dtype=dtype).uniform_(-1, 1)
        v = torch.empty(B, Hk, n, d, dtype=dtype).uniform_(-1, 1)
        qd = q.to(dtype)
        if "naive" in impls:
            qg = qd.view(B, Hk, G, d)

            def naive():
                s = torch.matmul(qg, k.transpose(-1, -2)) * scale
                return torch.matmul(s.softmax(-1), v)

            record("naive", _median_us(naive, repeats))
        if "sdpa" in impls:
            # torch's fused CPU attention wants equal head counts: expand K/V once, outside timing.
            ke = k.repeat_interleave(G, 1) if G > 1 else k
            ve = v.repeat_interleave(G, 1) if G > 1 else v
            q4 = qd.view(B, Hq, 1, d)
            record("sdpa", _median_us(lambda: F.scaled_dot_product_attention(q4, ke, ve, scale=scale), repeats))
            del ke, ve
        del k, v
    out = torch.empty(B, Hq, d)
    if "paged" in impls:
        pool, tree, ctx = _tree(shape, dtype, share=False)
        record("paged", _median_us(lambda: decode_attention(q, pool.k[0], pool.v[0], ctx, scale, chunk_first=False, out=out), repeats))
        del pool, tree, ctx
    if "paged_shared" in impls or "chunk_tpp" in impls:
        pool, tree, ctx = _tree(shape, dtype, share=True)
        if "paged_shared" in impls:
            record("paged_shared", _median_us(lambda: decode_attention(q, pool.k[0], pool.v[0], ctx, scale, chunk_first=False, out=out), repeats))
        if "chunk_tpp" in impls:
            record("chunk_tpp", _median_us(lambda: decode_attention(q, pool.k[0], pool.v[0], ctx, scale, chunk_first=True, out=out), repeats))
    return rows


def run_grid(grid: list[Shape], dtype: torch.dtype, repeats: int = 10, impls=IMPLS,
             on_row: Callable[[dict], None] | None = None) -> list[dict]:
    rows = []
    for shape in grid:
        for row in run_shape(shape, dtype, repeats, impls):
            rows.append(row)
            if on_row:
                on_row(row)
    return rows
