"""The decoder of the Llama family and its descendants (Llama 2/3, SmolLM2, Mistral, Qwen2/3,
Phi-3/4, Gemma 2/3) running on the chunked KV cache.

Weights, rotary tables and activation come from the transformers model; only attention and the
cache are ours: prefill writes K/V into the pool and attends over the tree path, decode runs the
two-phase kernel. The families differ by features, each handled in one place: q/k norms (Qwen3,
Gemma 3), fused projections in the checkpoint (Phi-3), norms of the form `1 + weight` computed in
fp32 with norms after attention and MLP as well as before (Gemma), embeddings scaled by
sqrt(hidden) (Gemma), sliding-window layers (Mistral, Phi-3, Qwen2/3 with windows, Gemma),
attention and final-logit soft-capping (Gemma 2), rotary tables per layer type (Gemma 3's local
and global bases) and partial rotary (Phi-4).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chunkgen._native import native, native_cpu_available
from chunkgen.cache.context import ContextArrays
from chunkgen.cache.pool import ChunkPool, kv_shape, language_config
from chunkgen.kernels import decode_step_attention, invariant
from chunkgen.kernels.elementwise import KVWrite, add_rms_norm, gelu_tanh_mul, rotary, silu_mul
from chunkgen.kernels.prefill import PrefillStep, prefill_attention

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
)
# Families whose norms scale by (1 + weight) in fp32 and whose embeddings are scaled by sqrt(hidden).
_GEMMA_TYPES = ("gemma2", "gemma3", "gemma3_text")


# Rotary variants whose frequencies change with the sequence length: no fixed table.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class UnsupportedModel(ValueError):
    pass


# Below this many weight elements oneDNN's fixed cost per call (several times F.linear's) outweighs
# its faster kernel: at batch 32 and 256, one thread, weights of 64x64 to 64x2048 the two paths at
# best tie.
_ONEDNN_MIN_WEIGHT = 1 << 17
# Rows chunkgen's decode product takes (csrc/linear.h) with batch-invariant numerics off; more go to
# oneDNN. In a decode step it beats oneDNN at every batch up to 256 (bf16, `bench step
# --batch-invariant off` against on: the default model's linear layers 22 against 36 ms at 64 rows,
# 84 against 93 at 256 on a Zen 5; 62.6 against 69.7 at 256 on a Xeon's AMX; fp32 level at 256).
_DECODE_PACKED_ROWS = 256
# Rows of a CPU forward whose MLP runs at once: a large prefill wave's runs in slices of them, so its
# gate/up output is a slice's (a 7B model's 2,048-token wave held 0.09 GiB of it in bf16, 0.17 in
# fp32); a slice is rows enough for every product's full speed (with batch-invariant numerics a row's
# sums are the same at any row count).
_MLP_SLICE_ROWS = 512


def decode_product_available() -> bool:
    """Whether chunkgen's bf16 decode product runs here: its CPU kernels built with, and running
    on, AMX or AVX512_BF16."""
    return native_cpu_available() and native().cpu_kernel_isa() in ("amx", "avx512_bf16")


def _register_fake_products() -> None:
    """A compiled forward (torch.compile) traces products held only in a packed layout (a load keeps
    one copy of each weight) as calls of chunkgen's own ops: their output shapes, for tracing."""
    if not native_cpu_available():
        return

    @torch.library.register_fake("chunkgen::packed_linear")
    def _(x, packed, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("chunkgen::quant_linear")
    def _(x, qs, scales, mins, kind, n, scale_d=None, min_d=None):
        return x.new_empty(x.shape[0], n)


_register_fake_products()


class Linear:
    """y = x W^T + b. On the CPU the weight is packed once into oneDNN's blocked layout when the
    build supports it for this dtype and the weight is not tiny: 1.4-2.1x faster than F.linear at
    decode batch sizes (measured at batch 32 on the default model's shapes).
    CHUNKGEN_ONEDNN=0 turns it off. A weight without bias is also packed for chunkgen's decode
    product (csrc/linear.h), which takes calls of up to 256 rows: in bf16 on a CPU with AMX or
    AVX512_BF16 (a decode step's product is bound by reading the weights, and its packing streams
    them from memory faster than oneDNN's does, with the same results); in fp32 on any CPU (FMA
    vectors of the build's width, where oneDNN's AVX2 kernels reach about half the FMA peak at
    these row counts; sums in another order, equal within fp32 rounding).
    With batch-invariant numerics (kernels/invariant.py) every call where that product runs takes
    it, whatever its rows, bias or weight size. CHUNKGEN_DECODE_LINEAR=0 turns it off."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, held_once: bool = False, invariant: bool = False
    ) -> None:
        """held_once: keep only the layouts the forward reads (the model is built for a run, not
        compared with the module it came from): with batch-invariant numerics (`invariant`) and
        chunkgen's product available, its packed copy alone; otherwise oneDNN's and, for a weight
        without bias, chunkgen's; the as-loaded weight is dropped once a packed copy serves every
        call. The caller drops its own reference (float_linear(..., held_once=True))."""
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.dtype = self.weight.dtype
        self.out_features, self.in_features = self.weight.shape
        # chunkgen's product: for decode batches (weights without bias, not tiny), and for every
        # call with batch-invariant numerics, where it is the one product whose sums for a row are
        # the same at any row count (oneDNN and torch choose their blocking, and split k, by rows).
        self.decode_packed = None
        self.decode_fast = bias is None and weight.numel() >= _ONEDNN_MIN_WEIGHT
        own_product = weight.device.type == "cpu" and os.environ.get("CHUNKGEN_DECODE_LINEAR", "1") != "0"
        # fp16 weights on the CPU (a GPU format): chunkgen's fp32 product on an fp32 copy, twice
        # their memory, serves every call. Torch's fp16 product ran about 10x slower (1536 x 576 at
        # 32 and 256 rows, Zen 5), and its order of sums is not chunkgen's to hold.
        self.widened = own_product and weight.dtype == torch.float16 and native_cpu_available()
        if self.widened:
            self.decode_packed = torch.ops.chunkgen.pack_linear.default(self.weight.float())
        elif (
            own_product
            and (weight.dtype == torch.float32 and native_cpu_available() or decode_product_available())
            and weight.dtype in (torch.float32, torch.bfloat16)
        ):
            self.decode_packed = torch.ops.chunkgen.pack_linear.default(self.weight)
        self.packed = None
        if (
            weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available()
            and weight.numel() >= _ONEDNN_MIN_WEIGHT
            and os.environ.get("CHUNKGEN_ONEDNN", "1") != "0"
            and not self.widened
            and not (held_once and invariant and self.decode_packed is not None)  # every call takes chunkgen's
        ):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 32)
            except (RuntimeError, AttributeError):  # e.g. bf16 without AVX-512: plain path
                self.packed = None
        if held_once and (self.packed is not None or self.decode_packed is not None):
            self.weight = None  # a packed copy serves every call (chunkgen's where oneDNN's is not kept)
        self.weight_t = None if self.weight is None else self.weight.t()  # mm/addmm on it is F.linear, one op

    @property
    def nbytes(self) -> int:
        """Bytes of the weight's layouts held (the float weights a load keeps)."""
        return sum(_held_bytes(t) for t in (self.weight, self.packed, self.decode_packed) if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and self.weight.is_cuda and invariant.enabled():
            return invariant.linear(x, self.weight, self.bias)
        # Inductor cannot lower the prepacked weights; a compiled forward packs weights itself.
        if not torch.compiler.is_compiling() or self.weight is None:
            if self.widened:
                y = torch.ops.chunkgen.packed_linear.default(x.float(), self.decode_packed, self.out_features)
                y = y.to(self.dtype)
                return y if self.bias is None else y.add_(self.bias)
            if self.decode_packed is not None and (
                invariant.enabled()
                or self.weight is None
                and self.packed is None
                or self.decode_fast
                and x.shape[0] <= _DECODE_PACKED_ROWS
            ):
                y = torch.ops.chunkgen.packed_linear.default(x, self.decode_packed, self.out_features)
                return y if self.bias is None else y.add_(self.bias)
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        # x is [rows, in] here: F.linear's own path for it, without its nested transpose and views
        return torch.mm(x, self.weight_t) if self.bias is None else torch.addmm(self.bias, x, self.weight_t)


def _held_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except NotImplementedError:  # oneDNN's packed tensor: an opaque reorder of the same elements
        return t.numel() * t.element_size()


@dataclass
class LayerWeights:
    ln_attn: torch.Tensor
    qkv: Linear
    o: Linear
    ln_mlp: torch.Tensor
    gate_up: Linear
    down: Linear
    window: int = 0  # sliding window of this layer (0: attends to the whole path)
    rope: str = "default"  # which rotary table (Gemma 3: one per layer type)
    q_norm: torch.Tensor | None = None  # per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn: torch.Tensor | None = None  # norms of the attention and MLP outputs (Gemma)
    post_mlp: torch.Tensor | None = None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm over the last dim with transformers' rounding: normalised in fp32, then weight times
    it in x's dtype (Llama), or (1 + weight) times it in fp32 before rounding (Gemma)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def layer_windows(cfg) -> list[int]:
    """Each layer's sliding window as transformers applies it: per `layer_types` where the config
    has them (Gemma, Qwen2/3), else `sliding_window` for every layer (Mistral, Phi-3); 0 = none."""
    window = getattr(cfg, "sliding_window", None) or 0
    types = getattr(cfg, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else 0 for t in types]
    return [window] * cfg.num_hidden_layers


def float_linear(modules: list, held_once: bool = False, invariant: bool = False) -> Linear:
    """The product of one or more nn.Linear modules fused along the outputs, on float weights.
    held_once: the modules' weights are released as soon as the product is packed (the transformers
    model cannot run afterwards), so that a load never holds a layer's weight in two layouts for
    longer than it takes to pack it (see Linear)."""
    if len(modules) == 1:
        linear = Linear(modules[0].weight, modules[0].bias, held_once, invariant)
    else:
        linear = Linear(torch.cat([m.weight for m in modules]), _cat_bias(*modules), held_once, invariant)
    if held_once:
        for m in modules:
            m.weight = None  # a tied weight (the embedding's) stays alive through the embedding
    return linear


def float_linears(held_once: bool, invariant: bool) -> LinearFactory:
    """float_linear with these settings, as a LinearFactory."""
    return lambda modules: float_linear(modules, held_once, invariant)


# Builds a layer's product from the nn.Linear modules it fuses: float_linear, or quantized weights
# (chunkgen/model/quant.py: quantized_linears).
LinearFactory = Callable[[list], Callable[[torch.Tensor], torch.Tensor]]


def _projections(attn, mlp, make: LinearFactory = float_linear):
    """The fused q/k/v and gate/up products of a layer: concatenated from the separate ones, or
    taken as they are where the checkpoint already fuses them (Phi-3)."""
    qkv = make([attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up = make([mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj])
    return qkv, gate_up


def _cat_bias(*linears) -> torch.Tensor | None:
    if all(l.bias is None for l in linears):
        return None
    return torch.cat(
        [
            l.bias if l.bias is not None else torch.zeros(l.out_features, dtype=l.weight.dtype, device=l.weight.device)
            for l in linears
        ]
    )


def context_length(cfg) -> int:
    """Tokens a sequence may hold: the position limit (a sliding window limits what a layer
    attends to, not the sequence)."""
    return cfg.max_position_embeddings


def _layer_weights(layer, window: int, rope: str, gemma: bool, make: LinearFactory = float_linear) -> LayerWeights:
    """One decoder layer's weights as the forward reads them (q/k/v and gate/up fused)."""
    a, m = layer.self_attn, layer.mlp
    qkv, gate_up = _projections(a, m, make)
    q_norm = getattr(a, "q_norm", None)
    k_norm = getattr(a, "k_norm", None)
    return LayerWeights(
        ln_attn=layer.input_layernorm.weight.detach(),
        qkv=qkv,
        o=make([a.o_proj]),
        # Gemma names the norm before the MLP pre_feedforward_layernorm and uses
        # post_attention_layernorm on the attention output
        ln_mlp=(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm).weight.detach(),
        gate_up=gate_up,
        down=make([m.down_proj]),
        window=window,
        rope=rope,
        q_norm=None if q_norm is None else q_norm.weight.detach(),
        k_norm=None if k_norm is None else k_norm.weight.detach(),
        post_attn=layer.post_attention_layernorm.weight.detach() if gemma else None,
        post_mlp=layer.post_feedforward_layernorm.weight.detach() if gemma else None,
    )


class LlamaModel:
    def __init__(self, hf_model, make_linear: LinearFactory = float_linear) -> None:
        """make_linear builds each product from its nn.Linear modules (quantized weights: quant.py)."""
        cfg = hf_model.config
        arch = (cfg.architectures or [type(hf_model).__name__])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"architecture {arch} is not supported; chunkgen runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # A multimodal checkpoint: its language model only (chunkgen takes text prompts)
        cfg = language_config(cfg)
        inner = getattr(hf_model.model, "language_model", None) or hf_model.model
        self.config = cfg
        self.generation_config = getattr(hf_model, "generation_config", None)
        self.dtype = hf_model.dtype
        # a direct load (model/skeleton.py) may leave the first parameter, the embedding, unmade
        self.device = hf_model.device if hf_model.device.type != "meta" else torch.device("cpu")
        self.num_layers, self.kv_heads, self.head_dim = kv_shape(cfg)
        self.q_heads = cfg.num_attention_heads
        gemma = cfg.model_type in _GEMMA_TYPES
        self.offset_norms = gemma
        scalar = getattr(cfg, "query_pre_attn_scalar", None)
        self.scale = (scalar if scalar else self.head_dim) ** -0.5
        self.softcap = float(getattr(cfg, "attn_logit_softcapping", None) or 0.0)
        self.final_softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)
        self.embed_scale = cfg.hidden_size**0.5 if gemma else None
        self.eps = cfg.rms_norm_eps
        self.max_context = context_length(cfg)
        self.vocab_size = cfg.vocab_size
        from transformers.activations import ACT2FN

        activation = getattr(cfg, "hidden_activation", None) or cfg.hidden_act
        self.act = ACT2FN[activation]
        self.rotary = inner.rotary_emb
        self.norm = inner.norm.weight.detach()
        self.lm_head = make_linear([hf_model.lm_head])
        # the token embedding: float rows, or rows dequantized from quantized weights as looked up
        # (the output layer's own where they are tied)
        embedding = getattr(make_linear, "embedding", None)
        self.quant_embed = embedding(inner.embed_tokens, self.lm_head) if embedding else None
        self.embed = None if self.quant_embed is not None else inner.embed_tokens.weight.detach()
        probe = torch.zeros(1, cfg.hidden_size, dtype=self.dtype, device=self.device)  # rotary's dtype, device
        windows = layer_windows(cfg)
        # Gemma 3's local layers have a rotary base of their own: transformers 5 keeps one module
        # that takes the layer type, transformers 4 a second module (rotary_emb_local).
        per_type_rope = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self._local_rotary = getattr(inner, "rotary_emb_local", None)
        types = getattr(cfg, "layer_types", None) or ["default"] * self.num_layers
        if not (per_type_rope or self._local_rotary is not None):
            types = ["default"] * self.num_layers
        with torch.no_grad():
            self.layers = [
                _layer_weights(layer, windows[i], types[i], gemma, make_linear) for i, layer in enumerate(inner.layers)
            ]
        self._q_size = self.q_heads * self.head_dim
        self._kv_size = self.kv_heads * self.head_dim
        self.hidden_size = cfg.hidden_size
        self._inter = cfg.intermediate_size
        # the fused activation * up of SiLU (silu_mul) and tanh-GELU (gelu_tanh_mul, Gemma); others unfused
        self._gated = {"silu": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}.get(activation)
        self._rope_keys = sorted({layer.rope for layer in self.layers})
        with torch.no_grad():  # the whole table once: the rotary op indexes it by position, no rotary call per step
            tables = (
                None
                if self._length_dependent_rope()
                else {
                    key: self._rope(key, probe, torch.arange(self.max_context, device=self.device))
                    for key in self._rope_keys
                }
            )
        # {rope key: (cos, sin) [positions, 1, rot_dim]} in the model's dtype; None for rope types
        # computed per call
        self.rope_tables = tables
        self._rotary_dim = self._rope(self._rope_keys[0], probe, torch.zeros(1, dtype=torch.long, device=self.device))[
            0
        ].shape[-1]
        self.kv_write_in_rotary: bool | None = None  # None: on a GPU (rotary_writes_kv)

    # -- pieces shared by prefill and decode --------------------------------------------------
    # The forward's elementwise work runs as fused ops (kernels/elementwise.py) that round as the
    # torch compositions they replace did; the activation runs unfused when it is not SiLU.
    def _length_dependent_rope(self) -> bool:
        kinds = getattr(self.rotary, "rope_type", "default")
        kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
        return any(k in _LENGTH_DEPENDENT_ROPE for k in kinds)

    @property
    def graph_safe(self) -> bool:
        """Whether a decode step may be captured as a CUDA graph: nothing in it decides on the host.
        Rope types whose frequencies follow the longest position (dynamic, longrope) read that
        position back every call, which a capture refuses: their steps run eagerly."""
        return self.rope_tables is not None

    def _rope(self, key: str, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[tokens, 1, rot_dim]` of these positions from the model's own rotary module (its
        scaling and rounding), for one layer type's table."""
        if self._local_rotary is not None:
            module = self._local_rotary if key == "sliding_attention" else self.rotary
            cos, sin = module(x, positions.view(1, -1))
        else:
            cos, sin = self.rotary(x, positions.view(1, -1), *(() if key == "default" else (key,)))
        return cos[0, :, None, :], sin[0, :, None, :]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the final-normed hidden states h, in the model's dtype: a greedy step takes
        their argmax as they are (the same index as in fp32, which holds them exactly); the
        sampler converts them to fp32 for everything else. Gemma 2 caps them as transformers does."""
        logits = self.lm_head(h)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.embed) if self.quant_embed is None else self.quant_embed(ids)
        if self.embed_scale is not None:  # Gemma: scaled by sqrt(hidden) rounded to the model's dtype
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor) -> None:
        """x += delta (the residual stream, in place), out = norm(x)."""
        add_rms_norm(x, delta, weight, self.eps, out, self.offset_norms)

    def _qk_norm(self, qkv: torch.Tensor, layer: LayerWeights) -> None:
        """Per-head RMSNorm of the q and k heads of qkv, in place, before rotary."""
        rows, d = qkv.shape[0], self.head_dim
        q = qkv[:, : self._q_size].view(rows, self.q_heads, d)
        k = qkv[:, self._q_size : self._q_size + self._kv_size].view(rows, self.kv_heads, d)
        q.copy_(_rms(q, layer.q_norm, self.eps, self.offset_norms))
        k.copy_(_rms(k, layer.k_norm, self.eps, self.offset_norms))

    def _partial_rotary(
        self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor
    ) -> None:
        """Rotary on the first rot_dim dims of each head only (Phi-4's partial_rotary_factor), as
        transformers does: k in place, q into q_out."""
        rows, d, rot = qkv.shape[0], self.head_dim, cos.shape[-1]
        c, s_ = cos[positions], sin[positions]  # [rows, 1, rot]

        def turn(x: torch.Tensor) -> torch.Tensor:
            r = x[..., :rot]
            half = torch.cat((-r[..., rot // 2 :], r[..., : rot // 2]), dim=-1)
            return torch.cat((r * c + half * s_, x[..., rot:]), dim=-1)

        q = qkv[:, : self._q_size].view(rows, self.q_heads, d)
        k = qkv[:, self._q_size : self._q_size + self._kv_size].view(rows, self.kv_heads, d)
        q_out.copy_(turn(q))
        k.copy_(turn(k))

    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        q: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        kv_write: Callable[[int], KVWrite] | None = None,
    ) -> torch.Tensor:
        """Every decoder layer over the rows of x (the residual stream, updated in place), then the
        final norm: returns the normed hidden states. q `[rows, q_heads, d]` receives each layer's
        rotated queries (its dtype is the one attention takes); attend(layer, q, k, v) returns the
        attention output `[rows, q_heads * d]` in the model's dtype. kv_write(layer), given where
        `rotary_writes_kv`: where the rotary op stores the layer's K/V.

        Per layer: add_rms_norm, qkv, (q/k norm), rotary, attention, o, (post norm), add_rms_norm,
        gate_up, activation * up, down, (post norm). Each residual add is fused into the norm after
        it; the buffers are allocated once here."""
        rows = x.shape[0]
        h = torch.empty_like(x)
        if self.rope_tables is not None and self.rope_tables[self._rope_keys[0]][0].dtype == x.dtype:
            tables = self.rope_tables  # every position, indexed by the rotary op
        else:  # length-dependent frequencies: this call's rows, in row order
            tables = {key: self._rope(key, x, positions) for key in self._rope_keys}
            positions = torch.arange(rows, device=x.device)
        slice_rows = rows if x.device.type != "cpu" else min(rows, _MLP_SLICE_ROWS)
        act = torch.empty(slice_rows, self._inter, dtype=x.dtype, device=x.device) if self._gated else None
        mlp_out = torch.empty_like(x) if slice_rows < rows else None
        post = torch.empty_like(x) if self.layers[0].post_attn is not None else None  # Gemma's post-norms' output
        n_qk = self._q_size + self._kv_size
        delta = None
        for i, layer in enumerate(self.layers):
            self._add_norm(x, delta, layer.ln_attn, h)
            qkv = layer.qkv(h)
            cos, sin = tables[layer.rope]
            if self._rotary_dim == self.head_dim:  # the q/k norms, where there are, fused into rotary
                rotary(
                    qkv,
                    positions,
                    cos,
                    sin,
                    self.q_heads,
                    self.kv_heads,
                    q,
                    layer.q_norm,
                    layer.k_norm,
                    self.eps,
                    self.offset_norms,
                    None if kv_write is None else kv_write(i),
                )
            else:
                if layer.q_norm is not None:
                    self._qk_norm(qkv, layer)
                self._partial_rotary(qkv, positions, cos, sin, q)
            k = qkv[:, self._q_size : n_qk].view(rows, self.kv_heads, self.head_dim)
            v = qkv[:, n_qk:].view(rows, self.kv_heads, self.head_dim)
            attn = layer.o(attend(i, q, k, v))
            if layer.post_attn is not None:
                add_rms_norm(attn, None, layer.post_attn, self.eps, post, offset=True)
                attn = post
            self._add_norm(x, attn, layer.ln_mlp, h)
            if mlp_out is None:
                delta = self._mlp(layer, h, act)
            else:
                for r0 in range(0, rows, slice_rows):
                    r1 = min(rows, r0 + slice_rows)
                    mlp_out[r0:r1] = self._mlp(layer, h[r0:r1], None if act is None else act[: r1 - r0])
                delta = mlp_out
            if layer.post_mlp is not None:
                add_rms_norm(delta, None, layer.post_mlp, self.eps, post, offset=True)
                delta = post
        self._add_norm(x, delta, self.norm, h)
        return h

    def _mlp(self, layer: LayerWeights, h: torch.Tensor, act: torch.Tensor | None) -> torch.Tensor:
        """down(activation(gate) * up) of h's rows; `act` (h's rows) receives the gated product."""
        gate_up = layer.gate_up(h)
        if act is not None:
            self._gated(gate_up, act)
            return layer.down(act)
        gate, up = gate_up.chunk(2, dim=-1)
        return layer.down(self.act(gate) * up)

    # -- prefill ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, step: PrefillStep, pool: ChunkPool) -> torch.Tensor | None:
        """A prefill wave (the runner's `PrefillStep`: several sequences' uncached positions as one
        batch of tokens). Linear layers see all new tokens at once; attention (kernels/prefill.py)
        reads each sequence's cached path from the pool and its new tokens causally. Returns the
        logits of `step.logit_rows`, or None when no row wants them."""
        h = self.prefill_hidden(step, pool)
        return self._logits(h[step.logit_rows]) if step.logit_rows else None

    @torch.inference_mode()
    def prefill_hidden(self, step: PrefillStep, pool: ChunkPool) -> torch.Tensor:
        """The wave's final-normed hidden states, every row: a scored prompt reads its tokens'
        logprobs off them (`_logits` of the rows it wants, a slice at a time)."""
        rows = step.tokens.numel()
        x = self._embed(step.tokens)
        attn = torch.empty(rows, self.q_heads, self.head_dim, dtype=x.dtype, device=x.device)
        q = torch.empty_like(attn)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self._prefill_attend(step, pool, i, q, k, v, attn)
            return attn.view(rows, -1)

        return self._layers(x, step.positions, q, attend)

    def _prefill_attend(
        self,
        step: PrefillStep,
        pool: ChunkPool,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Layer i of a wave's attention: its new K/V stored in the pool, then out[rows] over each
        sequence's path (kernels/prefill.py)."""
        if step.writes:
            rows_kv = (k, v) if step.write_rows is None else (k[step.write_rows], v[step.write_rows])
            pool.write(i, step.write_at, *rows_kv)
        prefill_attention(
            step.groups,
            i,
            q,
            k,
            v,
            pool,
            self.scale,
            out,
            window=self.layers[i].window,
            softcap=self.softcap,
            lone=step.lone,
            varlen=step.varlen,
        )

    def mixes(self, k_cache: torch.Tensor) -> bool:
        """Whether a decode step and a prefill wave can run as one forward over this pool: their
        queries must share a dtype (decode takes fp32 queries where the pool's dtype is not the
        model's; prefill always the model's)."""
        return self.dtype in (k_cache.dtype, torch.float32)

    @torch.inference_mode()
    def mixed_hidden(
        self,
        step: ContextArrays,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        workspace: torch.Tensor,
        chunk_first: bool,
        wave: PrefillStep,
        pool: ChunkPool,
    ) -> torch.Tensor:
        """A decode step and a prefill wave in one forward: the final-normed hidden states of the
        step's rows (padded to its bucket) followed by the wave's. Every linear layer reads its
        weights once for both; attention runs apart (each part as in `decode` and `prefill_hidden`),
        so each row's numbers are what the separate forwards give it."""
        d_rows = step.tokens.numel()
        x = torch.cat([self._embed(step.tokens), self._embed(wave.tokens)])
        positions = torch.cat([step.positions.to(wave.positions.dtype), wave.positions])
        rows = x.shape[0]
        q = torch.empty(rows, self.q_heads, self.head_dim, dtype=x.dtype, device=x.device)
        out = torch.empty_like(q)
        fused = self.rotary_writes_kv(x.device)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            decode_step_attention(
                q[:d_rows],
                k[:d_rows],
                v[:d_rows],
                k_cache,
                v_cache,
                i,
                step,
                workspace,
                out[:d_rows],
                self.scale,
                chunk_first,
                window=self.layers[i].window,
                softcap=self.softcap,
                store_kv=not fused,
            )
            self._prefill_attend(wave, pool, i, q[d_rows:], k[d_rows:], v[d_rows:], out[d_rows:])
            return out.view(rows, -1)

        def kv_write(i: int) -> KVWrite:  # the step's rows, the first d_rows: the wave's are stored apart
            return KVWrite(k_cache, v_cache, i, step.write_slot, step.write_offset)

        return self._layers(x, positions, q, attend, kv_write if fused else None)

    def rotary_writes_kv(self, device: torch.device) -> bool:
        """Whether a decode step's K/V go to the pool from the rotary op, not from the decode op.
        On a GPU it saves a kernel a layer; the CPU's decode kernel stores a row's K/V as it reads
        the row's last chunk, while its lines are in cache. Models with partial rotary (their q and
        k rotate in torch) keep the decode op's write. `kv_write_in_rotary` set on the model
        overrides the device's choice (tests run the GPU's data flow on the CPU)."""
        chosen = self.kv_write_in_rotary if self.kv_write_in_rotary is not None else device.type == "cuda"
        return chosen and self._rotary_dim == self.head_dim

    # -- decode -------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(
        self,
        step: ContextArrays,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        workspace: torch.Tensor,
        chunk_first: bool = True,
    ) -> torch.Tensor:
        """One token per row of `step` (the kernel context's arrays and the step's inputs, on the
        model's device); returns logits [rows, vocab] in the model's dtype. A plain forward: no
        host data is read and no tensor is built from Python values, so it compiles to one graph
        and replays as one."""
        x = self._embed(step.tokens)
        rows = x.shape[0]
        # q and out in the model's dtype when the pool holds it (the kernel accumulates in fp32);
        # fp32 otherwise (an fp16 model's K/V are fp32 on the CPU).
        q_dtype = x.dtype if x.dtype == k_cache.dtype else torch.float32
        q = torch.empty(rows, self.q_heads, self.head_dim, dtype=q_dtype, device=x.device)
        out = torch.empty_like(q)
        flat = out.view(rows, -1)
        fused = self.rotary_writes_kv(x.device)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            decode_step_attention(
                q,
                k,
                v,
                k_cache,
                v_cache,
                i,
                step,
                workspace,
                out,
                self.scale,
                chunk_first,
                window=self.layers[i].window,
                softcap=self.softcap,
                store_kv=not fused,
            )
            return flat if flat.dtype == x.dtype else flat.to(x.dtype)

        def kv_write(i: int) -> KVWrite:
            return KVWrite(k_cache, v_cache, i, step.write_slot, step.write_offset)

        return self._logits(self._layers(x, step.positions, q, attend, kv_write if fused else None))
