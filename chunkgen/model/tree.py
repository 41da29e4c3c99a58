"""A supported family's module tree made here, as transformers' modeling code would make it, but
without importing that code: a family's modeling module took 1.4 s to import after its
configuration (it pulls in torch._dynamo and scipy), and building its tree on the meta device
more, all before a direct load's first answer, while the load only reads the tree's names and
shapes and the rotary tables.

The tree has transformers' module names, shapes and biases and its parameters on the meta device
(the output layer untied, as transformers leaves it there); the rotary module computes
cos/sin with transformers' own operations from the frequencies transformers' rope functions give.
Anything this file does not mirror (a multimodal checkpoint, rope scaling that follows the
sequence length, a transformers release without `rope_parameters`) is left to transformers' own
tree (module_tree returns None). tests/model/test_tree.py holds every family's tree equal to
transformers' in names, shapes, tying and rotary tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Family:
    attention_bias: bool | None = False  # None: the config's attention_bias
    qkv_bias: bool = False  # q, k, v (not o) with a bias whatever the config says (Qwen2)
    mlp_bias: bool | None = False  # None: the config's mlp_bias
    fused: bool = False  # qkv_proj and gate_up_proj (Phi-3)
    qk_norm: bool = False  # per-head norms of q and k (Qwen3, Gemma 3)
    gemma_norms: bool = False  # norms before and after the MLP too (Gemma 2 and 3)
    partial_rotary: bool = False  # the default rope honours partial_rotary_factor (Phi-3)
    rope_per_layer_type: bool = False  # one table per layer type (Gemma 3)


FAMILIES = {
    "LlamaForCausalLM": Family(attention_bias=None, mlp_bias=None),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(qkv_bias=True),
    "Qwen3ForCausalLM": Family(attention_bias=None, qk_norm=True),
    "Phi3ForCausalLM": Family(fused=True, partial_rotary=True),
    "Gemma2ForCausalLM": Family(attention_bias=None, gemma_norms=True),
    "Gemma3ForCausalLM": Family(attention_bias=None, qk_norm=True, gemma_norms=True, rope_per_layer_type=True),
}
# Frequencies that follow the longest position a call sees (transformers' dynamic_rope_update).
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def module_tree(config, dtype: torch.dtype) -> nn.Module | None:
    """The meta-device module tree of `config` in `dtype`, or None where transformers' own is needed."""
    archs = getattr(config, "architectures", None) or []
    family = FAMILIES.get(archs[0]) if len(archs) == 1 else None
    rope = getattr(config, "rope_parameters", None)
    if family is None or not isinstance(rope, dict):
        return None
    if family.rope_per_layer_type:
        types = getattr(config, "layer_types", None)
        tables = [rope.get(t) for t in sorted(set(types))] if types else [None]
    else:
        tables = [rope]
    if any(not _static_table(t) for t in tables):
        return None
    return CausalLM(config, dtype, family)


