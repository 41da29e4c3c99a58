"""chunkgen: offline batched generation on a prefix-aware chunked KV cache."""

from __future__ import annotations

import os
from typing import Any

__version__ = "0.1.0"

# How long an OpenMP thread that finished its share of a parallel region spins before it sleeps:
# 10,000 rounds (about 80-160 µs), or 2,000 when the thread count is fixed (CHUNKGEN_THREADS=fixed);
# libgomp's own default is 300,000. A spinning thread holds its core while a thread it waits for may
# have none, so spinning pays only while threads do not outnumber free cores, which the engine's
# thread governor sees to (chunkgen/engine/threads.py). Alone, on 2 cores, a 32-row decode step
# takes about 35.5 ms spinning 10,000 rounds, 39.5 ms spinning 2,000 and 51.5 ms sleeping at once
# (OMP_WAIT_POLICY=PASSIVE); beside a busy process on 2 threads, 107, 71-74 and 60-64 ms
# (benchmarks/results/2026-12-03-xeon-openmp-spin.md). Read once, when torch loads OpenMP: `import
# chunkgen` before torch. OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment decide instead.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    _fixed = os.environ.get("CHUNKGEN_THREADS", "").strip().lower() == "fixed"
    os.environ["GOMP_SPINCOUNT"] = "2000" if _fixed else "10000"

__all__ = ["__version__", "native", "native_cpu_available", "native_cuda_available"]


def __getattr__(name: str) -> Any:
    # The native kernels (and torch with them) load on first use, not on `import chunkgen`: the
    # command line answers --help, usage errors and an early interrupt without that wait.
    if name in ("native", "native_cpu_available", "native_cuda_available"):
        from chunkgen import _native

        return getattr(_native, name)
    raise AttributeError(f"module 'chunkgen' has no attribute {name!r}")
