"""How often llama.cpp agrees with itself, beside how often chunkgen agrees with it, on the
agreement test's 16 held-out prompts (tests/bench/test_llamacpp.py: the first rows of three shipped
templates' queries, 48 new tokens, greedy) on the embedded default GGUF. llama.cpp runs each
template's prompts as one batch (the test's way) with 2 threads and with 1, and each prompt alone;
chunkgen runs them in its default dtype and in fp32. Prints how many answers each pair shares token
for token. Needs llama-cpp-python (`make test-llama-cpp` installs it).

    PYTHONPATH=. python benchmarks/llama_cpp_self_agreement.py  # from the repository root
"""

from __future__ import annotations

import time

from chunkgen.bench.llamacpp import LlamaCpp, cells_for, gguf_file
from chunkgen.engine import Request, SamplingParams
from chunkgen.llm import LLM
from tests.bench.test_llamacpp import HELD_OUT, NEW_TOKENS, held_out_prompts, until_end


def equal(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def main() -> None:
    start = time.time()
    llm = LLM(quantize="auto", kv_memory="1GiB")
    groups = held_out_prompts(llm)
    prompts = [p for group in groups.values() for p in group]
    cells = max(cells_for(group, NEW_TOKENS) for group in groups.values())

    def llama_cpp(threads: int, alone: bool) -> list[list[int]]:
        out = []
        with LlamaCpp(gguf_file(None), cells, max(HELD_OUT.values()), threads) as engine:
            for group in groups.values():
                runs = (
                    [engine.generate([p], NEW_TOKENS)[0][0] for p in group]
                    if alone
                    else engine.generate(group, NEW_TOKENS)[0]
                )
                out += [until_end(g, llm.engine.eos_ids) for g in runs]
        return out

    def chunkgen(model: LLM) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in prompts]
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        for res in model.stream([Request(i, p, params) for i, p in enumerate(prompts)]):
            out[res.id] = res.completions[0].token_ids
        return out

    dtype = str(llm.model.dtype).replace("torch.", "")
    batched, alone, one_thread = llama_cpp(2, False), llama_cpp(2, True), llama_cpp(1, False)
    ours, ours_fp32 = chunkgen(llm), chunkgen(LLM(quantize="auto", kv_memory="1GiB", dtype="fp32"))
    print(f"llama.cpp batched vs alone (2 threads): {equal(batched, alone)}")
    print(f"llama.cpp batched, 2 threads vs 1: {equal(batched, one_thread)}")
    print(f"chunkgen {dtype} vs llama.cpp batched: {equal(ours, batched)}; alone: {equal(ours, alone)}")
    print(f"chunkgen fp32 vs llama.cpp batched: {equal(ours_fp32, batched)}; alone: {equal(ours_fp32, alone)}")
    print(f"chunkgen {dtype} vs chunkgen fp32: {equal(ours, ours_fp32)}")
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
