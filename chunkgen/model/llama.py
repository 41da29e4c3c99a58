"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) running on the chunked KV cache.

Weights, rotary tables and activation come from the transformers model; only attention and the
cache are ours: prefill writes K/V into the pool and attends over the tree path, decode runs the
two-phase kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chunkgen.cache.context import KernelContext
from chunkgen.cache.pool import ChunkPool
from chunkgen.kernels import decode_attention

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class UnsupportedModel(ValueError):
    pass


@dataclass
class LayerWeights:
    ln_attn: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    ln_mlp: torch.Tensor
    w_gate_up: torch.Tensor
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None


def _cat_bias(*linears) -> torch.Tensor | None:
    if all(l.bias is None for l in linears):
        return None
    return torch.cat([l.bias if l.bias is not None else torch.zeros(l.out_features, dtype=l.weight.dtype)
                      for l in linears])


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
        self.num_layers = cfg.num_hidden_layers
        self.q_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.eps = cfg.rms_norm_eps
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        self.max_context = min(cfg.max_position_embeddings, window or cfg.max_position_embeddings)
        self.vocab_size = cfg.vocab_size
        from transformers.activations import ACT2FN

        self.act = ACT2FN[cfg.hidden_act]
        self.rotary = inner.rotary_emb
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        self.lm_head = hf_model.lm_head.weight.detach()
        self.layers: list[LayerWeights] = []
        with torch.no_grad():
            for layer in inner.layers:
                a, m = layer.self_attn, layer.mlp
                self.layers.append(LayerWeights(
                    ln_attn=layer.input_layernorm.weight.detach(),
                    w_qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
                    b_qkv=_cat_bias(a.q_proj, a.k_proj, a.v_proj),
                    w_o=a.o_proj.weight.detach(), b_o=a.o_proj.bias,
                    ln_mlp=layer.post_attention_layernorm.weight.detach(),
                    w_gate_up=torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),
                    b_gate_up=_cat_bias(m.gate_proj, m.up_proj),
                    w_down=m.down_proj.weight.detach(), b_down=m.down_proj.bias,
                ))
        self._q_size = self.q_heads * self.head_dim
        self._kv_size = self.kv_heads * self.head_dim

    # -- pieces shared by prefill and decode --------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * x.to(dt)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.rotary(x, positions.view(1, -1))
        return cos[0, :, None, :], sin[0, :, None, :]  # [tokens, 1, head_dim]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, x: torch.Tensor, layer: LayerWeights, cos, sin):
        t = x.shape[0]
        qkv = F.linear(self._rms(x, layer.ln_attn), layer.w_qkv, layer.b_qkv)
        q, k, v = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
        q = self._rotate(q.view(t, self.q_heads, self.head_dim), cos, sin)
        k = self._rotate(k.view(t, self.kv_heads, self.head_dim), cos, sin)
        return q, k, v.view(t, self.kv_heads, self.head_dim)

    def _finish_layer(self, x: torch.Tensor, attn: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        x = x + F.linear(attn.reshape(x.shape[0], -1), layer.w_o, layer.b_o)
        gate, up = F.linear(self._rms(x, layer.ln_mlp), layer.w_gate_up, layer.b_gate_up).chunk(2, dim=-1)
        return x + F.linear(self.act(gate) * up, layer.w_down, layer.b_down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms(x, self.norm), self.lm_head).float()

    # -- prefill ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, tokens: list[int], start: int, path_slots: list[int], pool: ChunkPool,
                write_from: int | None = None) -> torch.Tensor:
        """Run positions [start, len(tokens)) of one sequence whose K/V for [0, start) are in the
        pool along `path_slots`; K/V of positions >= write_from (default start) are stored.
        Returns the logits of the last position."""
        n = len(tokens)
        write_from = start if write_from is None else write_from
        C = pool.chunk_size
        ids = torch.tensor(tokens[start:], device=self.device)
        positions = torch.arange(start, n, device=self.device)
        w_pos = list(range(max(write_from, start), n))
        w_slots = torch.tensor([path_slots[p // C] for p in w_pos], dtype=torch.long)
        w_offs = torch.tensor([p % C for p in w_pos], dtype=torch.long)
        w_rows = slice(len(positions) - len(w_pos), None)
        prefix_slots = torch.tensor(path_slots[: -(-start // C)], dtype=torch.long)
        causal = None
        if start > 0 and n - start > 1:
            causal = torch.ones(n - start, n, dtype=torch.bool, device=self.device).tril(diagonal=start)
        x = F.embedding(ids, self.embed)
        cos, sin = self._rope(x, positions)
        group = self.q_heads // self.kv_heads
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)
            if w_pos:
                pool.write(i, w_slots, w_offs, k[w_rows], v[w_rows])
            if start > 0:
                pk, pv = pool.gather(i, prefix_slots, start)
                k_all = torch.cat([pk.to(k.dtype), k.transpose(0, 1)], dim=1)
                v_all = torch.cat([pv.to(v.dtype), v.transpose(0, 1)], dim=1)
            else:
                k_all, v_all = k.transpose(0, 1), v.transpose(0, 1)
            k_all = k_all.repeat_interleave(group, dim=0)
            v_all = v_all.repeat_interleave(group, dim=0)
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1), k_all, v_all, attn_mask=causal,
                is_causal=start == 0 and n > 1, scale=self.scale,
            )
            x = self._finish_layer(x, attn.transpose(0, 1), layer)
        return self._logits(x[-1:])[0]

    # -- decode -------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               offsets: torch.Tensor, pool: ChunkPool, ctx: KernelContext,
               chunk_first: bool | None = None) -> torch.Tensor:
        """One token per sequence, all in `ctx.order`; returns logits [batch, vocab] (fp32)."""
        x = F.embedding(tokens, self.embed)
        cos, sin = self._rope(x, positions)
        out = torch.empty(len(tokens), self.q_heads, self.head_dim, dtype=torch.float32)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)
            pool.write(i, slots, offsets, k, v)
            decode_attention(q.float().contiguous(), pool.k[i], pool.v[i], ctx, self.scale,
                             chunk_first=chunk_first, out=out)
            x = self._finish_layer(x, out.to(x.dtype), layer)
        return self._logits(x)
