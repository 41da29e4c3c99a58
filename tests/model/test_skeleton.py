"""Quantized loads hold the weights once: the linear layers come straight from the quantized source
(never a float model first), and what is built equals what the float model's path built."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from chunkgen._native import native_cpu_available
from chunkgen.model import quant

pytestmark = pytest.mark.skipif(
    not native_cpu_available() or not hasattr(torch.ops.chunkgen, "quant_linear"),
    reason="chunkgen's CPU kernels are not built",
)

# A Llama of 100M linear weights (400 MB in fp32, about 75 MB as Q4_0 blocks): a load that made
# its float weights, even one layer group at a time for the whole model, would show in peak RSS.
WIDE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 2048,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def test_random_quantized_load_makes_no_float_weights(tmp_path):
    """--dummy-weights with a GGUF type: the load's peak RSS grows by about the quantized bytes,
    far below the 400 MB the float linear weights would take (a fresh process, VmHWM)."""
    (tmp_path / "config.json").write_text(json.dumps(WIDE))
    script = textwrap.dedent(
        f"""
        import resource
        from chunkgen.llm import LLM
        from chunkgen.model import dummy
        def hwm(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        config = dummy.load_config({str(tmp_path / "config.json")!r})
        dummy.tokenizer_for(config)  # what the load also reads, before the baseline
        before = hwm()
        llm = LLM(dummy_weights={str(tmp_path / "config.json")!r}, quantize="q4_0", dtype="fp32",
                  kv_memory="16MiB", max_batch=4)
        print(hwm() - before, llm.quantized)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={"CHUNKGEN_PREFAULT": "0", **_env()}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    grown, summary = out.stdout.split(maxsplit=1)
    linear_fp32 = 6 * (4 * 1024 * 1024 + 3 * 1024 * 4096) * 4 + 2048 * 1024 * 4
    assert summary.startswith("q4_0 (")
    assert int(grown) < 0.6 * linear_fp32, f"peak RSS grew {int(grown) >> 20} MiB for {linear_fp32 >> 20} MiB fp32"


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "CHUNKGEN_PREFAULT"}


@pytest.mark.real_model
def test_direct_gguf_load_equals_the_float_models_path(default_model_dir):
    """The default model loaded directly from its GGUF (--quantize auto) holds what the path
    through the float transformers model built: the same products on the same x, the same norms,
    the token embedding's rows (dequantized from the tied Q8_0 output layer) equal to
    transformers' dequantized embedding; and no linear weight is held in floats."""
    from transformers import AutoModelForCausalLM

    from chunkgen.llm import LLM
    from chunkgen.model.llama import LlamaModel, float_linear

    llm = LLM(quantize="auto", dtype="fp32", kv_memory="64MiB", max_batch=4)
    model = llm.model
    assert model.embed is None and model.quant_embed is not None  # looked up in lm_head's packed weight
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    source = quant.weight_source("auto", "cpu", default_model_dir, hf.config)
    ref = LlamaModel(hf, quant.quantized_linears(hf, source, float_linear))
    ids = torch.arange(0, model.vocab_size, 7)
    torch.testing.assert_close(model._embed(ids), hf.model.embed_tokens.weight[ids], rtol=0, atol=0)
    x = torch.randn(5, model.config.hidden_size)
    for i in (0, 17, 29):
        a, b = model.layers[i], ref.layers[i]
        torch.testing.assert_close(a.ln_attn, b.ln_attn, rtol=0, atol=0)
        torch.testing.assert_close(a.qkv(x), b.qkv(x), rtol=0, atol=0)
        torch.testing.assert_close(a.gate_up(x), b.gate_up(x), rtol=0, atol=0)
        y = torch.randn(5, model.config.intermediate_size)
        torch.testing.assert_close(a.down(y), b.down(y), rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head(x), ref.lm_head(x), rtol=0, atol=0)
    torch.testing.assert_close(model.norm, ref.norm, rtol=0, atol=0)
    products = [model.lm_head] + [p for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(p, quant.QuantLinear) for p in products)
