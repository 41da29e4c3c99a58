"""Engine answers against transformers' generate, and against itself under other settings."""

from __future__ import annotations

import pytest
import torch

from chunkgen.engine import Request, SamplingParams
from chunkgen.llm import LLM
from tests.helpers import assert_parity, hf_greedy, template_prompts

QUESTIONS = [f"question {i}: what is {i} plus {2 * i}?" for i in range(16)]


def test_greedy_parity_with_transformers_on_shared_prompt(tiny_llm, tiny_model):
    prompts = template_prompts()
    ids = [tiny_llm.encode(p) for p in prompts]
    results = tiny_llm.generate(prompts, SamplingParams(max_new_tokens=24))
    hf, ref = hf_greedy(tiny_model, ids, 24)
    exact = 0
    for p, r, t in zip(ids, results, ref):
        assert_parity(hf, p, r.token_ids, t)
        exact += r.token_ids == t
    assert exact >= 14, f"only {exact}/16 sequences equal token for token"
    assert sum(r.cached_tokens for r in results) > 15 * 300  # the system prompt was computed once


def test_qwen2_bias_tied_embeddings_and_linear_rope(tiny_qwen):
    llm = LLM(model=str(tiny_qwen), dtype="fp32", chunk_size=16, kv_memory="32MiB")
    prompts = template_prompts("document_qa", 4)
    ids = [llm.encode(p) for p in prompts]
    results = llm.generate(prompts, SamplingParams(max_new_tokens=16))
    hf, ref = hf_greedy(tiny_qwen, ids, 16)
    exact = 0
    for p, r, t in zip(ids, results, ref):
        assert_parity(hf, p, r.token_ids, t)
        exact += r.token_ids == t
    assert exact >= 3, f"only {exact}/4 sequences equal token for token"


@pytest.mark.parametrize(
    "overrides",
    [
        {"share_prefix": False},
        {"chunk_first": False},
        {"max_batch": 1},
        {"chunk_size": 64},
        {"kv_memory": "tight"},  # too small for all at once: admission control and preemption
    ],
)
def test_same_answers_under_every_engine_setting(tiny_llm, overrides):
    prompts = template_prompts("tool_dispatcher", 12)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    base = tiny_llm.generate(prompts, params)
    if overrides.get("kv_memory") == "tight":  # the shared prompt plus room for about 4 sequences
        c = tiny_llm.config.chunk_size
        chunks = -(-max(len(tiny_llm.encode(p)) for p in prompts) // c) + 4 * (-(-(20 + c) // c) + 1)
        bytes_per_chunk = tiny_llm.new_engine().pool.bytes_per_slot
        overrides = {"kv_memory": chunks * bytes_per_chunk}
    engine = tiny_llm.new_engine(**overrides)
    reqs = [Request(i, tiny_llm.encode(p), params) for i, p in enumerate(prompts)]
    got = {r.id: r for r in engine.stream(reqs)}
    for i, r in enumerate(base):
        assert got[i].token_ids == r.token_ids, f"request {i} differs with {overrides}"
    if "kv_memory" in overrides:
        # Admission stops short of the whole batch, and what it lets in grows into the free chunks
        # it kept: a few preemptions, not one per sequence (that would be admission misjudging
        # memory, or preemption ping-pong).
        assert 1 < max(engine.stats.batch_sizes) < len(prompts)
        assert 0 < engine.stats.preemptions < len(prompts) // 2
        assert engine.stats.kv_peak_bytes <= engine.pool.max_slots * engine.pool.bytes_per_slot
    engine.tree.check()


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llm):
    prompts = template_prompts("arithmetic_cot", 6)
    p = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = tiny_llm.new_engine(max_batch=1)
    a = {r.id: r.token_ids for r in alone.stream([Request(i, tiny_llm.encode(x), p) for i, x in enumerate(prompts)])}
    b = tiny_llm.generate(prompts, p)
    assert all(a[i] == r.token_ids for i, r in enumerate(b))
    other = tiny_llm.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.9, seed=99))
    assert any(o.token_ids != r.token_ids for o, r in zip(other, b))


