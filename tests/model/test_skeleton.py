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


@pytest.mark.parametrize("qtype", ["q4_0", "int8"])
def test_random_quantized_load_makes_no_float_weights(tmp_path, qtype):
    """--dummy-weights with a GGUF type or int8: the load's peak RSS grows by about the quantized
    bytes, far below the 400 MB the float linear weights would take (a fresh process, VmHWM)."""
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
        llm = LLM(dummy_weights={str(tmp_path / "config.json")!r}, quantize={qtype!r}, dtype="fp32",
                  kv_memory="16MiB", max_batch=4)
        print(hwm() - before, llm.quantized)
        """
    )
    grown, summary = _grown(script)
    assert summary.startswith(f"{qtype} (") and "float" not in summary
    assert grown < 0.6 * LINEAR_FP32, f"peak RSS grew {grown >> 20} MiB for {LINEAR_FP32 >> 20} MiB fp32"


LINEAR_FP32 = 6 * (4 * 1024 * 1024 + 3 * 1024 * 4096) * 4 + 2048 * 1024 * 4  # WIDE's linear weights


def _grown(script: str) -> tuple[int, str]:
    """(bytes, summary) a script prints, run in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={"CHUNKGEN_PREFAULT": "0", **_env()}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    grown, summary = out.stdout.split(maxsplit=1)
    return int(grown), summary


def _wide_folder(folder, tokenizer_from) -> None:
    """WIDE as a safetensors checkpoint in bf16 (200 MB of random weights), with a tokenizer."""
    import shutil

    from safetensors.torch import save_file

    from chunkgen.model import dummy
    from chunkgen.model.skeleton import skeleton

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(WIDE))
    model = skeleton(dummy.load_config(folder / "config.json"), torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(p.shape, generator=generator).mul_(0.02).to(torch.bfloat16)
        for name, p in model.state_dict().items()
    }
    save_file(tensors, folder / "model.safetensors")
    for file in tokenizer_from.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, folder / file.name)


def test_int8_load_from_a_folder_makes_no_float_model(tmp_path, tiny_model):
    """--quantize int8 on a safetensors checkpoint: each linear weight is read from the file, a
    slice of rows at a time, and made int8 at once: the load's peak RSS grows by about the int8
    bytes, not the 400 MB of the float model the quantization once started from (nor the 200 MB
    file: it is not kept mapped)."""
    folder = tmp_path / "wide"
    _wide_folder(folder, tiny_model)
    script = textwrap.dedent(
        f"""
        import resource
        from chunkgen.llm import LLM
        from chunkgen.model.loading import load_tokenizer
        def hwm(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        load_tokenizer({str(folder)!r})  # what the load also reads, before the baseline
        before = hwm()
        llm = LLM({str(folder)!r}, quantize="int8", dtype="fp32", kv_memory="16MiB", max_batch=4)
        print(hwm() - before, llm.quantized)
        """
    )
    grown, summary = _grown(script)
    assert summary.startswith("int8 (") and "float" not in summary
    assert grown < 0.45 * LINEAR_FP32, f"peak RSS grew {grown >> 20} MiB for {LINEAR_FP32 >> 20} MiB fp32"


