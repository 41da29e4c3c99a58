"""Random-weight models from a config (--dummy-weights): the shipped configs' shapes, seeded
weights in the asked dtype, the memory check before anything is built, and a vocabulary no
tokenizer fits."""

from __future__ import annotations

import pytest
import torch

from chunkgen.engine import SamplingParams
from chunkgen.model import dummy


def test_shipped_configs_have_the_models_shapes():
    sizes = {
        name: sum(p.numel() for p in dummy._skeleton(dummy.load_config(name), torch.bfloat16).parameters())
        for name in dummy.SHIPPED
    }
    assert round(sizes["smollm2-135m"] / 1e6) == 135
    assert round(sizes["llama-3.2-1b"] / 1e9, 2) == 1.24
    assert round(sizes["llama-2-7b"] / 1e9, 2) == 6.74
    assert round(sizes["llama-3.1-8b"] / 1e9, 2) == 8.03
    assert round(sizes["qwen3-0.6b"] / 1e6) == 596 and round(sizes["qwen3-4b"] / 1e9, 2) == 4.02
    assert round(sizes["gemma-3-1b"] / 1e6) == 1000 and round(sizes["phi-3-mini"] / 1e9, 2) == 3.82
    assert dummy.weight_bytes(dummy.load_config("llama-2-7b"), torch.bfloat16) == 2 * sizes["llama-2-7b"]
    assert sorted(dummy.SHIPPED) == sorted(p.stem for p in dummy.CONFIGS.glob("*.json"))
    with pytest.raises(dummy.DummyWeightsError, match="not a shipped config"):
        dummy.config_path("llama-9")


def test_random_weights_are_seeded_and_built_in_the_asked_dtype(tiny_config):
    config = dummy.load_config(tiny_config)
    state = torch.random.get_rng_state()
    a = dummy.random_model(config, torch.bfloat16, "cpu", seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG untouched
    b = dummy.random_model(config, torch.bfloat16, "cpu", seed=3)
    c = dummy.random_model(config, torch.bfloat16, "cpu", seed=4)
    assert all(p.dtype == torch.bfloat16 for p in a.parameters())
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["model.layers.0.self_attn.q_proj.weight"], pc["model.layers.0.self_attn.q_proj.weight"])


def test_too_large_random_weights_are_refused_before_anything_is_built():
    config = dummy.load_config("llama-2-7b")
    with pytest.raises(dummy.DummyWeightsError, match=r"fp32 are 25.1 GiB.*more than the 24.0 GiB memory available"):
        dummy.check_fits(config, torch.float32, "cpu", 24 << 30)
    assert dummy.check_fits(config, torch.bfloat16, "cuda:0", 78 << 30) <= 2.1 * 12.6 * 2**30
    # in bf16 on a 24 GB machine: the build peaks near its 12.6 GiB of weights (the estimate had been 50.2 GiB)
    assert dummy.check_fits(config, torch.bfloat16, "cpu", 20 << 30) <= 1.2 * 12.6 * 2**30
    with pytest.raises(dummy.DummyWeightsError, match="transformers' copy"):
        dummy.check_fits(config, torch.bfloat16, "cuda:0", 30 << 30, copies=2)


# A build in a fresh process (in this one, memory earlier tests freed hides part of its peak):
# its peak over the resident memory before, the estimate, and the bytes its layers' products keep.
_BUILD = """
import json, sys, torch
from chunkgen.bench.e2e import PeakRSS
from chunkgen.llm import LLM
from chunkgen.model import dummy
name, invariant = sys.argv[1:]
with PeakRSS() as rss:
    start = rss.peak
    llm = LLM(dummy_weights="smollm2-135m", dtype=name, device="cpu", kv_memory="16MiB", batch_invariant=invariant)
dtype = llm.model.dtype
products = [p for layer in llm.model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
print(json.dumps({
    "peak": rss.peak - start,
    "estimate": dummy.build_bytes(dummy.load_config("smollm2-135m"), dtype, "cpu", invariant == "on"),
    "layouts": dummy.linear_layouts(dtype, invariant == "on"),
    "widened": llm.model.layers[0].gate_up.widened,
    "held": sum(p.nbytes for p in products),
    "weights": sum(p.out_features * p.in_features for p in products) * dtype.itemsize,
}))
"""


@pytest.mark.parametrize("name, invariant", [("bf16", "on"), ("fp32", "off"), ("fp16", "on")])
def test_the_memory_check_bounds_a_build_from_above_and_not_far_above(name, invariant):
    """A build keeps the layouts its products read (fp16 an fp32 copy, its weights widened; without
    batch-invariant numerics oneDNN's copy too) and releases transformers' weights as it packs
    them: the estimate counts the layouts the layers keep, is at least the build's peak, and its
    part that grows with the weights is within 1.5x of it (a 4.0x estimate refused a bf16 7B model whose build peaks at 1.03x)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _BUILD, name, invariant], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # the fixed part (imports, tokenizer) moves by 0.15 GiB between runs: the rest is held to 1.5x
    assert got["peak"] <= got["estimate"] and got["estimate"] - dummy.BUILD_FIXED <= 1.5 * got["peak"]
    per_byte, widened = got["layouts"]
    assert got["widened"] == widened and widened == (name == "fp16")
    assert got["held"] == pytest.approx(per_byte * got["weights"], rel=0.02)


def test_a_vocabulary_no_tokenizer_fits_runs_on_token_ids(tiny_config):
    from chunkgen.llm import LLM

    llm = LLM(dummy_weights=str(tiny_config), dtype="fp32", kv_memory="16MiB", chunk_size=16)
    assert llm.model_path is None and llm.model.vocab_size == 500
    assert getattr(llm.tokenizer, "ids_only", False)  # the default tokenizer's 49152 ids do not fit
    with pytest.raises(TypeError, match="token ids"):
        llm.encode("text")
    [res] = llm.generate([[5, 17, 42, 99]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(res.token_ids) == 4 and all(0 <= t < 500 for t in res.token_ids)
    assert res.text == " ".join(map(str, res.token_ids))
