"""Template `choices` for `chunkgen run`: each choice's total logprob after the row's prompt, its
length in tokens and whether it is the greedy continuation equal transformers' forward pass; the
likeliest is the answer; a row's own `choices` replaces the template's; bad lists are refused per
row (or, in a template, before the model loads)."""

from __future__ import annotations

import json

import pytest
import torch

from chunkgen.jobs.requests import ErrorRecord, Job, template_jobs
from chunkgen.jobs.templates import TemplateError, load_template
from chunkgen.prompt import encode_prompt
from tests.helpers import HF_ATTENTION, records, rows_of, run_cli

TEMPLATE = """
system = "Label each water-utility review. Answer with one word."
user = "Review: {review}\\nLabel:"
choices = ["positive", "negative"]
"""


def _template(tmp_path, text: str = TEMPLATE):
    path = tmp_path / "label.toml"
    path.write_text(text)
    return path


def test_choices_read_from_template_and_row(tmp_path):
    t = load_template(_template(tmp_path))
    assert t.choices == ("positive", "negative")
    lines = [
        json.dumps({"id": "a", "review": "Clean water."}),
        json.dumps({"id": "b", "review": "Brown water.", "choices": ["good", "bad", "so-so"]}),
        json.dumps({"id": "c", "review": "x", "choices": []}),
        json.dumps({"id": "d", "review": "x", "choices": "good"}),
        json.dumps({"id": "e", "review": "x", "choices": ["good", ""]}),
        json.dumps({"id": "f", "review": "x", "choices": ["good", "good"]}),
        json.dumps({"id": "g", "review": "Clean water.", "max_new_tokens": 9}),
    ]
    got = {j.id: j for j in template_jobs(rows_of(*lines), {t.name: t}, {})}
    assert got["a"].choices == ("positive", "negative") and got["a"].params.max_new_tokens == 0
    assert got["b"].choices == ("good", "bad", "so-so")
    errors = {k: (v.field, v.message) for k, v in got.items() if isinstance(v, ErrorRecord)}
    assert errors == {
        "c": ("choices", "must list at least one answer"),
        "d": ("choices", "must be a list of strings, got str"),
        "e": ("choices", "item 1 must be a non-empty string, got an empty one"),
        "f": ("choices", "'good' is given twice"),
    }
    # Sampling settings do not change a scored row; its choices do change its request.
    assert isinstance(got["g"], Job) and got["g"].request_hash == got["a"].request_hash
    other = next(
        template_jobs(rows_of(json.dumps({"id": "a", "review": "Clean water.", "choices": ["yes"]})), {t.name: t}, {})
    )
    assert other.request_hash != got["a"].request_hash
    plain = load_template(_template(tmp_path, 'user = "Review: {review}"\n'))
    job = next(template_jobs(rows_of(json.dumps({"id": "a", "review": "x"})), {plain.name: plain}, {}))
    assert job.choices is None and job.params.max_new_tokens != 0


@pytest.mark.parametrize(
    "text, says",
    [
        ('user = "{x}"\nchoices = "yes"\n', "field 'choices' must be a list of strings, got str"),
        ('user = "{x}"\nchoices = []\n', "field 'choices' must list at least one answer"),
        ('user = "{x}"\nchoices = ["a", 1]\n', "field 'choices' item 1 must be a non-empty string, got int"),
        ('user = "{x}"\nchoices = ["a"]\n[output]\nregex = "a"\n', "give one"),
        ('user = "{choices}"\nchoices = ["a"]\n', "both a field and a placeholder"),
    ],
)
def test_bad_template_choices_refused(tmp_path, text, says):
    with pytest.raises(TemplateError, match=says):
        load_template(_template(tmp_path, text))


def test_run_choices_equal_transformers(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    template = _template(tmp_path)
    rows = [
        {"id": "a", "review": "The water tasted clean and the crew was quick."},
        {"id": "b", "review": "Brown water for a week and nobody answered the phone."},
        {"id": "c", "review": "Fine.", "choices": ["good", " bad", "so-so", "neither good nor bad"]},
    ]
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    res = run_cli(
        "run", "-t", str(template), "-q", str(queries), "-o", str(out), "--model", str(tiny_model),
        "--chunk-size", "16", "--kv-memory", "64MiB", "--quiet", "--dtype", "fp32",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    recs = {r["id"]: r for r in records(out)}
    tok = AutoTokenizer.from_pretrained(tiny_model)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=HF_ATTENTION)
    t = load_template(template)
    for row in rows[:3]:
        rec = recs[row["id"]]
        choices = row.get("choices", ["positive", "negative"])
        context = encode_prompt(tok, t.messages({"review": row["review"]}), (row["review"],), t.layout)
        refs = []
        for got, text in zip(rec["choices"], choices, strict=True):
            cont = tok(text, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([context + cont])).logits[0].float(), -1)
            rows_lp = lp[len(context) - 1 : len(context) - 1 + len(cont)]
            per_token = rows_lp[torch.arange(len(cont)), torch.tensor(cont)]
            assert got["text"] == text and got["num_tokens"] == len(cont)
            assert abs(got["logprob"] - per_token.sum().item()) <= 1e-4 * len(cont)
            assert got["greedy"] == bool((rows_lp.argmax(-1) == torch.tensor(cont)).all())
            refs.append(per_token.sum().item())
        best = max(range(len(refs)), key=lambda i: refs[i])
        assert rec["choice"] == best and rec["text"] == choices[best]
        # The prompt is computed once: every choice after the first finds it in the cache.
        assert rec["usage"]["cached_tokens"] >= (len(choices) - 1) * (len(context) - 16)
        assert rec["usage"]["completion_tokens"] == 0 and "error" not in rec
    again = run_cli(
        "run", "-t", str(template), "-q", str(queries), "-o", str(out), "--model", str(tiny_model),
        "--chunk-size", "16", "--kv-memory", "64MiB", "--quiet", "--dtype", "fp32", "--resume",
    )  # fmt: skip
    assert again.exit_code == 0 and len(records(out)) == 3  # answered rows skipped on resume
