"""Where one decode step's time goes: attention kernel, linear layers, the model's other torch ops,
and the engine around the model (tree, kernel context, sampling, Python)."""
from __future__ import annotations

import contextlib
import time

from chunkgen.engine import Request, SamplingParams
from chunkgen.llm import LLM
from chunkgen.model import llama


@contextlib.contextmanager
def _timed(owner, name: str, totals: dict, key: str):
    """Temporarily wrap owner.name to add its wall time to totals[key]."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t0

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def profile_decode_steps(llm: LLM, prompts: list[list[int]], steps: int = 30) -> dict:
    """Average ms per decode step once every prompt is admitted (prefill excluded)."""
    engine = llm.new_engine(max_batch=len(prompts))
    params = SamplingParams(max_new_tokens=steps + 2, ignore_eos=True)
    engine.add([Request(i, p, params) for i, p in enumerate(prompts)])
    while engine.num_waiting:  # admission and prefill waves, before the decode steps timed below
        engine.step()
    totals = {"attention": 0.0, "linear": 0.0, "model": 0.0}
    with _timed(llama, "decode_step_attention", totals, "attention"), \
            _timed(llama.Linear, "__call__", totals, "linear"), \
            _timed(llama.LlamaModel, "decode", totals, "model"):
        t0 = time.perf_counter()
        done = 0
        while engine.has_work and done < steps:
            engine.step()
            done += 1
        total = time.perf_counter() - t0
    ms = lambda s: 1e3 * s / done  # noqa: E731
    return {"batch": len(prompts), "steps": done, "step_ms": ms(total),
            "attention_ms": ms(totals["attention"]), "linear_ms": ms(totals["linear"]),
            "other_model_ms": ms(totals["model"] - totals["attention"] - totals["linear"]),
            "engine_ms": ms(total - totals["model"])}
