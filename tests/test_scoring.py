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
    """A context's tokens are computed once; its last position scores every continuation's first
    token, so a one-token continuation after the first computes nothing and a longer one only its
    own tokens."""
    llm = LLM(model=str(tiny_model), dtype="fp32", chunk_size=16, kv_memory="64MiB", max_batch=8)
    rnd = random.Random(1)
    contexts = [[1] + [rnd.randrange(3, 300) for _ in range(rnd.randrange(5, 70))] for _ in range(6)]
    conts = [[[rnd.randrange(3, 300) for _ in range(rnd.randrange(1, 5))] for _ in range(4)] for _ in contexts]
    jobs = [ChoiceJob(i, c, k) for i, (c, k) in enumerate(zip(contexts, conts))]
    results = {r.id: r for r in score_stream(llm.engine, jobs, max_jobs=2)}
    assert sorted(results) == list(range(6))
    # At least every position that predicts a token (the context, each continuation's leading
    # tokens once), at most that plus the last token of each prompt.
    needed = sum(len(c) + len({tuple(t[:n]) for t in k for n in range(1, len(t))}) for c, k in zip(contexts, conts))
    most = sum(len(c) + len(k[0]) + sum(len(t) for t in k[1:] if len(t) > 1) for c, k in zip(contexts, conts))
    assert needed <= llm.engine.stats.prefill_rows <= most
    hf = _hf(tiny_model)
    for i, r in results.items():
        for cont, sc in zip(conts[i], r.choices):
            ref, greedy = _loglikelihood(hf, contexts[i], cont)
            assert abs(sc.logprob - ref) <= 1e-4 * len(cont) and sc.greedy == greedy


def test_one_token_choices_one_prompt_per_question(tiny_model):
    """MMLU's shape: a shared few-shot prefix, questions, one-token answers. Each question computes
    its own tokens and its first answer's, nothing else; scored again, every entry comes from the
    tree and the answers' first tokens are computed as prompts of their own, with equal scores."""
    llm = LLM(model=str(tiny_model), dtype="fp32", chunk_size=16, kv_memory="64MiB", max_batch=8)
    rnd = random.Random(2)
    prefix = [1] + [rnd.randrange(3, 300) for _ in range(40)]
    jobs = [
        ChoiceJob(q, prefix + [rnd.randrange(3, 300) for _ in range(9)], [[a] for a in rnd.sample(range(3, 300), 4)])
        for q in range(8)
    ]
    first = {r.id: r for r in score_stream(llm.engine, jobs)}
    assert llm.engine.stats.prefill_rows == len(prefix) + 8 * (9 + 1)
    rows = llm.engine.stats.prefill_rows
    again = {r.id: r for r in score_stream(llm.engine, jobs)}
    # each other answer: its own token and the question's last position, which predicts it
    assert llm.engine.stats.prefill_rows == rows + 8 * 3 * 2
    hf = _hf(tiny_model)
    for job in jobs:
        for cont, a, b in zip(job.continuations, first[job.id].choices, again[job.id].choices, strict=True):
            ref, greedy = _loglikelihood(hf, job.context, cont)
            for sc in (a, b):
                assert abs(sc.logprob - ref) <= 1e-4 and sc.greedy == greedy and sc.num_tokens == 1


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
