"""Benchmarks behind `chunkgen bench`: the decode-attention kernel, and whole runs."""