def test_n_samples_share_the_prompt_and_stop_strings_cut_text(tiny_llm):
    prompt = template_prompts("arithmetic_cot", 1)[0]
    res = tiny_llm.generate([prompt], SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, n=3))[0]
    assert len(res.completions) == 3
    assert len({tuple(c.token_ids) for c in res.completions}) > 1
    greedy = tiny_llm.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 30
    text, ids = greedy.text, greedy.token_ids
    decode = lambda t: tiny_llm.tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    stop = decode(ids[:15])[len(decode(ids[:12])) :]  # what tokens 12-14 add: it occurs, whatever the model says
    assert stop.strip() and stop in text, f"no usable stop string in {text!r}"
    cut = tiny_llm.generate([prompt], SamplingParams(max_new_tokens=30, stop=[stop], ignore_eos=True))[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)] and stop not in cut.text
    # token_ids end with the last token whose text ends at or before the cut
    n = len(cut.token_ids)
    assert n < 15 and cut.token_ids == ids[:n] and cut.text.startswith(decode(ids[:n]))
    assert not cut.text.startswith(decode(ids[: n + 1]))


@pytest.mark.parametrize("max_new_tokens", [1, 4])
def test_the_peak_without_sharing_counts_rows_answered_by_their_prefill(tiny_llm, max_new_tokens):
    """Rows of one new token finish in their prefill wave, with no decode step: the figure of what
    they would have held unshared still counts them (it was 0), and exceeds the shared peak."""
    engine = tiny_llm.new_engine(max_batch=8)
    reqs = [
        Request(i, tiny_llm.encode(p), SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
        for i, p in enumerate(template_prompts("tool_dispatcher", 8))
    ]
    list(engine.stream(reqs))
    s = engine.stats
    assert s.kv_unshared_peak_bytes > s.kv_peak_bytes > 0


def test_later_requests_reuse_the_cached_system_prompt(tiny_llm):
    engine = tiny_llm.new_engine()
    prompts = template_prompts("document_qa", 2)
    first = list(engine.stream([Request(0, tiny_llm.encode(prompts[0]), SamplingParams(max_new_tokens=4))]))
    second = list(engine.stream([Request(1, tiny_llm.encode(prompts[1]), SamplingParams(max_new_tokens=4))]))
    assert first[0].cached_tokens == 0
    assert second[0].cached_tokens > 0.9 * second[0].prompt_tokens


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from chunkgen.model import LlamaModel, UnsupportedModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):
        LlamaModel(model)


def test_bf16_weights_and_kv(tiny_model):
    llm = LLM(model=str(tiny_model), dtype="bf16", chunk_size=16, kv_memory="32MiB")
    assert llm.engine.pool.dtype == torch.bfloat16
    prompts = template_prompts("arithmetic_cot", 4)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    shared = llm.generate(prompts, params)
    engine = llm.new_engine(share_prefix=False)
    alone = {r.id: r for r in engine.stream([Request(i, llm.encode(p), params) for i, p in enumerate(prompts)])}
    assert all(len(r.token_ids) == 12 for r in shared)
    assert sum(alone[i].token_ids == r.token_ids for i, r in enumerate(shared)) >= 3


def test_every_step_is_one_wave_or_one_decode_and_returns_what_finished(tiny_llm):
    engine = tiny_llm.new_engine(max_prefill_tokens=64)
    params = SamplingParams(max_new_tokens=1)
    engine.add([Request(i, [10 + i] * 11, params) for i in range(30)])  # 11 tokens, nothing shared
    first = engine.step()
    assert len(first) == 6 and engine.num_waiting == 24 and engine.num_running == 0
    engine.add([Request(100 + i, [60 + i] * 11, params) for i in range(10)])  # between steps
    assert engine.num_waiting == 34
    sizes = [len(first)]
    while engine.has_work:
        sizes.append(len(engine.step()))
    assert sizes == [6] * 6 + [4] and engine.stats.decode_steps == 0
    assert engine.stats.finished == 40


def test_requests_that_can_never_run_come_back_as_errors(tiny_llm):
    engine = tiny_llm.new_engine(kv_memory=8 * tiny_llm.new_engine().pool.bytes_per_slot)  # 8 chunks
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    context = tiny_llm.model.max_context
    reqs = [
        Request("ok", [1, 5, 6, 7], params),
        Request("kv", [1] + [5] * 199, params),
        Request("context", [1] * context, params),
        Request("ok2", [1, 8, 9], params),
    ]
    got = {r.id: r for r in engine.stream(reqs)}
    assert set(got) == {"ok", "kv", "context", "ok2"}
    for ok in ("ok", "ok2"):
        assert got[ok].error is None and len(got[ok].token_ids) == 4
    kv = got["kv"]
    assert kv.completions == [] and kv.finish_reason == "error" and kv.text == ""
    assert kv.error.startswith("prompt needs 13 KV chunks of 16 tokens (") and "holds 8 (" in kv.error
    assert kv.error.endswith("raise --kv-memory")
    assert got["context"].completions == [] and f"context of {context}" in got["context"].error


