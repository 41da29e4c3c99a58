"""A decode step's linear products alone, with their weights coming from memory as in a real step:
every product of a model's shape (fused q/k/v, o, fused gate/up and down for each layer, then the
tied lm_head) with its own random weight, called in turn once a step, so that no weight is still in
cache when its product runs again. In bf16 where the CPU has chunkgen's bf16 product (AMX or
AVX512_BF16), else in fp32 (`--dtype` to choose). Prints the median time of a step's products over five steps,
their FLOP rate and the weight bytes read a second, ROUNDS times. Run it with PYTHONPATH set to each
of two builds, in alternation, to compare them.

    python benchmarks/linear_from_memory.py --model smollm2-135m --rows 32
    python benchmarks/linear_from_memory.py --model llama-3.2-1b --rows 32 --layers 4
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

import torch

from chunkgen.model.llama import decode_product_available


def shapes(model: str, layers: int | None) -> list[tuple[int, int]]:
    """(out, in) features of each product of a decode step, in the order the forward runs them."""
    cfg = json.loads(resources.files("chunkgen.configs").joinpath(f"{model}.json").read_text())
    d, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    layer = [(q + 2 * kv, d), (d, q), (2 * inter, d), (d, inter)]
    return layer * (layers or cfg["num_hidden_layers"]) + [(vocab, d)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a shape of chunkgen/configs (its name without .json)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model's (a big model's memory)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    args = ap.parse_args()
    bf16 = args.dtype == "bf16" or args.dtype == "auto" and decode_product_available()
    dtype = torch.bfloat16 if bf16 else torch.float32
    torch.manual_seed(0)
    step_shapes = shapes(args.model, args.layers)
    packed = [torch.ops.chunkgen.pack_linear.default(torch.randn(n, k, dtype=dtype) * 0.05) for n, k in step_shapes]
    xs = {k: torch.randn(args.rows, k, dtype=dtype) for k in {k for _, k in step_shapes}}
    flop = sum(2 * args.rows * n * k for n, k in step_shapes)
    weight_bytes = sum(dtype.itemsize * n * k for n, k in step_shapes)

    def step() -> None:
        for (n, k), w in zip(step_shapes, packed):
            torch.ops.chunkgen.packed_linear.default(xs[k], w, n)

    step()
    print(
        f"{args.model}, {len(step_shapes)} products, {weight_bytes / 2**20:.0f} MiB of {'bf16' if bf16 else 'fp32'} weights, {args.rows} rows"
    )
    for r in range(args.rounds):
        times = []
        for _ in range(5):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        s = sorted(times)[2]
        print(
            f"round {r + 1}: {s * 1e3:.1f} ms a step, {flop / s / 1e9:.0f} GFLOP/s, {weight_bytes / s / 1e9:.1f} GB/s of weights",
            flush=True,
        )


if __name__ == "__main__":
    main()
