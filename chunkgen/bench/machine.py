"""The ceilings the kernels are compared with: the FMA peak of all cores, the dot-product peaks of the
quantized linear layers (their AVX2 inner step, AVX512_VNNI's vpdpbusd) and of bf16 (AVX512_BF16's
vdpbf16ps), and the streaming-read bandwidth."""

from __future__ import annotations

import time

import torch

from chunkgen._native import native


def machine_ceilings(read_mib: int = 256, repeats: int = 5, int8: bool = False) -> dict:
    """fp32 FMA GFLOP/s (the native kernel's own loop, all threads) and GB/s of a torch sum; with
    `int8`, also the dot-product peaks in multiply-adds x 2 per second, which only `bench machine`
    prints: the quantized kernel's AVX2 inner step (0 without AVX2), vpdpbusd (0 without
    AVX512_VNNI) and vdpbf16ps (0 without AVX512_BF16)."""
    gflops = native().fma_peak_gflops()
    int8_gops = native().int8_peak_gops() if int8 else None
    vnni_gops = native().vnni_peak_gops() if int8 else None
    bf16_gflops = native().bf16_peak_gflops() if int8 else None
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
        "vnni_gops": vnni_gops,
        "bf16_gflops": bf16_gflops,
        "read_gb_s": gbs,
        "read_mib": read_mib,
    }
