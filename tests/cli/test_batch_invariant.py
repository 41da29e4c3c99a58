"""The same rows give bit-identical answers and logprobs whatever else runs beside them: any
--max-batch, prefix or input order, sharded, resumed after a kill, prefixes from the cache or
computed in the same wave; fp32 and bf16, on randomized prompt trees (tiny random models: a Llama,
and models with sliding-window layers and soft-capped attention)."""

from __future__ import annotations

import json
import random

import pytest

from tests.helpers import base_args, records, run_cli

WORDS = "ticket printer password reset invoice refund shipping order late broken screen cable login".split()


def _rows(seed: int, n: int) -> list[str]:
    """OpenAI rows over a random tree: a few system prompts of random lengths, user turns that
    extend each other's openings, some exact repeats."""
    rnd = random.Random(seed)
    systems = [" ".join(rnd.choice(WORDS) for _ in range(rnd.randrange(10, 90))) for _ in range(3)]
    stems = [" ".join(rnd.choice(WORDS) for _ in range(rnd.randrange(0, 30))) for _ in range(4)]
    rows, users = [], []
    for i in range(n):
        if users and rnd.random() < 0.15:
            sys_, user = rnd.choice(users)
        else:
            sys_ = rnd.choice(systems)
            user = rnd.choice(stems) + " " + " ".join(rnd.choice(WORDS) for _ in range(rnd.randrange(1, 20)))
        users.append((sys_, user))
        body = {"messages": [{"role": "system", "content": sys_}, {"role": "user", "content": user}]}
        rows.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    return rows


def _answers(path) -> dict:
    out = {}
    for r in records(path):
        body = r["response"]["body"]["choices"][0]
        out[r["custom_id"]] = (body["message"]["content"], json.dumps(body.get("logprobs")))
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_answers_are_bit_identical_across_batches_orders_shards_and_resume(tiny_model, tmp_path, dtype):
    queries = tmp_path / "rows.jsonl"
    queries.write_text("\n".join(_rows({"fp32": 7, "bf16": 8, "fp16": 9}[dtype], 40)) + "\n")

    def run(out: str, *extra: str):
        args = base_args(tiny_model, tmp_path / out, queries, None, max_new_tokens=6, dtype=dtype, logprobs=2,
                         format="openai", batch_invariant="on") + list(extra)  # fmt: skip
        res = run_cli(*args)
        assert res.exit_code == 0, res.output
        return tmp_path / out

    base = _answers(run("b1.jsonl", "--max-batch", "1"))
    assert len(base) == 40
    assert _answers(run("b7.jsonl", "--max-batch", "7")) == base
    assert _answers(run("b32.jsonl", "--max-batch", "32", "--order", "input")) == base
    shards = {**_answers(run("s0.jsonl", "--max-batch", "32", "--shard", "0/2")),
              **_answers(run("s1.jsonl", "--max-batch", "32", "--shard", "1/2"))}  # fmt: skip
    assert shards == base
    # A run killed after some answers (its output cut there) and resumed at another batch.
    part = tmp_path / "part.jsonl"
    part.write_text("".join(l + "\n" for l in (tmp_path / "b32.jsonl").read_text().splitlines()[:9]))
    assert _answers(run("part.jsonl", "--max-batch", "5", "--resume")) == base


# Tiny families of tests/model/families.py with what the prefill must mask: a Mistral whose every
# layer has a 20-token window (across 16-token chunks), a Gemma 2 with a 10-token window on
# alternate layers and soft-capped attention scores everywhere.
MASKED_FAMILIES = ["mistral", "gemma2"]


@pytest.mark.parametrize("family", MASKED_FAMILIES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_windowed_and_capped_models_answer_the_same_at_any_batch(family_models, tmp_path, family, dtype):
    queries = tmp_path / "rows.jsonl"
    queries.write_text("\n".join(_rows(11, 24)) + "\n")

    def run(out: str, *extra: str) -> dict:
        args = base_args(family_models(family), tmp_path / out, queries, None, max_new_tokens=4, dtype=dtype,
                         logprobs=2, format="openai", batch_invariant="on") + list(extra)  # fmt: skip
        res = run_cli(*args)
        assert res.exit_code == 0, res.output
        return _answers(tmp_path / out)

    base = run("b1.jsonl", "--max-batch", "1")
    assert len(base) == 24
    assert run("b7.jsonl", "--max-batch", "7") == base
    assert run("b32.jsonl", "--max-batch", "32", "--order", "input") == base


@pytest.mark.parametrize("family", ["llama"] + MASKED_FAMILIES)
def test_a_warm_cache_gives_the_same_numbers(tiny_model, family_models, family):
    from chunkgen.engine.params import SamplingParams
    from chunkgen.llm import LLM

    model = tiny_model if family == "llama" else family_models(family)

    rnd = random.Random(3)
    system = " ".join(rnd.choice(WORDS) for _ in range(60))
    prompts = [system + " " + " ".join(rnd.choice(WORDS) for _ in range(rnd.randrange(1, 25))) for _ in range(12)]
    params = SamplingParams(max_new_tokens=5, logprobs=1)
    for dtype in ("fp32", "bf16"):
        llm = LLM(model=str(model), dtype=dtype, chunk_size=16, kv_memory="64MiB", max_batch=16, batch_invariant="on")
        fresh = [(r.token_ids, [t.logprob for t in r.completions[0].logprobs]) for r in llm.generate(prompts, params)]
        llm.generate(prompts[:3], params)  # the system prompt and three rows' prompts now cached
        warm = [(r.token_ids, [t.logprob for t in r.completions[0].logprobs]) for r in llm.generate(prompts, params)]
        llm.engine = llm.new_engine(max_batch=1)  # one row at a time, in reverse order
        alone = [
            (r.token_ids, [t.logprob for t in r.completions[0].logprobs])
            for p in prompts[::-1]
            for r in llm.generate([p], params)
        ][::-1]
        assert warm == fresh and alone == fresh, dtype


def test_the_option_is_checked_and_resolved(tiny_model, tmp_path):
    from chunkgen.config import Config, OptionError

    assert Config.resolve(device="cpu").batch_invariant is True  # the default
    assert Config.resolve(device="cpu", batch_invariant="on").batch_invariant is True
    assert Config.resolve(device="cpu", batch_invariant="off").batch_invariant is False
    assert Config.resolve(device="cpu", batch_invariant="auto").batch_invariant is True
    assert "batch_invariant" in Config.resolve(device="cpu").auto
    assert "batch_invariant" not in Config.resolve(device="cpu").replace(batch_invariant="on").auto
    with pytest.raises(OptionError, match="auto, on or off"):
        Config.resolve(device="cpu", batch_invariant="maybe")
