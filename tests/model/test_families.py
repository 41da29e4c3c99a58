"""Every supported family against transformers' generate: seeded tiny random-weight models built
offline from each family's config, prompts far longer than their sliding windows (windows smaller
than a chunk, equal to one and spanning several), several rows sharing a system prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chunkgen.engine import Request, SamplingParams
from chunkgen.llm import LLM
from tests.helpers import HF_ATTENTION, HOST_READS, OpLog, assert_parity, hf_greedy, template_prompts, train_tokenizer
from tests.model.families import CHUNK, FAMILIES, family_config


def _build(out: Path, family: str, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, len(tok)))
    with torch.no_grad():  # norms away from their init, so that (1 + w) against w would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if "gemma" in family else 1.0, 0.2)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity_fp32(family, family_models):
    path = family_models(family)
    llm = LLM(model=str(path), dtype="fp32", chunk_size=CHUNK, kv_memory="32MiB", max_batch=4)
    prompts = template_prompts("arithmetic_cot", 4)
    ids = [llm.encode(p) for p in prompts]
    assert min(map(len, ids)) > 8 * CHUNK  # far past every window
    results = llm.generate(prompts, SamplingParams(max_new_tokens=12))
    hf, ref = hf_greedy(path, ids, 12)
    exact = 0
    for p, r, t in zip(ids, results, ref):
        assert_parity(hf, p, r.token_ids, t)
        exact += r.token_ids == t
    assert exact >= 3, f"{family}: only {exact}/4 sequences equal token for token"
    assert sum(r.cached_tokens for r in results) > 3 * 4 * CHUNK  # the shared prompt was computed once


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_at_every_length(family, family_models):
    """The last-position logits of prompts cut at many lengths, each a prefill of its own, against
    transformers' forward over the same tokens (where rope frequencies depend on the length, as
    dynamic and longrope do, that is the call they must equal)."""
    from transformers import AutoModelForCausalLM

    path = family_models(family)
    llm = LLM(model=str(path), dtype="fp32", chunk_size=CHUNK, kv_memory="32MiB", max_batch=4)
    ids = llm.encode(template_prompts("document_qa", 1)[0])[:72]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=HF_ATTENTION)
    cuts = range(1, len(ids) + 1)  # every position: inside, at and past each window and chunk boundary
    engine = llm.new_engine()
    from chunkgen.engine.runner import PrefillItem

    for n in cuts:
        item = PrefillItem(tokens=ids[:n], start=0, write_from=0, path_slots=_slots(engine, n), want_logits=True)
        got = engine.runner.prefill([item])[0].float().cpu()
        with torch.no_grad():
            ref = hf(torch.tensor([ids[:n]])).logits[0, -1]
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=f"{family}: position {n - 1}")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_is_captured_only_where_it_decides_nothing_on_the_host(family, family_models):
    """A CUDA graph replays a step's kernels, not its host decisions: a model is graph_safe only
    where its decode forward reads nothing back (checked op by op, on the CPU), and a runner asked
    for graphs runs the others eagerly."""
    llm = LLM(
        model=str(family_models(family)), dtype="fp32", device="cpu", chunk_size=CHUNK, kv_memory="32MiB", max_batch=4
    )
    engine = llm.new_engine(enforce_eager=False)
    prompts = template_prompts("arithmetic_cot", 2)
    engine.add([Request(i, llm.encode(p), SamplingParams(max_new_tokens=4)) for i, p in enumerate(prompts)])
    while engine.num_waiting:
        engine.step()
    engine.step()  # a decode step: the forward below is the next one's
    with OpLog() as log:
        engine.runner.forward()
    names = [str(f) for f, _, _ in log.calls]
    reads_back = [n for n in names if any(op in n for op in HOST_READS)]
    assert any("chunkgen.decode_attention" in n for n in names)
    assert not (llm.model.graph_safe and reads_back), reads_back  # (a rope reading nothing back may stay eager)
    assert engine.runner.enforce_eager == (not llm.model.graph_safe)


def _slots(engine, n: int) -> list[int]:
    """Chunk slots of the pool for a path of n tokens (a standalone prefill, outside the tree)."""
    chunks = -(-n // CHUNK)
    return [engine.pool.allocate() for _ in range(chunks)]


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_greedy_parity_bf16(family, family_models):
    """bf16 against transformers in bf16: equal or a near tie at the first divergence."""
    from transformers import AutoModelForCausalLM

    path = family_models(family)
    llm = LLM(model=str(path), dtype="bf16", chunk_size=CHUNK, kv_memory="32MiB", max_batch=4)
    prompts = template_prompts("arithmetic_cot", 4)
    ids = [llm.encode(p) for p in prompts]
    results = llm.generate(prompts, SamplingParams(max_new_tokens=8))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=HF_ATTENTION)
    exact = 0
    for p, r in zip(ids, results):
        theirs = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
        assert_parity(hf, p, r.token_ids, theirs, top=5)
        exact += r.token_ids == theirs
    assert exact >= 2, f"{family} bf16: only {exact}/4 sequences equal token for token"


def test_unsupported_architecture_is_one_line_naming_the_supported(tmp_path):
    import json

    from chunkgen.model import ModelNotFound
    from chunkgen.model.loading import read_config

    path = _build(tmp_path / "m", "qwen3")
    config = json.loads((path / "config.json").read_text())
    config.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelNotFound) as err:
        read_config(path)
    message = str(err.value)
    assert "\n" not in message and "'qwen3_moe'" in message and "Qwen3MoeForCausalLM" in message
    assert "gemma3" in message and "phi3" in message  # the supported model types, by name
