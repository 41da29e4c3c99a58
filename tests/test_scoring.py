"""Choices and rolling loglikelihood against transformers' forward pass: each continuation's total
logprob, length and greediness, the context prefilled once for all its continuations."""

from __future__ import annotations

import random

import torch

from chunkgen.engine import SamplingParams
from chunkgen.llm import LLM, encode_pair, prefix_token
from chunkgen.scoring import ChoiceJob, rolling_windows, score_stream
from tests.helpers import HF_ATTENTION


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=HF_ATTENTION)


def _loglikelihood(hf, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([context + continuation])).logits[0].float(), dim=-1)
    rows = lp[len(context) - 1 : len(context) - 1 + len(continuation)]
    picked = rows[torch.arange(len(continuation)), torch.tensor(continuation)]
    return picked.sum().item(), bool((rows.argmax(-1) == torch.tensor(continuation)).all())


def test_choices_equal_transformers(tiny_model, tiny_qwen):
    for path in (tiny_model, tiny_qwen):
        hf = _hf(path)
        llm = LLM(model=str(path), dtype="fp32", chunk_size=16, kv_memory="64MiB", max_batch=8)
        shots = "How often are reservoirs inspected? Weekly.\nWhat is the chlorine target? Low.\n"
        contexts = [shots + q for q in ("How long are records kept?", "Who closes the incident log?", "Which ")]
        continuations = [[" Ten years.", " Weekly", " A"], [" The duty manager.", " Nobody"], ["one", " two ", "three"]]
        got = llm.score(contexts, continuations)
        for ctx, conts, res in zip(contexts, continuations, got):
            assert res.error is None and len(res.choices) == len(conts)
            refs = []
            for cont, sc in zip(conts, res.choices):
                c_ids, t_ids = encode_pair(llm.tokenizer, ctx, cont)
                ref, greedy = _loglikelihood(hf, c_ids, t_ids)
                assert abs(sc.logprob - ref) <= 1e-4 * len(t_ids)
                assert sc.num_tokens == len(t_ids) and sc.greedy == greedy
                refs.append(ref)
            assert res.best == max(range(len(refs)), key=lambda i: refs[i])


def test_greedy_continuation_is_greedy(tiny_llm):
    ctx = tiny_llm.encode("How often are reservoirs inspected?")
    out = tiny_llm.generate([ctx], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    other = out.token_ids[:3] + [5 if out.token_ids[3] != 5 else 6]
    res = tiny_llm.score([ctx], [[other, out.token_ids]])[0]
    assert res.choices[1].greedy and not res.choices[0].greedy and res.best == 1


def test_context_prefilled_once(tiny_model):
    """A context's tokens are computed once; each further continuation computes its own tokens and
    the context's last position."""
    llm = LLM(model=str(tiny_model), dtype="fp32", chunk_size=16, kv_memory="64MiB", max_batch=8)
    rnd = random.Random(1)
    contexts = [[1] + [rnd.randrange(3, 300) for _ in range(rnd.randrange(5, 70))] for _ in range(6)]
    conts = [[[rnd.randrange(3, 300) for _ in range(rnd.randrange(1, 5))] for _ in range(4)] for _ in contexts]
    jobs = [ChoiceJob(i, c, k) for i, (c, k) in enumerate(zip(contexts, conts))]
    results = {r.id: r for r in score_stream(llm.engine, jobs, max_jobs=2)}
    assert sorted(results) == list(range(6))
    # Each context once, each continuation its own tokens (its leading tokens shared with another once).
    minimum = sum(
        len(c) + len({tuple(t[:n]) for t in k for n in range(1, len(t) + 1)}) for c, k in zip(contexts, conts)
    )
    assert minimum <= llm.engine.stats.prefill_rows <= minimum + sum(len(k) - 1 for k in conts)
    hf = _hf(tiny_model)
    for i, r in results.items():
        for cont, sc in zip(conts[i], r.choices):
            assert abs(sc.logprob - _loglikelihood(hf, contexts[i], cont)[0]) <= 1e-4 * len(cont)


def test_rolling_windows_cover_every_token_once():
    for n in (1, 5, 19, 20, 21, 57):
        tokens = list(range(100, 100 + n))
        windows = rolling_windows(tokens, 7, 20)
        assert [t for _, cont in windows for t in cont] == tokens
        for ctx, cont in windows:
            assert ctx and len(ctx) + len(cont) - 1 <= 20
            whole = ([7] + tokens)[: tokens.index(cont[0]) + 1]
            assert whole[-len(ctx) :] == ctx  # the tokens just before the window


def test_score_rolling_equals_transformers(tiny_llm, tiny_model):
    hf = _hf(tiny_model)
    text = "What triggers an incident? A pressure drop below the range. " * 4
    ids = tiny_llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    whole = tiny_llm.score_rolling([text])[0].choices[0]
    ref, _ = _loglikelihood(hf, [prefix_token(tiny_llm.tokenizer)], ids)
    assert whole.num_tokens == len(ids) and abs(whole.logprob - ref) <= 1e-4 * len(ids)
    windowed = tiny_llm.score_rolling([text], max_length=24)[0].choices[0]
    ref = sum(_loglikelihood(hf, c, t)[0] for c, t in rolling_windows(ids, prefix_token(tiny_llm.tokenizer), 24))
    assert windowed.num_tokens == len(ids) and abs(windowed.logprob - ref) <= 1e-4 * len(ids)
