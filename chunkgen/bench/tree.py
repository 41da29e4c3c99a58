"""Cost of the prefix tree's per-step work (appends + kernel-context refresh) and of a rebuild."""

from __future__ import annotations

import statistics
import time

import torch

from chunkgen.cache import ChunkPool, KernelContext, PrefixTree


def tree_overhead(n_seqs: int = 64, shared: int = 1700, steps: int = 300, chunk: int = 64) -> dict:
    """Default model's KV shape (30 layers, 3 KV heads, head_dim 64); bookkeeping only."""
    pool = ChunkPool(30, 3, 64, chunk, torch.float32, 1 << 40, storage=False)
    tree = PrefixTree(pool)
    system = list(range(shared))
    for s in range(n_seqs):
        tree.insert(s, system + [10_000 + s * 100 + i for i in range(20 + s % 17)])
        tree.mark_ready(s)
    ctx = KernelContext(tree)
    per_step = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for s in range(n_seqs):
            tree.append(s, 5)
        ctx.refresh()
        per_step.append(time.perf_counter() - t0)
    rebuilds_during_steps = ctx.rebuilds - 1
    rebuild = []
    for _ in range(50):
        t0 = time.perf_counter()
        ctx.rebuild()
        rebuild.append(time.perf_counter() - t0)
    return {
        "sequences": n_seqs,
        "steps": steps,
        "step_us_median": statistics.median(per_step) * 1e6,
        "step_us_p90": statistics.quantiles(per_step, n=10)[-1] * 1e6,
        "rebuilds_during_steps": rebuilds_during_steps,
        "rebuild_us_median": statistics.median(rebuild) * 1e6,
    }
