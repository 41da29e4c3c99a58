"""Constrained decoding (JSON schema, regex, Lark grammar) with llguidance: on the tiny random
model, whose free answers are garbage, every constrained answer must still be valid."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from chunkgen.engine import SamplingParams
from chunkgen.engine.params import ParamError
from chunkgen.engine.sequence import Request
from chunkgen.jobs.requests import Job, openai_jobs, template_jobs
from chunkgen.jobs.templates import TemplateError, load_template
from tests.helpers import PROMPTS, base_args, openai_row, records, rows_of, run_cli

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},  # bounded in tokens too
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["metric", "imperial"]},
        "alerts": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["city", "days", "units"],
    "additionalProperties": False,
}
PROMPTS_TEXT = [
    "Will it rain in Oslo?",
    "Book a flight to Rome.",
    "What is 2 + 2?",
    "Play some jazz.",
    "Mark task T-1 as done.",
    "Translate 'hello' into Italian.",
    "hello",
    "Restart billing.",
]
DATA = Path(__file__).resolve().parents[1] / "data"
BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


def test_schema_answers_parse_and_validate(tiny_llm):
    params = SamplingParams(max_new_tokens=128, temperature=1.0, seed=7, json_schema=SCHEMA)
    results = tiny_llm.generate(PROMPTS_TEXT, params)
    for r in results:
        assert r.error is None and r.finish_reason == "stop", (r.text, r.error)
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_regex_and_grammar_answers_match(tiny_llm):
    pattern = r"[0-9]{3}-[a-z]{2,6}"
    for r in tiny_llm.generate(PROMPTS_TEXT, SamplingParams(max_new_tokens=24, regex=pattern)):
        assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), r.text
    lark = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[1-9]/'
    for r in tiny_llm.generate(PROMPTS_TEXT, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, grammar=lark)):
        assert r.finish_reason == "stop" and re.fullmatch(r"yes|no|maybe [1-9]", r.text), r.text


def test_permissive_constraint_leaves_greedy_unchanged(tiny_model):
    """`(?s:.*)` admits every text, so the mask must not move the argmax. It does forbid what is
    not text, byte pieces that make invalid UTF-8 and control tokens, which the random model
    picks often: this model's logits leave those out, so its free answers are all text."""
    import torch

    from chunkgen.llm import LLM

    llm = LLM(model=str(tiny_model), dtype="fp32", chunk_size=16, kv_memory="64MiB", max_batch=16)
    tok = llm.tokenizer
    pieces = tok.convert_ids_to_tokens(list(range(llm.model.vocab_size)))
    not_text = [
        i
        for i, p in enumerate(pieces)
        if i in set(tok.all_special_ids) | set(tok.added_tokens_decoder) or BYTE_PIECE.fullmatch(p)
    ]
    bias = torch.zeros(llm.model.vocab_size, device=llm.model.device)
    bias[not_text] = float("-inf")
    logits = llm.model._logits
    llm.model._logits = lambda x: logits(x) + bias
    free = llm.generate(PROMPTS_TEXT, SamplingParams(max_new_tokens=24))
    bound = llm.generate(PROMPTS_TEXT, SamplingParams(max_new_tokens=24, regex=r"(?s:.*)"))
    lark = llm.generate(PROMPTS_TEXT, SamplingParams(max_new_tokens=24, grammar=r"start: /(?s:.*)/"))
    assert [r.token_ids for r in bound] == [r.token_ids for r in free] == [r.token_ids for r in lark]
    assert [r.finish_reason for r in bound] == ["length"] * len(PROMPTS_TEXT)


def test_each_sample_walks_its_own_matcher(tiny_llm):
    params = SamplingParams(max_new_tokens=128, temperature=1.0, seed=11, n=2, json_schema=SCHEMA)
    (r,) = tiny_llm.generate(["Will it rain in Oslo?"], params)
    texts = [c.text for c in r.completions]
    assert len(texts) == 2 and texts[0] != texts[1]  # one shared matcher would fail on the second token
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)


def test_constrained_and_free_requests_share_a_batch(tiny_llm):
    eng = tiny_llm.new_engine(max_batch=8, kv_memory=12 * tiny_llm.engine.pool.bytes_per_slot)
    reqs = [
        Request(
            i,
            tiny_llm.encode(p),
            SamplingParams(max_new_tokens=128, temperature=1.0, seed=i, json_schema=SCHEMA if i % 2 else None),
        )
        for i, p in enumerate(PROMPTS_TEXT)
    ]
    out = {r.id: r for r in eng.stream(reqs)}
    for i, r in out.items():
        assert r.error is None
        if i % 2:
            jsonschema.validate(json.loads(r.text), SCHEMA)
    assert eng._num_constrained == 0  # every matcher released
    assert eng.stats.preemptions > 0  # re-admitted sequences kept their matcher's state


