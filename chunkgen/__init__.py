"""chunkgen: offline batched generation on a prefix-aware chunked KV cache."""

from __future__ import annotations

import os
from typing import Any

__version__ = "0.1.0"

# OpenMP threads that finish their share of a parallel region spin only briefly (2,000 rounds) before
# they sleep, not libgomp's 300,000. A spinning thread holds its core while a thread it waits for
# may have none: beside another busy process, each of a step's hundreds of parallel regions then
# waits out a scheduler time slice (a 64-row decode step: 780 ms at libgomp's default, 538 ms here,
# 315 ms with OMP_WAIT_POLICY=PASSIVE, about 240 ms alone; alone, the short spin costs nothing
# measurable and sleeping at once about 15% of a whole run: benchmarks/results/2026-11-27-openmp-wait.md). Read
# once, when torch loads OpenMP: `import chunkgen` before torch. OMP_WAIT_POLICY or GOMP_SPINCOUNT
# in the environment decide instead (PASSIVE on a machine shared with other work).
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "2000"

__all__ = ["__version__", "native", "native_cpu_available", "native_cuda_available"]


def __getattr__(name: str) -> Any:
    # The native kernels (and torch with them) load on first use, not on `import chunkgen`: the
    # command line answers --help, usage errors and an early interrupt without that wait.
    if name in ("native", "native_cpu_available", "native_cuda_available"):
        from chunkgen import _native

        return getattr(_native, name)
    raise AttributeError(f"module 'chunkgen' has no attribute {name!r}")