def _static_table(params) -> bool:
    """Whether one rope table's parameters are what this file computes: a rope type with a base,
    whose frequencies do not follow the sequence length."""
    return (
        isinstance(params, dict)
        and "rope_theta" in params
        and params.get("rope_type", "default") not in _LENGTH_DEPENDENT
    )


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Norm(nn.Module):
    """An RMS norm's weight (the forward is chunkgen's)."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta", dtype=dtype), requires_grad=False)


def _linear(n_in: int, n_out: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias, device="meta", dtype=dtype)


class Attention(nn.Module):
    def __init__(self, config, family: Family, dtype: torch.dtype) -> None:
        super().__init__()
        d, h, kv, hidden = _head_dim(config), config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        bias = config.attention_bias if family.attention_bias is None else family.attention_bias
        if family.fused:
            self.o_proj = _linear(h * d, hidden, False, dtype)
            self.qkv_proj = _linear(hidden, (h + 2 * kv) * d, False, dtype)
        else:
            qkv_bias = bias or family.qkv_bias
            self.q_proj = _linear(hidden, h * d, qkv_bias, dtype)
            self.k_proj = _linear(hidden, kv * d, qkv_bias, dtype)
            self.v_proj = _linear(hidden, kv * d, qkv_bias, dtype)
            self.o_proj = _linear(h * d, hidden, bias, dtype)
        if family.qk_norm:
            self.q_norm = Norm(d, dtype)
            self.k_norm = Norm(d, dtype)


class MLP(nn.Module):
    def __init__(self, config, family: Family, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        if family.fused:
            self.gate_up_proj = _linear(hidden, 2 * inter, False, dtype)
            self.down_proj = _linear(inter, hidden, False, dtype)
            return
        bias = config.mlp_bias if family.mlp_bias is None else family.mlp_bias
        self.gate_proj = _linear(hidden, inter, bias, dtype)
        self.up_proj = _linear(hidden, inter, bias, dtype)
        self.down_proj = _linear(inter, hidden, bias, dtype)


class Layer(nn.Module):
    def __init__(self, config, family: Family, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(config, family, dtype)
        self.mlp = MLP(config, family, dtype)
        self.input_layernorm = Norm(config.hidden_size, dtype)
        self.post_attention_layernorm = Norm(config.hidden_size, dtype)
        if family.gemma_norms:
            self.pre_feedforward_layernorm = Norm(config.hidden_size, dtype)
            self.post_feedforward_layernorm = Norm(config.hidden_size, dtype)


def _frequencies(config, params: dict, family: Family, layer_type: str | None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling) as the family's rotary module computes them."""
    kind = params.get("rope_type", "default")
    if kind != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        init = ROPE_INIT_FUNCTIONS[kind]
        return init(config, None, layer_type=layer_type) if layer_type is not None else init(config)
    dim = _head_dim(config)
    if family.partial_rotary:
        dim = int(dim * params.get("partial_rotary_factor", 1.0))
    base = params["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def _cos_sin(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float):
    # transformers' rotary forward, operation for operation (its rounding is the reference's)
    freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype=x.dtype), (emb.sin() * scaling).to(dtype=x.dtype)


class Rotary(nn.Module):
    """One table for every layer: forward(x, position_ids) -> (cos, sin) in x's dtype."""

    def __init__(self, config, family: Family) -> None:
        super().__init__()
        params = config.rope_parameters
        self.rope_type = params.get("rope_type", "default")
        inv_freq, self.attention_scaling = _frequencies(config, params, family, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _cos_sin(x, position_ids, self.inv_freq, self.attention_scaling)


class RotaryPerLayerType(nn.Module):
    """A table per layer type: forward(x, position_ids, layer_type) -> (cos, sin) in x's dtype."""

    def __init__(self, config, family: Family) -> None:
        super().__init__()
        self.rope_type, self._scaling = {}, {}
        for layer_type in sorted(set(config.layer_types)):
            params = config.rope_parameters[layer_type]
            self.rope_type[layer_type] = params.get("rope_type", "default")
            inv_freq, self._scaling[layer_type] = _frequencies(config, params, family, layer_type)
            self.register_buffer(f"{layer_type}_inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str):
        return _cos_sin(x, position_ids, getattr(self, f"{layer_type}_inv_freq"), self._scaling[layer_type])


class CausalLM(nn.Module):
    """`model` (embed_tokens, layers, norm, rotary_emb) and `lm_head`, as transformers names them."""

    def __init__(self, config, dtype: torch.dtype, family: Family) -> None:
        super().__init__()
        self.config = config
        self.generation_config = None
        self._dtype = dtype
        inner = nn.Module()
        # given its weight, the embedding skips its init: normal_ on the meta device alone imports
        # torch._dynamo (about 2 s)
        weight = torch.empty(config.vocab_size, config.hidden_size, device="meta", dtype=dtype)
        inner.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        inner.layers = nn.ModuleList(Layer(config, family, dtype) for _ in range(config.num_hidden_layers))
        inner.norm = Norm(config.hidden_size, dtype)
        inner.rotary_emb = (RotaryPerLayerType if family.rope_per_layer_type else Rotary)(config, family)
        self.model = inner
        # untied, as transformers leaves a tree it builds on the meta device: the load ties the
        # output layer to the embedding where the config says so (skeleton._fill)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return torch.device("meta")

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head
