"""`bench machine`: the ceilings the kernels are measured against, from the native loops."""

from __future__ import annotations

import pytest

from chunkgen._native import native_cpu_available

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


def test_the_cli_prints_both_peaks(capsys):
    import torch

    from chunkgen.cli.bench import bench_machine

    bench_machine()
    out = capsys.readouterr().out
    assert "fp32 FMA peak" in out and "GB/s" in out
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert "int8 vpmaddubsw" in out and "x the fp32 FMA peak" in out