def test_bad_specs_are_param_errors():
    with pytest.raises(ParamError) as e:
        SamplingParams(json_schema={"type": "no-such-type"})
    assert e.value.field == "json_schema"
    with pytest.raises(ParamError) as e:
        SamplingParams(regex="a(b")
    assert e.value.field == "regex" and "unclosed group" in e.value.message
    with pytest.raises(ParamError) as e:
        SamplingParams(grammar="start: undefined_rule")
    assert e.value.field == "grammar"
    with pytest.raises(ParamError) as e:
        SamplingParams(regex="x", json_schema={"type": "object"})
    assert "at most one" in e.value.message
    # a dict and its JSON text are the same params (hashable, equal); key order is kept, as it
    # is the order the answer's properties are written in
    a, b = (
        SamplingParams(json_schema={"type": "object", "b": 1}),
        SamplingParams(json_schema='{"type": "object", "b": 1}'),
    )
    assert a == b and hash(a) == hash(b) and a.json_schema == '{"type":"object","b":1}'
    assert "json_schema" not in SamplingParams().as_dict()


def test_openai_response_format():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    msgs = [{"role": "user", "content": "hi"}]
    lines = [
        openai_row({"messages": msgs, "response_format": {"type": "json_object"}}, "obj"),
        openai_row(
            {
                "messages": msgs,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema, "strict": True},
                },
            },
            "schema",
        ),
        openai_row({"messages": msgs, "response_format": {"type": "text"}}, "text"),
        openai_row(
            {
                "messages": msgs,
                "response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nope"}}},
            },
            "bad",
        ),
        openai_row({"messages": msgs, "response_format": {"type": "xml"}}, "kind"),
    ]
    got = {i.id: i for i in openai_jobs(rows_of(*lines), {"regex": "[a-z]+"})}
    assert json.loads(got["obj"].params.json_schema) == {"type": "object"} and got["obj"].params.regex is None
    assert json.loads(got["schema"].params.json_schema) == schema
    assert got["text"].params.json_schema is None and got["text"].params.regex is None  # text: free
    for k in ("bad", "kind"):
        assert not isinstance(got[k], Job) and got[k].field == "body.response_format"


def test_template_output_table_and_row_overrides(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    path = tmp_path / "t.toml"
    path.write_text('user = "Q: {q}"\n[output]\njson_schema = "s.json"\n')
    t = load_template(path)
    lines = [
        '{"id": "a", "q": "x"}',
        '{"id": "b", "q": "x", "regex": "[0-9]+"}',
        '{"id": "c", "q": "x", "json_schema": {"type": "array"}}',
        '{"id": "d", "q": "x", "regex": "(("}',
    ]
    got = {j.id: j for j in template_jobs(rows_of(*lines), {t.name: t}, {})}
    assert json.loads(got["a"].params.json_schema) == SCHEMA
    assert got["b"].params.regex == "[0-9]+" and got["b"].params.json_schema is None
    assert json.loads(got["c"].params.json_schema) == {"type": "array"}
    assert not isinstance(got["d"], Job) and got["d"].field == "regex"
    inline = tmp_path / "inline.toml"
    inline.write_text('user = "{q}"\n[output]\njson_schema = { type = "object" }\n')
    assert load_template(inline).output == {"json_schema": {"type": "object"}}
    for body, needle in [
        ('json_schema = { type = "nope" }', "json_schema"),
        ('regex = "a(b"', "regex"),
        ('json_schema = "missing.json"', "missing.json"),
        ('regex = "a"\ngrammar = "b"', "exactly one"),
        ('schema = "x"', "unknown keys"),
    ]:
        path.write_text(f'user = "{{q}}"\n[output]\n{body}\n')
        with pytest.raises(TemplateError) as e:
            load_template(path)
        assert str(path) in str(e.value) and needle in str(e.value)
    shipped = load_template(PROMPTS / "tool_dispatcher.toml")
    assert shipped.output["json_schema"] == json.loads((PROMPTS / "tool_dispatcher.schema.json").read_text())


def test_cli_checks_constraints_before_the_model_loads(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "nope"}')
    template = tmp_path / "t.toml"
    template.write_text('user = "{q}"\n[output]\nregex = "a(b"\n')
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"id": "a", "q": "x"}\n')
    base = ["run", "--queries", str(queries), "--out", str(tmp_path / "o.jsonl"), "--model", str(tmp_path / "no-model")]
    res = run_cli(*base, "--template", str(PROMPTS / "tool_dispatcher.toml"), "--json-schema", str(bad))
    assert res.exit_code == 2 and "--json-schema" in res.output
    res = run_cli(*base, "--template", str(PROMPTS / "tool_dispatcher.toml"), "--regex", "a(b")
    assert res.exit_code == 2 and "--regex" in res.output
    res = run_cli(*base, "--template", str(template))
    assert res.exit_code == 1 and "t.toml" in res.output and "regex" in res.output  # not "model not found"


