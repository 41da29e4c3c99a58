"""chunkgen's own module tree (model/tree.py) against transformers' for every family: the same
parameter names, shapes, dtypes and biases, the same tying, and bit-identical rotary tables; and
a direct load that no longer imports transformers' modeling code."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from chunkgen.model import dummy
from chunkgen.model.tree import module_tree
from tests.model.families import FAMILIES, family_config

SHIPPED = list(dummy.SHIPPED)
# What transformers' own tree is left to: the multimodal layout, frequencies that follow the length.
LEFT_TO_TRANSFORMERS = {"gemma3-multimodal", "phi3-longrope", "llama-dynamic"}


def _transformers_tree(config, dtype):
    from chunkgen.model.skeleton import skeleton

    return skeleton(config, dtype)


def _configs():
    for family in FAMILIES:
        yield pytest.param(family, lambda f=family: family_config(f, 97), id=family)
    for name in SHIPPED:
        yield pytest.param(name, lambda n=name: dummy.load_config(n), id=name)
    import transformers as tf

    biased = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    yield pytest.param(
        "llama-biases", lambda: tf.LlamaConfig(**biased, attention_bias=True, mlp_bias=True), id="llama-biases"
    )
    yield pytest.param("qwen2", lambda: tf.Qwen2Config(**biased, num_key_value_heads=2), id="qwen2")


def _architectures(config):
    if not getattr(config, "architectures", None):  # a config made in code names no class: transformers' own
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return config


@pytest.mark.parametrize(("name", "make"), list(_configs()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_tree_is_transformers_tree(name, make, dtype):
    config = _architectures(make())
    ours = module_tree(config, dtype)
    if name in LEFT_TO_TRANSFORMERS:
        assert ours is None
        return
    assert ours is not None, name
    theirs = _transformers_tree(config, dtype)

    def params(model):
        return {n: (tuple(p.shape), p.dtype, p.device.type) for n, p in model.named_parameters(remove_duplicate=False)}

    assert params(ours) == params(theirs)
    tied = lambda m: m.get_output_embeddings().weight is m.get_input_embeddings().weight  # noqa: E731
    assert tied(ours) == tied(theirs)
    assert ours.dtype == theirs.dtype
    # the rotary tables, every layer type, positions past the original context of the scalings
    inner, hf_inner = ours.model, getattr(theirs.model, "language_model", None) or theirs.model
    x = torch.zeros(1, 4, dtype=dtype)
    positions = torch.arange(0, 3000, 7).view(1, -1)
    types = sorted(set(getattr(config, "layer_types", None) or [])) or [None]
    per_type = isinstance(inner.rotary_emb.rope_type, dict)
    for layer_type in types if per_type else [None]:
        args = (layer_type,) if per_type else ()
        for a, b in zip(inner.rotary_emb(x, positions, *args), hf_inner.rotary_emb(x, positions, *args)):
            assert a.dtype == b.dtype and torch.equal(a, b), (name, layer_type)
    assert inner.rotary_emb.rope_type == hf_inner.rotary_emb.rope_type


def test_a_direct_load_imports_no_modeling_code(tiny_model):
    """A run on quantized weights (here int8 made at load from a folder) builds chunkgen's tree."""
    code = (
        "import sys\n"
        "from chunkgen.llm import LLM\n"
        f"llm = LLM(model={str(tiny_model)!r}, dtype='fp32', quantize='int8', kv_memory='8MiB', max_batch=2)\n"
        "assert llm.generate(['hello'])[0].token_ids\n"
        "print(sorted(m for m in sys.modules if m == 'transformers.modeling_utils' or m.startswith('transformers.models.')\n"
        "             and '.modeling_' in m and not m.startswith('transformers.models.auto.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
