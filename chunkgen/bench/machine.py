"""The ceilings the kernels are compared with: the FMA peak of all cores, the int8 products' peak of
the quantized linear layers' AVX2 inner step, and the streaming-read bandwidth."""

from __future__ import annotations

import time

import torch

from chunkgen._native import native


def machine_ceilings(read_mib: int = 256, repeats: int = 5, int8: bool = False) -> dict:
    """fp32 FMA GFLOP/s (the native kernel's own loop, all threads) and GB/s of a torch sum; with
    `int8`, also the quantized kernel's int8 inner step in multiply-adds x 2 per second (0 without
    AVX2), which only `bench machine` prints."""
    gflops = native().fma_peak_gflops()
    int8_gops = native().int8_peak_gops() if int8 else None
    x = torch.ones(read_mib * 1024 * 1024 // 4)
    x.sum()  # first touch: page faults are not bandwidth
    t0 = time.perf_counter()
    for _ in range(repeats):
        x.sum()
    gbs = repeats * x.numel() * 4 / (time.perf_counter() - t0) / 1e9
    return {
        "fma_gflops": gflops,
        "simd_lanes": native().simd_width(),
        "int8_gops": int8_gops,
        "read_gb_s": gbs,
        "read_mib": read_mib,
    }