@pytest.mark.parametrize("which", ["tiny_model", "tiny_qwen"])
def test_int8_load_from_a_folder_equals_int8_of_the_float_model(which, request):
    """--quantize int8 read from the safetensors tensor by tensor builds what int8 of the loaded
    float model built, bit for bit: every product (Qwen2's with biases, its output layer tied to
    the embedding), the norms and the float embedding."""
    from transformers import AutoModelForCausalLM

    from chunkgen.llm import LLM
    from chunkgen.model.llama import LlamaModel, float_linear

    folder = request.getfixturevalue(which)
    model = LLM(str(folder), quantize="int8", dtype="fp32", kv_memory="16MiB", max_batch=4).model
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = LlamaModel(hf, quant.quantized_linears(hf, quant.int8_source, float_linear))
    torch.testing.assert_close(model.embed, ref.embed, rtol=0, atol=0)
    torch.testing.assert_close(model.norm, ref.norm, rtol=0, atol=0)
    x = torch.randn(3, model.config.hidden_size)
    y = torch.randn(3, model.config.intermediate_size)
    for a, b in zip(model.layers, ref.layers, strict=True):
        torch.testing.assert_close(a.ln_attn, b.ln_attn, rtol=0, atol=0)
        for product in ("qkv", "o", "gate_up"):
            assert isinstance(getattr(a, product), quant.QuantLinear)
            torch.testing.assert_close(getattr(a, product)(x), getattr(b, product)(x), rtol=0, atol=0)
        torch.testing.assert_close(a.down(y), b.down(y), rtol=0, atol=0)
    assert isinstance(model.lm_head, quant.QuantLinear)
    torch.testing.assert_close(model.lm_head(x), ref.lm_head(x), rtol=0, atol=0)


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "CHUNKGEN_PREFAULT"}


@pytest.mark.real_model
def test_direct_gguf_load_equals_the_float_models_path(default_model_dir, tmp_path, monkeypatch):
    """The default model loaded directly from its GGUF (--quantize auto) in a fresh cache: the
    cache gets its config and tokenizer only, no float copy of any weight; the model holds what
    the path through the float transformers model built: the same products on the same x, the
    same norms (read from the GGUF, dequantized by themselves), the token embedding's rows
    (dequantized from the tied Q8_0 output layer) equal to transformers' dequantized embedding,
    no linear weight in floats; and it answers the same greedy tokens."""
    from transformers import AutoModelForCausalLM

    from chunkgen.engine import SamplingParams
    from chunkgen.llm import LLM
    from chunkgen.model.llama import LlamaModel, float_linear
    from chunkgen.model.loading import copy_size

    monkeypatch.setenv("CHUNKGEN_CACHE", str(tmp_path))
    llm = LLM(quantize="auto", dtype="fp32", kv_memory="64MiB", max_batch=4)
    assert llm.model_path.is_relative_to(tmp_path)
    assert not list(tmp_path.rglob("*.safetensors")), "a float copy of the weights was written"
    assert copy_size(tmp_path) < 8 << 20  # config, tokenizer (3.4 MiB), generation config
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
        torch.testing.assert_close(a.ln_mlp, b.ln_mlp, rtol=0, atol=0)
        torch.testing.assert_close(a.qkv(x), b.qkv(x), rtol=0, atol=0)
        torch.testing.assert_close(a.gate_up(x), b.gate_up(x), rtol=0, atol=0)
        y = torch.randn(5, model.config.intermediate_size)
        torch.testing.assert_close(a.down(y), b.down(y), rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head(x), ref.lm_head(x), rtol=0, atol=0)
    torch.testing.assert_close(model.norm, ref.norm, rtol=0, atol=0)
    products = [model.lm_head] + [p for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(p, quant.QuantLinear) for p in products)
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    params = SamplingParams(max_new_tokens=12)
    direct = [r.completions[0].token_ids for r in llm.generate(prompts, params)]
    llm.model = ref  # the float model's path, on the same engine settings
    llm.engine = llm.new_engine()
    assert [r.completions[0].token_ids for r in llm.generate(prompts, params)] == direct


@pytest.mark.real_model
def test_a_gguf_tensor_of_another_shape_than_the_config_is_refused(default_model_dir, tmp_path):
    """The GGUF is data: a tensor whose shape is not the config's is refused by name before any
    product is made (a direct load reads no float model whose loading report would say so)."""
    import shutil

    from chunkgen.llm import LLM
    from chunkgen.model import ModelNotFound

    folder = tmp_path / "edited"
    folder.mkdir()
    for file in default_model_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, folder / file.name)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 1024
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelNotFound, match=r"gate_proj.weight is 1536 x 576 in the file, 1024 x 576 in the config"):
        LLM(str(folder), quantize="auto", dtype="fp32", kv_memory="16MiB", max_batch=4)
