"""The CPU decode kernel alone, batch-invariant mode on and off, at a model's attention shape: ROWS
rows sharing a SHARED-token prompt plus a private tail each (a common three-token start, the row's
number, then random tokens, as `bench e2e`'s questions and 40 decoded tokens leave them), LAYERS
layers of random K/V, every layer called in turn once a step, and a 64 MiB buffer written between
steps (the linear layers' weights pass through the caches there). Prints the mean time of a layer's
call and the kernel's own split (plan, chunk-first phase, sequence-first phase, merge) for each
mode, ROUNDS times in alternation.

    python benchmarks/decode_kernel_modes.py --rows 32 --heads 3,9,64             # SmolLM2-135M
    python benchmarks/decode_kernel_modes.py --rows 32 --heads 32,32,128 --layers 6   # Llama-2-7B
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from chunkgen._native import native
from chunkgen.cache import ChunkPool, KernelContext, PrefixTree
from chunkgen.kernels import decode_attention, invariant


def build(rows: int, shared: int, kv_heads: int, head_dim: int, chunk: int, layers: int, dtype: torch.dtype):
    rnd = random.Random(0)
    pool = ChunkPool(layers, kv_heads, head_dim, chunk, dtype, budget_bytes=16 << 30)
    tree = PrefixTree(pool)
    system = [rnd.randrange(1000) for _ in range(shared)]
    for s in range(rows):
        tail = [7, 8, 9] + [100 + int(ch) for ch in str(s + 1)] + [rnd.randrange(1000) for _ in range(55)]
        tree.insert(s, system + tail)
        tree.mark_ready(s)
    n = pool.capacity
    gen = torch.Generator().manual_seed(0)
    for layer in range(layers):
        pool.k[layer, :n] = torch.randn(pool.k[0, :n].shape, generator=gen).to(dtype)
        pool.v[layer, :n] = torch.randn(pool.v[0, :n].shape, generator=gen).to(dtype)
    return pool, tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--shared", type=int, default=2048)
    ap.add_argument("--heads", default="3,9,64", help="KV heads, query heads, head dim")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (each calls every layer) per round and mode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-dtype", choices=("bf16", "fp32"), default="bf16")
    args = ap.parse_args()
    kv_heads, q_heads, d = (int(x) for x in args.heads.split(","))
    dtype = torch.bfloat16 if args.kv_dtype == "bf16" else torch.float32
    pool, tree = build(args.rows, args.shared, kv_heads, d, args.chunk, args.layers, dtype)
    ctx = KernelContext(tree, chunk_first=True)
    q = torch.randn(args.rows, q_heads, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    flush = torch.zeros(64 << 20, dtype=torch.uint8)
    print(
        f"{args.rows} rows, {args.shared} shared, heads {args.heads}, {args.layers} layers, {args.kv_dtype} K/V, "
        f"CPU path {native().cpu_kernel_isa()}"
    )
    for rnd in range(args.rounds):
        for mode in (True, False):
            invariant.set_enabled(mode)
            for layer in range(args.layers):  # warm: the workspace and the threads
                decode_attention(q, pool.k[layer], pool.v[layer], ctx, d**-0.5)
            native().decode_clock(True)
            spent = 0.0
            for _ in range(args.steps):
                flush.add_(1)
                for layer in range(args.layers):
                    t = time.perf_counter()
                    decode_attention(q, pool.k[layer], pool.v[layer], ctx, d**-0.5)
                    spent += time.perf_counter() - t
            calls = args.steps * args.layers
            ck = native().decode_clock(True)
            us = {k: 1e6 * ck[f"{k}_s"] / calls for k in ("plan", "chunk_first", "seq_first", "merge")}
            print(
                f"round {rnd + 1} invariant {'on ' if mode else 'off'}: {1e6 * spent / calls:7.0f} us a layer "
                f"(plan {us['plan']:.0f}, chunk-first {us['chunk_first']:.0f}, "
                f"sequence-first {us['seq_first']:.0f}, merge {us['merge']:.0f})"
            )


if __name__ == "__main__":
    main()