def test_sequences_that_outgrow_a_tiny_budget_end_with_length(tiny_llm):
    bytes_per_chunk = tiny_llm.new_engine().pool.bytes_per_slot
    engine = tiny_llm.new_engine(kv_memory=6 * bytes_per_chunk)  # 96 tokens in all
    params = SamplingParams(max_new_tokens=400, ignore_eos=True)
    engine.add([Request(i, [1] + [20 + i] * 19, params) for i in range(2)])  # 20 tokens each
    results = []
    for _ in range(300):  # ~150 decode steps are enough; a livelock would spin here forever
        results += engine.step()
        if not engine.has_work:
            break
    assert not engine.has_work, "livelock"
    assert sorted(r.id for r in results) == [0, 1]
    for r in results:
        assert r.finish_reason == "length" and 1 < len(r.token_ids) < 400
        assert r.text == tiny_llm.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    # Alone at the end, each filled the whole budget: 96 positions, plus the token with no room.
    assert max(20 + len(r.token_ids) for r in results) == 6 * 16 + 1
    engine.tree.check()


def test_decode_steps_sample_without_host_work_and_read_once(tiny_llm):
    """Engine decode steps of a fixed batch (seeded top-k / top-p / temperature rows, penalties,
    logprobs, greedy rows) sample with no scalar read, nonzero, boolean-mask index or tensor from
    Python data, and read the device once: tokens and logprobs together."""
    from tests.helpers import OpLog, copies_into, host_work

    engine = tiny_llm.new_engine()
    kinds = [
        dict(),
        dict(temperature=0.8, top_k=20, seed=1),
        dict(temperature=1.0, top_p=0.9, seed=2),
        dict(temperature=1.1, seed=3, logprobs=3),
        dict(presence_penalty=0.5, frequency_penalty=0.4, logprobs=0),
    ]
    prompts = template_prompts("arithmetic_cot", 10)
    engine.add(
        [
            Request(
                i,
                tiny_llm.encode(prompts[i]),
                SamplingParams(max_new_tokens=12, ignore_eos=True, **kinds[i % len(kinds)]),
            )
            for i in range(10)
        ]
    )
    logs: list[tuple[list, int, bool]] = []
    sample = engine._sample

    def logged(seqs, logits, early=None):
        plan = engine._plan
        with OpLog() as log:
            out = sample(seqs, logits, early)
        logs.append((log.calls, plan is engine._plan, engine._reader.buf))
        return out

    engine._sample = logged
    while engine.has_work:
        engine.step()
    steady = [(calls, buf) for calls, same, buf in logs if same]  # steps that reused the batch's plan
    assert len(steady) >= 5
    for calls, buf in steady:
        assert host_work(calls) == {"syncs": [], "nonzero": [], "bool_index": [], "from_python": []}
        assert copies_into(calls, buf) == 1


