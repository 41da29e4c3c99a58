"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) running on the chunked KV cache.

Weights, rotary tables and activation come from the transformers model; only attention and the
cache are ours: prefill writes K/V into the pool and attends over the tree path, decode runs the
two-phase kernel.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from chunkgen._native import native, native_cpu_available
from chunkgen.cache.context import ContextArrays
from chunkgen.cache.pool import ChunkPool, kv_shape
from chunkgen.kernels import decode_step_attention
from chunkgen.kernels.elementwise import add_rms_norm, rotary, silu_mul
from chunkgen.kernels.prefill import PrefillSpan, plan_groups, prefill_attention

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


# Rotary variants whose frequencies change with the sequence length: no fixed table.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class UnsupportedModel(ValueError):
    pass


@dataclass
class PrefillItem:
    """One sequence's share of a prefill batch: K/V of [0, start) are already in the pool along
    path_slots; positions [start, len(tokens)) are computed and those >= write_from are stored."""
    tokens: list[int]
    start: int
    write_from: int
    path_slots: list[int]
    want_logits: bool = True


# Below this many weight elements oneDNN's fixed cost per call (about 15 us on Xeon, against 4 us
# for F.linear) outweighs its faster kernel: measured at batch 32 and 256, one thread, weights of
# 64x64 to 64x2048 (even at 64x2048 the two paths tie).
_ONEDNN_MIN_WEIGHT = 1 << 17
# Rows chunkgen's decode product takes (csrc/linear.h); more go to oneDNN.
_DECODE_PACKED_ROWS = 32


def decode_product_available() -> bool:
    """Whether chunkgen's bf16 decode product runs here: its CPU kernels built with, and running
    on, AMX or AVX512_BF16."""
    return native_cpu_available() and native().cpu_kernel_isa() in ("amx", "avx512_bf16")


