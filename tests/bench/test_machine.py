"""`bench machine`: the ceilings the kernels are measured against, from the native loops."""

from __future__ import annotations

import pytest

from chunkgen._native import native, native_cpu_available

pytestmark = pytest.mark.skipif(not native_cpu_available(), reason="chunkgen's CPU kernels are not built")


def test_ceilings_are_measured_on_this_machine():
    import torch

    from chunkgen.bench.machine import machine_ceilings

    r = machine_ceilings(read_mib=16, repeats=1, int8=True)
    assert r["fma_gflops"] > 0 and r["read_gb_s"] > 0
    assert machine_ceilings(read_mib=16, repeats=1)["int8_gops"] is None  # bench step does not wait for it
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # the build is for this CPU
        # 32 multiply-adds a vpmaddubsw, 8 a fp32 FMA: the int8 step does more a second on any AVX2 core
        assert r["int8_gops"] > r["fma_gflops"]
    else:
        assert r["int8_gops"] == 0
    # the dot-product peaks exist where the build has the instruction, and count what they ran
    # (an AMX build has the AVX512_VNNI tile too)
    has_vnni = hasattr(torch.ops.chunkgen, "quant_isa") and _best_quant_path() in ("amx", "avx512_vnni")
    assert (r["vnni_gops"] > r["fma_gflops"]) if has_vnni else r["vnni_gops"] == 0
    has_bf16 = native().cpu_kernel_isa() in ("amx", "avx512_bf16")
    assert (r["bf16_gflops"] > 0) if has_bf16 else r["bf16_gflops"] == 0


def _best_quant_path() -> str:
    import os

    import torch

    old = os.environ.pop("CHUNKGEN_QUANT_ISA", None)
    try:
        return torch.ops.chunkgen.quant_isa()
    finally:
        if old is not None:
            os.environ["CHUNKGEN_QUANT_ISA"] = old


def test_the_cli_prints_both_peaks(capsys):
    import torch

    from chunkgen.cli.bench import bench_machine

    bench_machine()
    out = capsys.readouterr().out
    assert "fp32 FMA peak" in out and "GB/s" in out
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert "int8 vpmaddubsw" in out and "x the fp32 FMA peak" in out
    assert ("AVX512_VNNI vpdpbusd" in out) == (_best_quant_path() in ("amx", "avx512_vnni"))
