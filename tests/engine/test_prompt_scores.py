"""Prompt logprobs against transformers' own forward pass, on random trees of shared contexts: every
token's logprob and its top alternatives, whether its chunk was computed by this prompt, by an
earlier one (read from the tree), or copied from a partly shared chunk."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from chunkgen.engine import Request, SamplingParams
from chunkgen.engine.params import ParamError
from chunkgen.llm import LLM
from chunkgen.scoring import ChoiceJob, score_stream
from tests.helpers import HF_ATTENTION
from tests.model.test_families import FAMILIES

CHUNK = 16


def _tree_prompts(seed: int, vocab: int, n: int = 10, min_len: int = 1) -> list[list[int]]:
    """Prompts that share a system prefix (cut at random, inside chunks too, none shorter than
    min_len), some repeated whole, some extending another prompt."""
    rnd = random.Random(seed)
    system = [1] + [rnd.randrange(3, vocab) for _ in range(min_len + rnd.randrange(20, 60))]
    prompts: list[list[int]] = []
    for _ in range(n):
        r = rnd.random()
        if prompts and r < 0.15:
            p = list(rnd.choice(prompts))
        elif prompts and r < 0.3:
            p = rnd.choice(prompts) + [rnd.randrange(3, vocab) for _ in range(rnd.randrange(1, 20))]
        else:
            p = system[: rnd.randrange(min_len, len(system) + 1)] + [
                rnd.randrange(3, vocab) for _ in range(rnd.randrange(0, 30))
            ]
        prompts.append(p)
    return prompts


def _reference(hf, ids: list[int]) -> torch.Tensor:
    """Logprobs of every position of one forward over ids (kept with the model: prompts recur)."""
    done = hf.__dict__.setdefault("_references", {})
    if tuple(ids) not in done:
        with torch.no_grad():
            done[tuple(ids)] = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return done[tuple(ids)]


def _branches(hf, context: list[int], conts: list[list[int]]) -> list[torch.Tensor]:
    """Each continuation's logprob rows (the positions predicting its tokens) from one forward over
    the context and every continuation, padded on the right (which nothing before it attends to)."""
    width = max(map(len, conts))
    batch = torch.tensor([context + c + [0] * (width - len(c)) for c in conts])
    with torch.no_grad():
        lp = torch.log_softmax(hf(batch).logits.float(), dim=-1)
    return [lp[i, len(context) - 1 : len(context) - 1 + len(c)] for i, c in enumerate(conts)]


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


def _check_choices(hf, llm, contexts: list[list[int]], seed: int, vocab: int) -> None:
    """Choices branching from each context (some sharing their first tokens): each one's total
    logprob (1e-4 a token), length and greediness as transformers' forward over context + choice."""
    rnd = random.Random(seed)
    jobs = []
    for i, ctx in enumerate(contexts):
        stem = [rnd.randrange(3, vocab) for _ in range(3)]
        conts = [stem[: rnd.randrange(0, 3)] + [rnd.randrange(3, vocab) for _ in range(rnd.randrange(1, 4))]]
        conts += [[rnd.randrange(3, vocab) for _ in range(rnd.randrange(1, 4))] for _ in range(rnd.randrange(1, 4))]
        jobs.append(ChoiceJob(i, ctx, conts))
    done = {r.id: r for r in score_stream(llm.engine, jobs)}
    assert sorted(done) == list(range(len(jobs)))
    for job in jobs:
        refs = _branches(hf, job.context, job.continuations)
        for cont, sc, rows in zip(job.continuations, done[job.id].choices, refs, strict=True):
            picked = rows[torch.arange(len(cont)), torch.tensor(cont)]
            assert abs(sc.logprob - picked.sum().item()) <= 1e-4 * len(cont), (job.id, cont)
            assert sc.num_tokens == len(cont)
            assert sc.greedy == bool((rows.argmax(-1) == torch.tensor(cont)).all())


def _length_dependent(config) -> bool:
    scaling = getattr(config, "rope_scaling", None) or {}
    return scaling.get("rope_type", scaling.get("type")) in ("longrope", "dynamic")


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_equal_transformers_fp32(family, family_models):
    """Every supported family: prompt logprobs on a random tree of shared prompts, then choices
    branching from contexts of that tree (partly in the cache already)."""
    from transformers import AutoModelForCausalLM

    path = family_models(family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=HF_ATTENTION)
    llm = LLM(model=str(path), dtype="fp32", chunk_size=CHUNK, kv_memory="32MiB", max_batch=4)
    seed = zlib.crc32(family.encode()) % 1000
    vocab = hf.config.get_text_config().vocab_size - 3  # a multimodal config's last ids are image markers
    # Rope whose frequencies follow the forward's length (longrope, dynamic NTK) gives a token
    # other scores in a longer forward once past the original context: transformers scores each
    # prompt in one forward of its own length, the tree reuses a shorter prompt's K/V. Such trees
    # are compared where every prompt is past the original context (longrope: one set of factors).
    min_len = 0
    if _length_dependent(hf.config):
        min_len = hf.config.rope_scaling["original_max_position_embeddings"] + 1
    prompts = _tree_prompts(seed, vocab, min_len=max(min_len, 1))
    params = SamplingParams(max_new_tokens=0, prompt_logprobs=2)
    first = list(llm.stream([Request(i, p, params) for i, p in enumerate(prompts)]))
    _check(hf, first, prompts, 2, 1e-4)
    # The same prompts again: every entry is in the tree, nothing is computed.
    rows = llm.engine.stats.prefill_rows
    again = list(llm.stream([Request(i, p, params) for i, p in enumerate(prompts)]))
    assert llm.engine.stats.prefill_rows == rows
    _check(hf, again, prompts, 2, 1e-4)
    contexts = [p for p in prompts[:4] if len(p) > 1] + [prompts[0][: len(prompts[0]) // 2 + 1]]
    _check_choices(hf, llm, contexts, seed, vocab)


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
