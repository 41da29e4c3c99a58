"""The ceilings the kernel is compared with: the FMA peak of all cores and the streaming-read bandwidth."""

from __future__ import annotations

import time

import torch

from chunkgen._native import native


def machine_ceilings(read_mib: int = 256, repeats: int = 5) -> dict:
    """fp32 FMA GFLOP/s (the native kernel's own loop, all threads) and GB/s of a torch sum."""
    gflops = native().fma_peak_gflops()
    x = torch.ones(read_mib * 1024 * 1024 // 4)
    x.sum()  # first touch: page faults are not bandwidth
    t0 = time.perf_counter()
    for _ in range(repeats):
        x.sum()
    gbs = repeats * x.numel() * 4 / (time.perf_counter() - t0) / 1e9
    return {"fma_gflops": gflops, "simd_lanes": native().simd_width(), "read_gb_s": gbs, "read_mib": read_mib}
