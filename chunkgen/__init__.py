"""chunkgen: offline batched generation on a prefix-aware chunked KV cache."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "native", "native_cpu_available", "native_cuda_available"]


def __getattr__(name: str) -> Any:
    # The native kernels (and torch with them) load on first use, not on `import chunkgen`: the
    # command line answers --help, usage errors and an early interrupt without that wait.
    if name in ("native", "native_cpu_available", "native_cuda_available"):
        from chunkgen import _native

        return getattr(_native, name)
    raise AttributeError(f"module 'chunkgen' has no attribute {name!r}")