class Linear:
    """y = x W^T + b. On the CPU the weight is packed once into oneDNN's blocked layout when the
    build supports it for this dtype and the weight is not tiny: 1.4-2.1x faster than F.linear at
    decode batch sizes here (measured at batch 32 on the default model's shapes).
    CHUNKGEN_ONEDNN=0 turns it off. A bf16 weight without bias on a CPU with AMX or AVX512_BF16 is
    also packed for chunkgen's decode product (csrc/cpu/linear.cpp), which takes calls of up to 32
    rows: it streams the weights from memory faster than oneDNN does (on the Xeon's AMX a decode
    step's linear layers 14.5-16.2 ms against 17.2-19.4, with the same results).
    CHUNKGEN_DECODE_LINEAR=0 turns it off."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.weight_t = self.weight.t()  # what F.linear multiplies by: mm/addmm on it is F.linear, one op
        self.packed = None
        if (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
                and weight.numel() >= _ONEDNN_MIN_WEIGHT and os.environ.get("CHUNKGEN_ONEDNN", "1") != "0"):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 32)
            except (RuntimeError, AttributeError):  # e.g. bf16 without AVX-512: plain path
                self.packed = None
        self.decode_packed = None
        if (weight.dtype == torch.bfloat16 and bias is None and weight.numel() >= _ONEDNN_MIN_WEIGHT
                and weight.device.type == "cpu" and decode_product_available()
                and os.environ.get("CHUNKGEN_DECODE_LINEAR", "1") != "0"):
            self.decode_packed = torch.ops.chunkgen.pack_linear.default(self.weight)
        self.out_features = self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Inductor cannot lower the prepacked weights; a compiled forward packs weights itself.
        if not torch.compiler.is_compiling():
            if self.decode_packed is not None and x.shape[0] <= _DECODE_PACKED_ROWS:
                return torch.ops.chunkgen.packed_linear.default(x, self.decode_packed, self.out_features)
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        # x is [rows, in] here: F.linear's own path for it, without its nested transpose and views
        return torch.mm(x, self.weight_t) if self.bias is None else torch.addmm(self.bias, x, self.weight_t)


@dataclass
class LayerWeights:
    ln_attn: torch.Tensor
    qkv: Linear
    o: Linear
    ln_mlp: torch.Tensor
    gate_up: Linear
    down: Linear


def _cat_bias(*linears) -> torch.Tensor | None:
    if all(l.bias is None for l in linears):
        return None
    return torch.cat([l.bias if l.bias is not None else torch.zeros(l.out_features, dtype=l.weight.dtype, device=l.weight.device)
                      for l in linears])


def context_length(cfg) -> int:
    """Tokens a sequence may hold: the position limit, or the sliding window when it is smaller."""
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    return min(cfg.max_position_embeddings, window or cfg.max_position_embeddings)


class LlamaModel:
    def __init__(self, hf_model) -> None:
        cfg = hf_model.config
        arch = (cfg.architectures or [type(hf_model).__name__])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"architecture {arch} is not supported; chunkgen runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.config = cfg
        self.generation_config = getattr(hf_model, "generation_config", None)
        self.dtype = hf_model.dtype
        self.device = hf_model.device
        inner = hf_model.model
        self.num_layers, self.kv_heads, self.head_dim = kv_shape(cfg)
        self.q_heads = cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.eps = cfg.rms_norm_eps
        self.max_context = context_length(cfg)
        self.vocab_size = cfg.vocab_size
        from transformers.activations import ACT2FN

        self.act = ACT2FN[cfg.hidden_act]
        self.rotary = inner.rotary_emb
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        self.lm_head = Linear(hf_model.lm_head.weight, None)
        self.layers: list[LayerWeights] = []
        with torch.no_grad():
            for layer in inner.layers:
                a, m = layer.self_attn, layer.mlp
                self.layers.append(LayerWeights(
                    ln_attn=layer.input_layernorm.weight.detach(),
                    qkv=Linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                               _cat_bias(a.q_proj, a.k_proj, a.v_proj)),
                    o=Linear(a.o_proj.weight, a.o_proj.bias),
                    ln_mlp=layer.post_attention_layernorm.weight.detach(),
                    gate_up=Linear(torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                                   _cat_bias(m.gate_proj, m.up_proj)),
                    down=Linear(m.down_proj.weight, m.down_proj.bias),
                ))
        self._q_size = self.q_heads * self.head_dim
        self._kv_size = self.kv_heads * self.head_dim
        self._inter = cfg.intermediate_size
        self._silu = cfg.hidden_act == "silu"  # silu_mul fuses SiLU(gate) * up; other activations run unfused
        with torch.no_grad():  # the whole table once: the rotary op indexes it by position, no rotary call per step
            table = self._rope_table()
        # [positions, 1, head_dim] in the model's dtype; None for rope types computed per call
        self.rope_cos, self.rope_sin = table or (None, None)

    # -- pieces shared by prefill and decode --------------------------------------------------
    # The forward's elementwise work runs as fused ops (kernels/elementwise.py) that round as the
    # torch compositions they replace did; the activation runs unfused when it is not SiLU.
    def _rope_table(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos, sin `[positions, 1, head_dim]` of every position, in the model's dtype (the rotary
        module's own rounding); None for rope types whose frequencies depend on the length."""
        if getattr(self.rotary, "rope_type", "default") in _LENGTH_DEPENDENT_ROPE:
            return None
        x = self.embed[:1]
        cos, sin = self.rotary(x, torch.arange(self.max_context, device=x.device)[None])
        return cos[0, :, None, :], sin[0, :, None, :]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[tokens, 1, head_dim]` of these positions, for rope types whose frequencies
        depend on the length (computed per call, no table)."""
        cos, sin = self.rotary(x, positions.view(1, -1))
        return cos[0, :, None, :], sin[0, :, None, :]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the final-normed hidden states h, in the model's dtype: a greedy step takes
        their argmax as they are (the same index as in fp32, which holds them exactly); the
        sampler converts them to fp32 for everything else."""
        return self.lm_head(h)

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
                attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Every decoder layer over the rows of x (the residual stream, updated in place), then the
        final norm: returns the normed hidden states. q `[rows, q_heads, d]` receives each layer's
        rotated queries (its dtype is the one attention takes); attend(layer, q, k, v) returns the
        attention output `[rows, q_heads * d]` in the model's dtype.

        Per layer: add_rms_norm, qkv, rotary, attention, o, add_rms_norm, gate_up, silu_mul, down.
        Each residual add is fused into the norm after it; the buffers are allocated once here."""
        rows = x.shape[0]
        h = torch.empty_like(x)
        if self.rope_cos is not None and self.rope_cos.dtype == x.dtype:
            cos, sin = self.rope_cos, self.rope_sin  # every position, indexed by the rotary op
        else:  # length-dependent frequencies: this call's rows, in row order
            cos, sin = self._rope(x, positions)
            positions = torch.arange(rows, device=x.device)
        act = torch.empty(rows, self._inter, dtype=x.dtype, device=x.device) if self._silu else None
        n_qk = self._q_size + self._kv_size
        delta = None
        for i, layer in enumerate(self.layers):
            add_rms_norm(x, delta, layer.ln_attn, self.eps, h)
            qkv = layer.qkv(h)
            rotary(qkv, positions, cos, sin, self.q_heads, self.kv_heads, q)
            k = qkv[:, self._q_size : n_qk].view(rows, self.kv_heads, self.head_dim)
            v = qkv[:, n_qk:].view(rows, self.kv_heads, self.head_dim)
            add_rms_norm(x, layer.o(attend(i, q, k, v)), layer.ln_mlp, self.eps, h)
            gate_up = layer.gate_up(h)
            if act is not None:
                silu_mul(gate_up, act)
                delta = layer.down(act)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                delta = layer.down(self.act(gate) * up)
        add_rms_norm(x, delta, self.norm, self.eps, h)
        return h

    # -- prefill ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem], pool: ChunkPool) -> list[torch.Tensor | None]:
        """Run several sequences' uncached positions as one batch of tokens.

        Linear layers see all new tokens at once; attention (kernels/prefill.py) reads each
        sequence's cached path from the pool and its new tokens causally. Returns last-position
        logits for the items that want them."""
        C = pool.chunk_size
        ids, positions, w_slots, w_offs, w_rows, spans = [], [], [], [], [], []
        row = 0
        for it in items:
            n = len(it.tokens)
            ids.extend(it.tokens[it.start :])
            positions.extend(range(it.start, n))
            for p in range(max(it.write_from, it.start), n):
                w_slots.append(it.path_slots[p // C])
                w_offs.append(p % C)
                w_rows.append(row + p - it.start)
            spans.append(PrefillSpan(it.start, it.path_slots, row, n - it.start))
            row += n - it.start
        dev = self.device
        w_slots_t = torch.tensor(w_slots, dtype=torch.long)
        w_offs_t = torch.tensor(w_offs, dtype=torch.long)
        # Usually every new row is written: then K/V go to the pool without a gather first.
        w_rows_t = None if w_rows == list(range(row)) else torch.tensor(w_rows, dtype=torch.long, device=dev)
        groups = plan_groups(spans, C, self.dtype, dev)
        x = F.embedding(torch.tensor(ids, device=dev), self.embed)
        attn = torch.empty(len(ids), self.q_heads, self.head_dim, dtype=x.dtype, device=dev)
        q = torch.empty_like(attn)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if w_rows:
                pool.write(i, w_slots_t, w_offs_t, *((k, v) if w_rows_t is None else (k[w_rows_t], v[w_rows_t])))
            prefill_attention(groups, i, q, k, v, pool, self.scale, attn)
            return attn.view(len(ids), -1)

        h = self._layers(x, torch.tensor(positions, device=dev), q, attend)
        last = [sp.row + sp.count - 1 for sp, it in zip(spans, items) if it.want_logits]
        logits = iter(self._logits(h[last]) if last else ())
        return [next(logits) if it.want_logits else None for it in items]

    # -- decode -------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, step: ContextArrays, k_cache: torch.Tensor, v_cache: torch.Tensor,
               workspace: torch.Tensor, chunk_first: bool = True) -> torch.Tensor:
        """One token per row of `step` (the kernel context's arrays and the step's inputs, on the
        model's device); returns logits [rows, vocab] in the model's dtype. A plain forward: no
        host data is read and no tensor is built from Python values, so it compiles to one graph
        and replays as one."""
        x = F.embedding(step.tokens, self.embed)
        rows = x.shape[0]
        # q and out in the model's dtype when the pool holds it (the kernel accumulates in fp32);
        # fp32 otherwise (an fp16 model's K/V are fp32 on the CPU).
        q_dtype = x.dtype if x.dtype == k_cache.dtype else torch.float32
        q = torch.empty(rows, self.q_heads, self.head_dim, dtype=q_dtype, device=x.device)
        out = torch.empty_like(q)
        flat = out.view(rows, -1)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            decode_step_attention(q, k, v, k_cache, v_cache, i, step, workspace, out, self.scale, chunk_first)
            return flat if flat.dtype == x.dtype else flat.to(x.dtype)

        return self._logits(self._layers(x, step.positions, q, attend))
