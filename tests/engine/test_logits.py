"""Logprobs and presence / frequency penalties, checked against transformers running the same
weights: logprobs are its log-softmax, penalties are applied to its logits as vLLM does."""

from __future__ import annotations

import json

import pytest
import torch

from chunkgen.engine import SamplingParams
from chunkgen.engine.params import ParamError
from chunkgen.jobs.requests import Job, openai_jobs, template_jobs
from chunkgen.jobs.templates import load_templates
from tests.helpers import base_args, openai_row, records, rows_of, run_cli

PROMPTS_TEXT = ["Will it rain in Oslo?", "Book a flight to Rome.", "What is 2 + 2?", "Play some jazz."]


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def hf_log_softmax(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_equal_transformers_log_softmax(tiny_llm, hf_model):
    """Greedy and sampled rows in one batch: every token's logprob, and each listed alternative's,
    is transformers' log-softmax at that position within 1e-4; alternatives are its top k."""
    params = [
        SamplingParams(max_new_tokens=10, logprobs=5, ignore_eos=True),
        SamplingParams(max_new_tokens=10, logprobs=2, temperature=1.3, seed=4, ignore_eos=True),
        SamplingParams(max_new_tokens=10, ignore_eos=True),  # asks for none
        SamplingParams(max_new_tokens=10, logprobs=0, top_k=5, temperature=0.7, seed=1, ignore_eos=True),
    ]
    results = tiny_llm.generate(PROMPTS_TEXT, params)
    assert results[2].completions[0].logprobs is None
    for prompt, p, r in zip(PROMPTS_TEXT, params, results):
        if p.logprobs is None:
            continue
        c = r.completions[0]
        assert [e.token_id for e in c.logprobs] == c.token_ids
        prompt_ids = tiny_llm.encode(prompt)
        ref = hf_log_softmax(hf_model, prompt_ids + c.token_ids)
        for i, e in enumerate(c.logprobs):
            row = ref[len(prompt_ids) - 1 + i]
            assert abs(e.logprob - row[e.token_id].item()) < 1e-4
            assert len(e.top) == p.logprobs
            want = row.topk(p.logprobs).values.tolist() if p.logprobs else []
            assert [t.logprob for t in e.top] == pytest.approx(want, abs=1e-4)
            for t in e.top:
                assert abs(t.logprob - row[t.token_id].item()) < 1e-4
                assert t.token == tiny_llm.tokenizer.decode([t.token_id])


def test_logprobs_follow_tokens_cut_by_a_stop_string(tiny_llm):
    free = tiny_llm.generate(PROMPTS_TEXT, SamplingParams(max_new_tokens=16, ignore_eos=True))
    for prompt, f in zip(PROMPTS_TEXT, free):
        if len(f.text) < 6:
            continue
        stop = f.text[len(f.text) // 2 :][:3]  # somewhere inside the free answer
        r = tiny_llm.generate([prompt], SamplingParams(max_new_tokens=16, ignore_eos=True, stop=stop, logprobs=1))[0]
        c = r.completions[0]
        assert c.finish_reason == "stop"
        assert [e.token_id for e in c.logprobs] == c.token_ids
        return
    pytest.fail("no free answer long enough to cut")


def test_token_bytes_of_partial_characters(tiny_llm):
    """A byte-fallback piece decodes to U+FFFD alone; its bytes are the byte it stands for."""
    from chunkgen.engine.logits import token_texts

    text = token_texts(tiny_llm.tokenizer)
    tok = tiny_llm.tokenizer
    e_acute = tok.convert_tokens_to_ids("<0xC3>")
    assert text(e_acute) == ("\ufffd", b"\xc3")
    word = tok("the weather", add_special_tokens=False)["input_ids"][-1]
    t, raw = text(word)
    assert raw == t.encode() and t.strip() and "\ufffd" not in t


def greedy_with_penalties(hf_model, ids: list[int], steps: int, presence: float, frequency: float) -> list[int]:
    """The reference: transformers' logits, minus the penalties over generated tokens, argmax."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids + out])).logits[0, -1].float()
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("presence, frequency", [(0.0, 1.5), (1.0, 0.0), (0.5, 0.5), (-1.0, 0.0)])
def test_penalties_equal_the_reference_loop(tiny_llm, hf_model, presence, frequency):
    params = SamplingParams(max_new_tokens=14, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency)
    plain = tiny_llm.generate(PROMPTS_TEXT, SamplingParams(max_new_tokens=14, ignore_eos=True))
    # penalized and plain rows share the batch: a row's penalty touches its own logits only
    mixed = tiny_llm.generate(PROMPTS_TEXT * 2, [params] * 4 + [SamplingParams(max_new_tokens=14, ignore_eos=True)] * 4)
    changed = 0
    for prompt, r, p in zip(PROMPTS_TEXT, mixed, plain):
        want = greedy_with_penalties(hf_model, tiny_llm.encode(prompt), 14, presence, frequency)
        assert r.token_ids == want
        changed += r.token_ids != p.token_ids
    assert [r.token_ids for r in mixed[4:]] == [p.token_ids for p in plain]
    assert changed  # the penalty did something on this model


def test_each_sample_counts_its_own_tokens(tiny_llm):
    r = tiny_llm.generate(
        ["Play some jazz."],
        SamplingParams(max_new_tokens=12, n=3, temperature=1.0, seed=5, frequency_penalty=2.0, logprobs=1),
    )[0]
    alone = [
        tiny_llm.generate(
            ["Play some jazz."], SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, frequency_penalty=2.0)
        )[0]
    ]
    assert r.completions[0].token_ids == alone[0].token_ids
    assert all(len(c.logprobs) == len(c.token_ids) for c in r.completions)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
    ],
)
def test_bad_values_name_their_field(kwargs, field):
    with pytest.raises(ParamError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_unused_fields_leave_request_hashes_alone():
    d = SamplingParams().as_dict()
    assert not {"logprobs", "presence_penalty", "frequency_penalty"} & set(d)
    d = SamplingParams(logprobs=0, presence_penalty=0.5).as_dict()
    assert d["logprobs"] == 0 and d["presence_penalty"] == 0.5 and "frequency_penalty" not in d


def test_openai_body_logprobs_and_penalties():
    msgs = [{"role": "user", "content": "hi"}]
    lines = [
        openai_row(
            {"messages": msgs, "logprobs": True, "top_logprobs": 3, "presence_penalty": 0.4, "frequency_penalty": -0.2},
            "ok",
        ),
        openai_row({"messages": msgs, "logprobs": True}, "bare"),
        openai_row({"messages": msgs, "logprobs": False}, "off"),
        openai_row({"messages": msgs, "top_logprobs": 2}, "top-alone"),
        openai_row({"messages": msgs, "logprobs": True, "top_logprobs": 21}, "top-big"),
        openai_row({"messages": msgs, "logprobs": "yes"}, "lp-type"),
        openai_row({"messages": msgs, "presence_penalty": -3}, "pp"),
    ]
    got = {i.id: i for i in openai_jobs(rows_of(*lines), {"logprobs": 4})}
    assert isinstance(got["ok"], Job)
    p = got["ok"].params
    assert (p.logprobs, p.presence_penalty, p.frequency_penalty) == (3, 0.4, -0.2)
    assert got["bare"].params.logprobs == 0
    assert got["off"].params.logprobs is None  # an explicit false beats the default
    assert {k: got[k].field for k in ("top-alone", "top-big", "lp-type", "pp")} == {
        "top-alone": "body.top_logprobs",
        "top-big": "body.top_logprobs",
        "lp-type": "body.logprobs",
        "pp": "body.presence_penalty",
    }


def test_template_rows_and_sampling_table_take_them(tmp_path):
    t = tmp_path / "t.toml"
    t.write_text('user = "Q: {q}"\n[sampling]\nlogprobs = 2\nfrequency_penalty = 0.3\n')
    templates = load_templates(t)
    jobs = list(
        template_jobs(
            rows_of(
                '{"id": "a", "q": "x"}',
                '{"id": "b", "q": "y", "logprobs": 0, "presence_penalty": 1}',
                '{"id": "c", "q": "z", "logprobs": 50}',
            ),
            templates,
            {},
        )
    )
    assert (jobs[0].params.logprobs, jobs[0].params.frequency_penalty) == (2, 0.3)
    assert (jobs[1].params.logprobs, jobs[1].params.presence_penalty) == (0, 1.0)
    assert jobs[2].field == "logprobs" and "[0, 20]" in jobs[2].message


def test_cli_writes_logprobs_in_both_record_formats(tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    res = run_cli(*base_args(tiny_model, out), "--logprobs", "2", "--frequency-penalty", "0.5")
    assert res.exit_code == 0, res.output
    for r in records(out):
        assert len(r["logprobs"]) >= 1 and r["sampling"]["frequency_penalty"] == 0.5
        for e in r["logprobs"]:
            assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2
            assert e["logprob"] <= 0 and e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
    batch = tmp_path / "batch.jsonl"
    msgs = [{"role": "user", "content": "Will it rain?"}]
    batch.write_text(
        openai_row({"messages": msgs, "max_tokens": 5, "logprobs": True, "top_logprobs": 1}, "a")
        + "\n"
        + openai_row({"messages": msgs, "max_tokens": 5}, "b")
        + "\n"
    )
    out2 = tmp_path / "out2.jsonl"
    res = run_cli(*base_args(tiny_model, out2, batch, None, max_new_tokens=None, dtype=None))
    assert res.exit_code == 0, res.output
    by_id = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in records(out2)}
    content = by_id["a"]["logprobs"]["content"]
    assert len(content) == 5 and all(len(e["top_logprobs"]) == 1 and bytes(e["bytes"]) for e in content)
    assert by_id["b"]["logprobs"] is None


def test_cli_rejects_bad_values_before_the_model_loads(tmp_path):
    out = tmp_path / "out.jsonl"
    for option, value in (("--logprobs", "30"), ("--presence-penalty", "-7")):
        res = run_cli(*base_args("/nonexistent", out), option, value)
        assert res.exit_code == 2 and option in res.output, res.output


def test_summary_counts_answers_matching_their_constraint(tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    args = base_args(tiny_model, out)
    args.remove("--quiet")
    res = run_cli(*args, "--json-log", "--regex", "[0-9]{1,3}")
    assert res.exit_code == 0, res.output
    summary = next(json.loads(l) for l in res.stderr.splitlines() if '"summary"' in l)
    recs = records(out)
    assert summary["constrained"] == summary["matched"] == len(recs) > 0
    assert all(r["constraint_matched"] for r in recs)
    out2 = tmp_path / "short.jsonl"
    res = run_cli(*base_args(tiny_model, out2), "--regex", "[0-9]{8}", "--max-new-tokens", "2")
    assert res.exit_code == 0, res.output
    assert "answers matching their constraint" in res.stderr and "0 of" in res.stderr
    assert not any(r["constraint_matched"] for r in records(out2))
