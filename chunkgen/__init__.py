"""chunkgen: offline batched generation on a prefix-aware chunked KV cache."""
from chunkgen._native import native, native_cpu_available, native_cuda_available

__version__ = "0.1.0"

__all__ = ["__version__", "native", "native_cpu_available", "native_cuda_available"]
