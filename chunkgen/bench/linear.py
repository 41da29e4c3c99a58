"""One linear product at a time, quantized against float, side by side in one process: the fp32
product the engine runs (model/llama.py's Linear: with batch-invariant numerics chunkgen's packed
product at any rows; without, it up to 256 rows and oneDNN above), on a CPU with a bf16 path (AMX
or AVX512_BF16) the bf16 product it runs as well (without batch invariance oneDNN's above 32 rows),
and the quantized kernel on the same shape, random weights of each type."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

# The default model's (SmolLM2-135M) products as (n out, k in): q/o, gate or up, down, the output layer.
SMOLLM2_SHAPES = ((576, 576), (1536, 576), (576, 1536), (49152, 576))
ROWS = (1, 32, 256, 2048)
TYPES = ("q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "q8_0", "int8")


def best_ms(fn: Callable[[], object], min_seconds: float, max_calls: int = 50) -> float:
    """The fastest of repeated calls after one warm-up, for at least min_seconds or max_calls (and two
    calls): on a shared machine the minimum is the figure least disturbed by other work."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 2 or (time.perf_counter() - start < min_seconds and len(times) < max_calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def _quantized(kind: str, w: torch.Tensor, seed: int):
    from chunkgen.model import quant

    n, k = w.shape
    if kind == "int8":
        part = quant.int8_per_channel(w)
    else:
        qtype = quant.GGUF_TYPES[kind]
        part = quant.from_gguf(quant.random_gguf(qtype, n, k, 0.02, np.random.default_rng(seed)), qtype, n, k)
    return quant.QuantLinear([part], None)


def run_linear(
    shapes=SMOLLM2_SHAPES,
    rows=ROWS,
    types=TYPES,
    min_seconds: float = 0.3,
    batch_invariant: bool = True,
    on_row: Callable | None = None,
) -> list[dict]:
    """Per shape, rows and type: best time in ms, GFLOP/s (2 n k rows) and speed against fp32 (and
    against bf16, `vs_bf16`, where this CPU has a bf16 path; else None). Each product runs as an
    engine with the same batch_invariant runs it: on, every float call takes chunkgen's packed
    product; off, calls above its rows take oneDNN's."""
    from chunkgen.kernels import invariant

    with invariant.numerics(batch_invariant):
        return _run_linear(shapes, rows, types, min_seconds, on_row)


def _run_linear(shapes, rows, types, min_seconds: float, on_row: Callable | None) -> list[dict]:
    from chunkgen.model import quant
    from chunkgen.model.llama import Linear, decode_product_available

    bf16 = decode_product_available()

    out = []
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) * 0.02
        products = {"fp32": Linear(w, None)}
        if bf16:
            products["bf16"] = Linear(w.bfloat16(), None)
        for i, kind in enumerate(types):
            if kind == "int8" or k % quant.GGML_QUANT_SIZES[quant.GGUF_TYPES[kind]][0] == 0:
                products[kind] = _quantized(kind, w, seed=i)  # a K-quant needs k a multiple of 256
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            times = {}
            for name, product in products.items():
                # a bf16 model's activations are bf16: the bf16 product's, and the quantized ones'
                # where this CPU runs bf16 models (they quantize it and write their rows in it)
                xin = x.bfloat16() if name == "bf16" or bf16 and name != "fp32" else x
                times[name] = best_ms(lambda p=product, x=xin: p(x), min_seconds)
            for name, ms in times.items():
                row = {
                    "n": n,
                    "k": k,
                    "rows": m,
                    "type": name,
                    "ms": ms,
                    "gflops": 2 * n * k * m / ms / 1e6,
                    "vs_fp32": times["fp32"] / ms,
                    "vs_bf16": times["bf16"] / ms if "bf16" in times else None,
                }
                out.append(row)
                if on_row:
                    on_row(row)
    return out


# Products of a decode step and a prefill on the GPU: SmolLM2-135M's and Llama-3.2-1B's (n out, k in).
CUDA_SHAPES = (
    (960, 576),
    (576, 576),
    (3072, 576),
    (576, 1536),
    (49152, 576),
    (3072, 2048),
    (16384, 2048),
    (2048, 8192),
)
CUDA_ROWS = (1, 32, 256, 4096)


def run_linear_cuda(
    shapes=CUDA_SHAPES, rows=CUDA_ROWS, dtype: torch.dtype = torch.bfloat16, repeats: int = 20, on_row=None
) -> list[dict]:
    """Per shape and rows on the current CUDA GPU: cuBLAS (torch's `linear`, what the engine runs)
    and chunkgen's batch-invariant product (kernels/invariant.py, what `--batch-invariant on` runs),
    the median of `repeats` calls between CUDA events, random weights; the invariant one's time
    over cuBLAS's (`vs_cublas`): what the mode costs in the linear layers."""
    from chunkgen.bench.kernel import _median_us_cuda
    from chunkgen.kernels import invariant

    out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen, device="cuda").mul_(0.02).to(dtype)
        for m in rows:
            x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
            times = {
                "cublas": _median_us_cuda(lambda x=x, w=w: torch.nn.functional.linear(x, w), repeats),
                "invariant": _median_us_cuda(lambda x=x, w=w: invariant.linear(x, w, None), repeats),
            }
            for impl, us in times.items():
                row = {
                    "n": n,
                    "k": k,
                    "rows": m,
                    "dtype": str(dtype).removeprefix("torch."),
                    "impl": impl,
                    "us": us,
                    "tflops": 2 * n * k * m / us / 1e6,
                    "vs_cublas": us / times["cublas"],
                }
                out.append(row)
                if on_row:
                    on_row(row)
    return out
