"""Decode attention microbenchmark after the paper's Table 3: every implementation of a row is
timed in the same run on the same data shape, so ratios are meaningful on a noisy machine. On the
CPU or a CUDA device; on CUDA, sdpa is torch's flash attention where the dtype allows it."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F

from chunkgen.cache import ChunkPool, KernelContext, PrefixTree
from chunkgen.kernels import decode_attention, invariant, workspace_for

# chunk_tpp with one of the CUDA kernels' steps switched off, timed beside it on a GPU (the CPU
# kernel has none of them): a partial every chunk instead of one a segment of chunks, the
# sequence-first loops reading global memory instead of a staged chunk, and one sequence-first
# block a row and KV head instead of a row's work split over several (docs/gpu.md).
CUDA_SWITCHES = {
    "chunk_tpp_per_chunk": "CHUNKGEN_CUDA_SEGMENTS",
    "chunk_tpp_unstaged": "CHUNKGEN_CUDA_STAGE",
    "chunk_tpp_unsplit": "CHUNKGEN_CUDA_SPLITS",
}
KERNEL_IMPLS = ("paged", "paged_shared", "chunk_tpp", *CUDA_SWITCHES)  # chunkgen's op
IMPLS = ("naive", "sdpa", *KERNEL_IMPLS)


def kernel_path(dtype: torch.dtype) -> str:
    """The CPU kernel path the op takes for this KV dtype (bf16: AMX, AVX512_BF16 or fp32 FMAs)."""
    from chunkgen._native import native

    isa = native().cpu_kernel_isa()
    if dtype != torch.bfloat16 and isa in ("amx", "avx512_bf16"):
        return "fp32 FMAs"
    return isa


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
            Shape(8, 9, 3, 64, 64, 1024, s) for s in (0, 1024)
        ]
    grid = []
    for n_p in (1024, 2048, 4096):
        for n_s in (0, n_p // 2, 3 * n_p // 4, n_p):
            grid.append(Shape(32, 32, 32, 128, 64, n_p, n_s))
    for n_s in (0, 1024, 2048):  # the default model's attention shape
        grid.append(Shape(32, 9, 3, 64, 64, 2048, n_s))
    return grid


def _median_us(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    if device.type == "cuda":
        return _median_us_cuda(fn, repeats)
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _median_us_cuda(fn: Callable[[], object], repeats: int) -> float:
    """Kernel time between CUDA events, after warm-up (first launches pay for module loading and
    the kernel context upload)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def _sdpa_backend(device: torch.device, dtype: torch.dtype):
    """Flash attention on CUDA for fp16/bf16 (what the paper compares with); torch's own choice
    otherwise."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    return contextlib.nullcontext()


def _tree(
    shape: Shape, dtype: torch.dtype, share: bool, device: torch.device
) -> tuple[ChunkPool, PrefixTree, KernelContext]:
    c = shape.chunk
    per_seq = -(-shape.n_p // c)
    slots = (per_seq if share else per_seq * shape.batch) + per_seq * shape.batch
    itemsize = torch.empty((), dtype=dtype).element_size()
    pool = ChunkPool(
        1,
        shape.kv_heads,
        shape.head_dim,
        c,
        dtype,
        budget_bytes=slots * 2 * shape.kv_heads * shape.head_dim * c * itemsize,
        slab_slots=1 << 20,
        device=device,
    )
    tree = PrefixTree(pool, share=share)
    system = list(range(shape.n_s))
    for b in range(shape.batch):
        private = [100_000 + b * shape.n_p + i for i in range(shape.n_p - shape.n_s)]
        tree.insert(b, system + private)
        tree.mark_ready(b)
    pool.k[:, : pool.capacity].uniform_(-1, 1)
    pool.v[:, : pool.capacity].uniform_(-1, 1)
    # The arrays on the kernel's device, uploaded once, as the engine keeps them: a host context
    # would be copied to the GPU on every call, inside the timing.
    ctx = KernelContext(tree, device=device)
    ctx.upload()
    return pool, tree, ctx


def run_shape(
    shape: Shape, dtype: torch.dtype, repeats: int, impls=IMPLS, device: torch.device | str = "cpu"
) -> list[dict]:
    device = torch.device(device)
    B, Hq, Hk, d, n = shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.n_p
    G = Hq // Hk
    scale = d**-0.5
    q = torch.randn(B, Hq, d, device=device)
    # q and out in the pool's dtype, as the model's decode step passes them (CPU and CUDA); naive
    # and sdpa compute in the pool's dtype too.
    kernel_q = q.to(dtype)
    rows = []

    def time_us(fn):
        return _median_us(fn, repeats, device)

    def record(impl: str, us: float) -> None:
        rows.append(
            {
                "n_p": shape.n_p,
                "n_s": shape.n_s,
                "batch": B,
                "q_heads": Hq,
                "kv_heads": Hk,
                "head_dim": d,
                "chunk": shape.chunk,
                "dtype": str(dtype).replace("torch.", ""),
                "device": str(device),
                "impl": impl,
                "us": us,
                "q_dtype": str((kernel_q if impl in KERNEL_IMPLS else q.to(dtype)).dtype).replace("torch.", ""),
                "cpu_path": kernel_path(dtype) if device.type == "cpu" and impl in KERNEL_IMPLS else None,
            }
        )

    if "naive" in impls or "sdpa" in impls:
        k = torch.empty(B, Hk, n, d, dtype=dtype, device=device).uniform_(-1, 1)
        v = torch.empty(B, Hk, n, d, dtype=dtype, device=device).uniform_(-1, 1)
        qd = q.to(dtype)
        if "naive" in impls:
            qg = qd.view(B, Hk, G, d)

            def naive():
                s = torch.matmul(qg, k.transpose(-1, -2)) * scale
                return torch.matmul(s.softmax(-1), v)

            record("naive", time_us(naive))
        if "sdpa" in impls:
            # Fused attention kernels want equal head counts: expand K/V once, outside timing.
            ke = k.repeat_interleave(G, 1) if G > 1 else k
            ve = v.repeat_interleave(G, 1) if G > 1 else v
            q4 = qd.view(B, Hq, 1, d)
            with _sdpa_backend(device, dtype):
                record("sdpa", time_us(lambda: F.scaled_dot_product_attention(q4, ke, ve, scale=scale)))
            del ke, ve
        del k, v
    out = torch.empty_like(kernel_q)

    def kernel(pool, ctx, chunk_first):
        ws = workspace_for(ctx, Hq, d, device)
        return lambda: decode_attention(
            kernel_q, pool.k[0], pool.v[0], ctx, scale, chunk_first=chunk_first, out=out, workspace=ws
        )

    if "paged" in impls:
        pool, tree, ctx = _tree(shape, dtype, False, device)
        record("paged", time_us(kernel(pool, ctx, False)))
        del pool, tree, ctx
    if "paged_shared" in impls or "chunk_tpp" in impls:
        pool, tree, ctx = _tree(shape, dtype, True, device)
        if "paged_shared" in impls:
            record("paged_shared", time_us(kernel(pool, ctx, False)))
        if "chunk_tpp" in impls:
            record("chunk_tpp", time_us(kernel(pool, ctx, True)))
        for impl, switch in CUDA_SWITCHES.items():
            if impl in impls and device.type == "cuda":
                with mock.patch.dict(os.environ, {switch: "off"}):  # the CUDA launch reads it every call
                    record(impl, time_us(kernel(pool, ctx, True)))
    return rows


def run_grid(
    grid: list[Shape],
    dtype: torch.dtype,
    repeats: int = 10,
    impls=IMPLS,
    on_row: Callable[[dict], None] | None = None,
    device: torch.device | str = "cpu",
    batch_invariant: bool = False,
) -> list[dict]:
    """Every shape of the grid; chunkgen's op runs as an engine with the same batch_invariant runs
    it (on: each row's state continued one chunk at a time, csrc/invariant.h; off: its fastest plan)."""
    rows = []
    with invariant.numerics(batch_invariant):
        for shape in grid:
            for row in run_shape(shape, dtype, repeats, impls, device):
                row["batch_invariant"] = batch_invariant
                rows.append(row)
                if on_row:
                    on_row(row)
    return rows
