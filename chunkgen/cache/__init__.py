"""The prefix-aware KV cache: slots (ChunkPool), the prefix tree, and its kernel-facing view."""

from chunkgen.cache.context import KernelContext
from chunkgen.cache.pool import ChunkPool, KVMemoryError, KVReservation, PoolExhausted, kv_shape
from chunkgen.cache.tree import Append, Chunk, PrefixTree

__all__ = [
    "Append",
    "Chunk",
    "ChunkPool",
    "KVMemoryError",
    "KVReservation",
    "KernelContext",
    "PoolExhausted",
    "PrefixTree",
    "kv_shape",
]
