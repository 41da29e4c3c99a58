"""Prompt logprobs against transformers' own forward pass, on random trees of shared contexts: every
token's logprob and its top alternatives, whether its chunk was computed by this prompt, by an
earlier one (read from the tree), or copied from a partly shared chunk."""

from __future__ import annotations

import random

import pytest
import torch

from chunkgen.engine import Request, SamplingParams
from chunkgen.engine.params import ParamError
from chunkgen.llm import LLM
from tests.helpers import HF_ATTENTION
from tests.model.test_families import _build

CHUNK = 16


def _tree_prompts(seed: int, vocab: int, n: int = 10) -> list[list[int]]:
    """Prompts that share a system prefix (cut at random, inside chunks too), some repeated whole,
    some extending another prompt."""
    rnd = random.Random(seed)
    system = [1] + [rnd.randrange(3, vocab) for _ in range(rnd.randrange(20, 60))]
    prompts: list[list[int]] = []
    for _ in range(n):
        r = rnd.random()
        if prompts and r < 0.15:
            p = list(rnd.choice(prompts))
        elif prompts and r < 0.3:
            p = rnd.choice(prompts) + [rnd.randrange(3, vocab) for _ in range(rnd.randrange(1, 20))]
        else:
            p = system[: rnd.randrange(1, len(system) + 1)] + [
                rnd.randrange(3, vocab) for _ in range(rnd.randrange(0, 30))
            ]
        prompts.append(p)
    return prompts


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check(hf, results, prompts, k: int, tol: float) -> None:
    for r in results:
        ids = prompts[r.id]
        ref = _reference(hf, ids)
        got = r.prompt_logprobs
        assert len(got) == len(ids) and got[0] is None
        for p in range(1, len(ids)):
            e = got[p]
            assert e.token_id == ids[p]
            assert abs(e.logprob - ref[p - 1, ids[p]].item()) <= tol, (r.id, p)
            assert len(e.top) == k
            for alt in e.top:
                assert abs(alt.logprob - ref[p - 1, alt.token_id].item()) <= tol
            # the alternatives are the likeliest k (ties aside): none outside them is likelier
            if k:
                assert ref[p - 1].max().item() <= e.top[0].logprob + tol


FAMILIES = ["llama3-rope", "qwen3", "gemma2", "phi3", "mistral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_equal_transformers_fp32(family, tmp_path):
    from transformers import AutoModelForCausalLM

    path = _build(tmp_path / family, family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=HF_ATTENTION)
    llm = LLM(model=str(path), dtype="fp32", chunk_size=CHUNK, kv_memory="32MiB", max_batch=4)
    prompts = _tree_prompts(hash(family) % 1000, hf.config.vocab_size)
    params = SamplingParams(max_new_tokens=0, prompt_logprobs=2)
    first = list(llm.stream([Request(i, p, params) for i, p in enumerate(prompts)]))
    _check(hf, first, prompts, 2, 1e-4)
    # The same prompts again: every entry is in the tree, nothing is computed.
    rows = llm.engine.stats.prefill_rows
    again = list(llm.stream([Request(i, p, params) for i, p in enumerate(prompts)]))
    assert llm.engine.stats.prefill_rows == rows
    _check(hf, again, prompts, 2, 1e-4)


def test_shared_chunks_scored_once(tiny_model):
    """Prompts through one cached prefix compute their own tokens and one position before them,
    never the prefix again; more alternatives than the tree holds are computed afresh."""
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(tiny_model), dtype="fp32", chunk_size=CHUNK, kv_memory="64MiB", max_batch=8)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=HF_ATTENTION)
    rnd = random.Random(3)
    system = [1] + [rnd.randrange(3, 300) for _ in range(50)]
    prompts = [system] + [system + [rnd.randrange(3, 300) for _ in range(5)] for _ in range(6)]
    params = SamplingParams(max_new_tokens=0, prompt_logprobs=1)
    list(llm.stream([Request(0, prompts[0], params)]))
    assert llm.engine.stats.prefill_rows == len(system)
    rest = list(llm.stream([Request(i, p, params) for i, p in enumerate(prompts) if i]))
    assert llm.engine.stats.prefill_rows == len(system) + 6 * (5 + 1)
    _check(hf, rest, prompts, 1, 1e-4)
    more = list(llm.stream([Request(1, prompts[1], SamplingParams(max_new_tokens=0, prompt_logprobs=4))]))
    _check(hf, more, prompts, 4, 1e-4)


def test_prompt_logprobs_with_generation_and_score_from(tiny_llm):
    prompt = tiny_llm.encode("The water authority supplies the town")
    plain = tiny_llm.generate([prompt], SamplingParams(max_new_tokens=5))[0]
    res = list(
        tiny_llm.stream([Request("a", prompt, SamplingParams(max_new_tokens=5, prompt_logprobs=0), score_from=4)])
    )[0]
    assert res.token_ids == plain.token_ids  # scoring changes nothing generated
    assert res.prompt_logprobs[:4] == [None] * 4 and all(e.top == [] for e in res.prompt_logprobs[4:])
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_checked():
    with pytest.raises(ParamError, match=r"^prompt_logprobs must be an integer in \[0, 20\], got 21$"):
        SamplingParams(prompt_logprobs=21)
    assert SamplingParams(max_new_tokens=0, prompt_logprobs=0).as_dict()["prompt_logprobs"] == 0
    assert "prompt_logprobs" not in SamplingParams().as_dict()  # request hashes of older rows unchanged