def test_cli_regex_default_applies_to_rows(tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    res = run_cli(*base_args(tiny_model, out, dtype=None, regex="[0-9]{1,4}"))
    assert res.exit_code == 0, res.output
    for r in records(out):
        assert re.fullmatch("[0-9]{1,4}", r["text"]), r["text"]


@pytest.mark.real_model
def test_tool_dispatcher_answers_validate_on_the_default_model(default_model_dir, tmp_path):
    schema = json.loads((PROMPTS / "tool_dispatcher.schema.json").read_text())
    out = tmp_path / "out.jsonl"
    queries, template = PROMPTS / "tool_dispatcher.queries.jsonl", PROMPTS / "tool_dispatcher.toml"
    args = base_args(
        default_model_dir, out, queries, template, chunk_size=None, kv_memory="1GiB", dtype=None, max_new_tokens=96
    )
    res = run_cli(*args)
    assert res.exit_code == 0, res.output
    recs = records(out)
    assert len(recs) == 16
    for r in recs:
        assert r["finish_reason"] == "stop", r["text"]
        jsonschema.validate(json.loads(r["text"]), schema)


@pytest.mark.real_model
def test_further_tool_requests_validate_on_the_default_model(default_model_dir, tmp_path):
    """64 tool-calling requests written for this test (tests/data/tool_requests.jsonl: every
    function, vague requests, requests no function fits), through the shipped template and its
    schema: every finished answer parses and validates (at most two run into the token limit),
    and the summary counts exactly those as matching."""
    schema = json.loads((PROMPTS / "tool_dispatcher.schema.json").read_text())
    out = tmp_path / "out.jsonl"
    template = PROMPTS / "tool_dispatcher.toml"
    args = base_args(
        default_model_dir,
        out,
        DATA / "tool_requests.jsonl",
        template,
        chunk_size=None,
        kv_memory="1GiB",
        quiet=None,
        max_new_tokens=None,
        dtype=None,
        json_log=True,
    )
    res = run_cli(*args)
    assert res.exit_code == 0, res.output
    summary = next(json.loads(l) for l in res.stderr.splitlines() if '"summary"' in l)
    recs = records(out)
    assert len(recs) == 64 and summary["constrained"] == 64
    # Greedy decoding of a 135M model can fall into a loop inside a string (a value repeated until
    # the token limit); which request does hangs on rounding (the ISA, the dtype, the order of a
    # sum). Such an answer is cut at the limit and counted as not matched; every finished one
    # validates.
    finished = [r for r in recs if r["finish_reason"] == "stop"]
    assert len(finished) >= 62 and summary["matched"] == len(finished), [r["text"] for r in recs if r not in finished]
    functions = set()
    for r in recs:
        if r not in finished:
            assert r["finish_reason"] == "length" and not r["constraint_matched"], r
            continue
        assert r["constraint_matched"], r["text"]
        call = json.loads(r["text"])
        jsonschema.validate(call, schema)
        functions.add(call["function"])
    assert len(functions) >= 3  # calls chosen per request, not one call repeated (the 135M model uses 5)


@pytest.mark.real_model
def test_schema_leaves_a_valid_greedy_answer_unchanged(default_model_dir):
    """Where the free greedy answer already fits the schema, the constrained one is the same text."""
    from chunkgen.llm import LLM

    t = load_template(PROMPTS / "tool_dispatcher.toml")
    schema = t.output["json_schema"]
    rows = [json.loads(l) for l in (PROMPTS / "tool_dispatcher.queries.jsonl").read_text().splitlines()][:8]
    prompts = [t.messages({"request": r["request"]}) for r in rows]
    llm = LLM(model=str(default_model_dir), dtype="fp32", kv_memory="1GiB")
    free = llm.generate(prompts, SamplingParams(max_new_tokens=96))
    bound = llm.generate(prompts, SamplingParams(max_new_tokens=96, json_schema=schema))
    same = 0
    for f, b in zip(free, bound):
        try:
            jsonschema.validate(json.loads(f.text), schema)
        except (ValueError, jsonschema.ValidationError):
            continue
        assert b.text == f.text
        same += 1
    assert same >= 2  # not vacuous


def test_matchers_of_one_spec_are_copies_that_walk_apart(tiny_llm):
    """A spec's matcher is built once per engine and copied for each sequence: a copy starts where
    a new one would, and what one sequence consumes does not move another."""
    c = tiny_llm.new_engine().constraints
    params = SamplingParams(regex="[0-9]+")
    first, second = c.matcher(params), c.matcher(params)
    assert first is not second and len(c._fresh) == 1
    start = c.fill([second]).bits.clone()
    digit = next(
        t
        for t in range(c.vocab_size)
        if tiny_llm.tokenizer.decode([t]).strip().isdigit()
        and tiny_llm.tokenizer.decode([t]).strip() == tiny_llm.tokenizer.decode([t])
    )
    assert first.consume_token(digit)
    assert torch.equal(c.fill([second]).bits, start)  # the other copy has not moved
    assert not torch.equal(c.fill([first]).bits, start)  # after a digit, end of text is allowed too
    c.matcher(SamplingParams(regex="[a-z]+"))
    assert len(c._fresh) == 2


def test_masks_fill_two_host_buffers_in_turn(tiny_llm):
    """A step's masks stay intact while the next step's fill the other buffer; applied, they
    forbid exactly the tokens whose bit is clear, in the constrained rows only."""
    import torch

    c = tiny_llm.new_engine().constraints
    ms = [c.matcher(SamplingParams(regex="[0-9]+")), None, c.matcher(SamplingParams(regex="[a-z]+"))]
    first, second, third = c.fill(ms), c.fill(ms), c.fill(ms)
    assert first.rows == [0, 2] and first.bits.data_ptr() != second.bits.data_ptr()
    assert third.bits.data_ptr() == first.bits.data_ptr()  # two buffers, taken in turn
    logits = torch.zeros(3, c.vocab_size)
    c.apply_(logits, second)
    words = torch.arange(c.vocab_size)
    for j, row in enumerate(second.rows):
        bits = (second.bits[j, words // 32].long() >> (words % 32)) & 1  # unpacked bit by bit
        assert torch.equal(torch.isfinite(logits[row]), bits == 1)
    assert torch.isfinite(logits[1]).all()
    assert not torch.equal(torch.isfinite(logits[0]), torch.isfinite(logits[2]))


def test_a_tokenizer_built_ahead_masks_as_llguidances_own(tiny_llm):
    """`prepare` builds llguidance's tokenizer on a thread, from the tokenizer's JSON without
    from_tokenizer's copy: every spec's masks, walked a few tokens, equal those of from_tokenizer's."""
    from llguidance.hf import from_tokenizer

    from chunkgen.engine.params import llguidance_module

    ahead = tiny_llm.new_engine().constraints
    ahead.prepare()
    assert ahead._building is not None
    own = tiny_llm.new_engine().constraints
    own._tokenizer = from_tokenizer(own.hf_tokenizer, n_vocab=own.vocab_size, eos_token=own.eos_ids or None)
    own._executor = llguidance_module().LLExecutor()
    walk = tiny_llm.tokenizer.encode('{"city": "Oslo", "days": 3', add_special_tokens=False)
    for params in (SamplingParams(json_schema=SCHEMA), SamplingParams(regex="[0-9]+(\\.[0-9]+)?"), SamplingParams()):
        a, b = ahead.matcher(params), own.matcher(params)
        if a is None:
            assert b is None
            continue
        for token in walk[:6]:
            assert torch.equal(ahead.fill([a]).bits, own.fill([b]).bits)
            if not (a.consume_token(token) and b.consume_token(token)):
                break
    assert ahead._building is None and ahead._tokenizer is not None


def test_a_constrained_run_on_quantized_weights_imports_no_compiler(tiny_model, tmp_path):
    """Nothing on a direct load's path to its first answer imports torch._dynamo (about 2 s, and
    a worker thread importing it holds the GIL while the first wave's forward runs): not the
    module tree, not the masks (llguidance.torch compiles a function as it is imported)."""
    import subprocess
    import sys

    out = tmp_path / "out.jsonl"
    argv = base_args(tiny_model, out, dtype=None, regex="[0-9]{1,4}", quantize="int8")
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('dynamo imported:', 'torch._dynamo' in sys.modules, file=sys.stderr))\n"
        f"sys.argv = ['chunkgen', *{argv!r}]\n"
        "from chunkgen.entry import main\n"
        "main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(re.fullmatch("[0-9]{1,4}", r["text"]) for r in records(out))
    assert "dynamo imported: False" in proc.stderr, proc.stderr[-2000:]