def test_releasing_what_no_row_to_come_can_share_changes_no_answer(tiny_llm):
    """An engine told no rows come after its queue frees cached chunks as soon as no queued row can
    take them: two templates' rows, four at a time, give the same tokens as an engine that keeps its
    cache, with the same cache hits but for what a row copies from a partial chunk (of several
    chunks offering the same copy one is kept, which may offer a few tokens less: at least the
    power of two the tree's index finds); and it ends with nothing cached."""
    prompts = template_prompts("tool_dispatcher", 6) + template_prompts("arithmetic_cot", 6)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    kept = tiny_llm.new_engine(max_batch=4)
    released = tiny_llm.new_engine(max_batch=4)
    released.later_rows = "none"
    answers = []
    for engine in (kept, released):
        reqs = [Request(i, tiny_llm.encode(p), params) for i, p in enumerate(prompts)]
        answers.append({r.id: (r.token_ids, r.cached_tokens) for r in engine.stream(reqs)})
    assert {i: t for i, (t, _) in answers[0].items()} == {i: t for i, (t, _) in answers[1].items()}
    c = tiny_llm.config.chunk_size
    for i, (_, cached) in answers[0].items():
        assert cached - c // 2 < answers[1][i][1] <= cached
    assert sum(n for _, n in answers[1].values()) >= 0.99 * sum(n for _, n in answers[0].values())
    assert kept.stats.kv_released_chunks == 0 and released.stats.kv_released_chunks > 0
    assert kept.pool.used > 0 and released.pool.used == 0
    released.tree.check()
    # The peak counts what the running rows read, the same in both.
    assert kept.stats.kv_peak_bytes == released.stats.kv_peak_bytes < kept.pool.peak_bytes


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_waves_mixed_into_decode_steps_change_no_bit(tiny_model, dtype):
    """Rows admitted while others decode run in the decode step's forward (mixed steps): each row's
    tokens and logprobs are bit for bit those of separate waves and steps, with prompts of several
    lengths, a shared prefix, and a budget that splits the refills over several steps."""
    llm = LLM(model=str(tiny_model), dtype=dtype, chunk_size=16, kv_memory="64MiB", max_batch=4)
    prompts = template_prompts("tool_dispatcher", 6)
    prompts += template_prompts("arithmetic_cot", 5)
    params = [SamplingParams(max_new_tokens=4 + 3 * (i % 4), ignore_eos=True, logprobs=2) for i in range(len(prompts))]

    def run(mixed: int):
        engine = llm.new_engine(mixed_prefill_tokens=mixed)
        reqs = [Request(i, llm.encode(p), params[i]) for i, p in enumerate(prompts)]
        got = {r.id: (r.token_ids, [(e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in r.completions[0].logprobs])
               for r in engine.stream(reqs)}  # fmt: skip
        engine.tree.check()
        return got, engine.stats

    apart, s0 = run(0)
    mixed, s1 = run(40)
    assert s0.mixed_steps == 0 and s1.mixed_steps > 0
    assert mixed == apart
    assert s1.decode_steps < s0.decode_steps + s0.finished  # the waves rode on decode steps


def test_a_large_waves_freed_pages_go_back_before_decoding(tiny_llm, monkeypatch):
    """A CPU prefill wave of 1,024 new tokens or more has malloc hand back its freed activations'
    pages once, before the first decode step after it (the decode steps' K/V would go on top of
    them); smaller waves keep them for the steps that follow."""
    from chunkgen.engine import engine as engine_module

    engine = tiny_llm.new_engine()
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(
        engine_module,
        "release_freed_pages",
        lambda: calls.append((engine.stats.prefilled_tokens, engine.stats.decode_steps)) or True,
    )
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    short = tiny_llm.encode(" ".join(["seven"] * 100))
    list(engine.stream([Request(0, short, params)]))
    assert calls == []
    long = tiny_llm.encode(" ".join(f"word {i}" for i in range(600)))
    assert len(long) >= 1024
    list(engine.stream([Request(1, long, params)]))
    assert len(calls) == 1
    assert calls[0][0] >= len(long) and calls[0][1] == engine.stats.decode_steps - 3  # the first of 3 steps


def test_mixed_steps_freed_pages_go_back_once_decoding_alone(tiny_llm, monkeypatch):
    """Rows admitted while others decode (mixed steps) have malloc hand back their freed pages at
    the first decode step without prefill once 512 of their tokens or more ran since the last
    time, never in the middle of mixed steps, and never for fewer."""
    from chunkgen.engine import engine as engine_module

    engine = tiny_llm.new_engine(max_batch=4)
    events: list[tuple] = []
    monkeypatch.setattr(engine_module, "release_freed_pages", lambda: events.append(("release",)) or True)
    run_wave, mixed, decode = engine._run_wave, engine._mixed, engine._decode
    monkeypatch.setattr(
        engine, "_run_wave", lambda w, d: (events.append(("wave", engine_module._new_tokens(w))), run_wave(w, d))[1]
    )
    monkeypatch.setattr(
        engine, "_mixed", lambda b, d: (events.append(("mixed", engine_module._new_tokens(b.prefill))), mixed(b, d))[1]
    )
    monkeypatch.setattr(engine, "_decode", lambda b, d: (events.append(("decode",)), decode(b, d))[1])
    rows = [
        Request(
            i,
            tiny_llm.encode(" ".join(f"row {i} item {j}" for j in range(20))),
            SamplingParams(max_new_tokens=3 + i % 5, ignore_eos=True),
        )
        for i in range(24)
    ]
    list(engine.stream(rows))
    assert sum(e[1] for e in events if e[0] == "mixed") >= 1024  # rows joined decoding rows
    releases = [i for i, e in enumerate(events) if e == ("release",)]
    assert releases
    since = 0
    for i, e in enumerate(events):
        if e == ("release",):
            assert since >= 512 and events[i + 1] == ("decode",), events[max(0, i - 3) : i + 2]
            since = 0
        elif e[0] == "mixed":
            since += e[1]
        elif e[0] == "wave":
            assert e[1] < 1024  # no large wave here: every release is the mixed steps'
        elif e == ("decode",):
            assert since < 512, events[max(0, i - 3) : i + 1]  # alone after 512 mixed tokens: released first
