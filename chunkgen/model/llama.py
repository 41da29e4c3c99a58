"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) running on the chunked KV cache.

Weights, rotary tables and activation come from the transformers model; only attention and the
cache are ours: prefill writes K/V into the pool and attends over the tree path, decode runs the
two-phase kernel.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chunkgen.cache.context import ContextArrays
from chunkgen.cache.pool import ChunkPool, kv_shape
from chunkgen.kernels import decode_step_attention

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


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


class Linear:
    """y = x W^T + b. On the CPU the weight is packed once into oneDNN's blocked layout when the
    build supports it for this dtype: 1.4-2.1x faster than F.linear at decode batch sizes here
    (measured at batch 32 on the default model's shapes). CHUNKGEN_ONEDNN=0 turns it off."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed = None
        if (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
                and os.environ.get("CHUNKGEN_ONEDNN", "1") != "0"):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 32)
            except (RuntimeError, AttributeError):  # e.g. bf16 without AVX-512: plain path
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Inductor cannot lower the prepacked weight; a compiled forward packs weights itself.
        if self.packed is not None and not torch.compiler.is_compiling():
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


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


MAX_CASCADE_TOKENS = 512  # new tokens per cascade product: bounds its [heads, rows, prefix] scores


def _cascade_groups(items: list[PrefillItem], spans: list[tuple[int, int]], chunk: int):
    """[(shared full-chunk prefix or None, [(item, span), ...])]: items that read the same cached
    full chunks are grouped (at most MAX_CASCADE_TOKENS new tokens per group); others stand alone."""
    by_prefix: dict[tuple[int, ...], list] = {}
    alone = []
    for it, span in zip(items, spans):
        full = tuple(it.path_slots[: it.start // chunk])
        (by_prefix.setdefault(full, []) if full else alone).append((it, span))
    groups: list = [(None, [m]) for m in alone]
    for prefix, members in by_prefix.items():
        if len(members) == 1:
            groups.append((None, members))
            continue
        batch, tokens = [], 0
        for m in members:
            t = m[1][1] - m[1][0]
            if batch and tokens + t > MAX_CASCADE_TOKENS:
                groups.append((list(prefix), batch))
                batch, tokens = [], 0
            batch.append(m)
            tokens += t
        groups.append((list(prefix), batch))
    return groups


def _by_kv_head(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[tokens, q_heads, d] -> [kv_heads, group, tokens, d] in fp32 (query head = h * group + g)."""
    t, hq, d = q.shape
    return q.float().transpose(0, 1).reshape(kv_heads, hq // kv_heads, t, d)


def _partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float):
    """Unnormalized attention of q [Hk, G, T, d] over k, v [Hk, n, d]: (o, row max m, row sum l)."""
    hk, g, t, d = q.shape
    s = torch.matmul(q.reshape(hk, g * t, d), k.transpose(1, 2)).view(hk, g, t, -1) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1)
    p = torch.exp(s - m[..., None])
    o = torch.matmul(p.view(hk, g * t, -1), v).view(hk, g, t, d)
    return o, m, p.sum(-1)


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
        with torch.no_grad():  # decode indexes these by position: no rotary module call per step
            every = torch.arange(self.max_context, device=self.device)
            cos, sin = self._rope(self.embed[:1], every)
            self.rope_cos, self.rope_sin = cos.contiguous(), sin.contiguous()  # [positions, 1, head_dim]

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
        qkv = layer.qkv(self._rms(x, layer.ln_attn))
        q, k, v = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
        q = self._rotate(q.view(t, self.q_heads, self.head_dim), cos, sin)
        k = self._rotate(k.view(t, self.kv_heads, self.head_dim), cos, sin)
        return q, k, v.view(t, self.kv_heads, self.head_dim)

    def _finish_layer(self, x: torch.Tensor, attn: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        x = x + layer.o(attn.reshape(x.shape[0], -1))
        gate, up = layer.gate_up(self._rms(x, layer.ln_mlp)).chunk(2, dim=-1)
        return x + layer.down(self.act(gate) * up)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._rms(x, self.norm)).float()

    # -- prefill ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem], pool: ChunkPool) -> list[torch.Tensor | None]:
        """Run several sequences' uncached positions as one batch of tokens.

        Linear layers see all new tokens at once; attention runs per sequence over its cached
        prefix (read from the pool) plus its new tokens, causally. Returns last-position logits
        for the items that want them."""
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
            spans.append((row, row + n - it.start))
            row += n - it.start
        dev = self.device
        w_slots_t = torch.tensor(w_slots, dtype=torch.long)
        w_offs_t = torch.tensor(w_offs, dtype=torch.long)
        w_rows_t = torch.tensor(w_rows, dtype=torch.long, device=dev)
        groups = _cascade_groups(items, spans, C)
        x = F.embedding(torch.tensor(ids, device=dev), self.embed)
        cos, sin = self._rope(x, torch.tensor(positions, device=dev))
        attn = torch.empty(len(ids), self.q_heads, self.head_dim, dtype=x.dtype, device=dev)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)
            if w_rows:
                pool.write(i, w_slots_t, w_offs_t, k[w_rows_t], v[w_rows_t])
            for prefix, members in groups:
                if prefix is None:
                    (it, (a, b)), = members
                    attn[a:b] = self._attend_alone(i, it, q[a:b], k[a:b], v[a:b], pool)
                else:
                    self._attend_cascade(i, prefix, members, q, k, v, pool, attn)
            x = self._finish_layer(x, attn, layer)
        last = [b - 1 for (a, b), it in zip(spans, items) if it.want_logits]
        logits = iter(self._logits(x[last]) if last else ())
        return [next(logits) if it.want_logits else None for it in items]

    def _attend_alone(self, layer: int, it: PrefillItem, q, k, v, pool: ChunkPool) -> torch.Tensor:
        """One sequence: its cached prefix from the pool plus its new tokens, causal."""
        C, t, n = pool.chunk_size, len(it.tokens) - it.start, len(it.tokens)
        kn, vn = k.transpose(0, 1), v.transpose(0, 1)
        mask = None
        if it.start > 0:
            pre = torch.tensor(it.path_slots[: -(-it.start // C)], dtype=torch.long)
            pk, pv = pool.gather(layer, pre, it.start)
            kn = torch.cat([pk.to(kn.dtype), kn], dim=1)
            vn = torch.cat([pv.to(vn.dtype), vn], dim=1)
            if t > 1:
                mask = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(diagonal=it.start)
        group = self.q_heads // self.kv_heads
        # 4-D inputs with K/V expanded to every query head: torch's fused CPU attention takes only
        # that form (3-D or GQA inputs fall back to a ~6x slower path).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kn.repeat_interleave(group, 0)[None],
            vn.repeat_interleave(group, 0)[None], attn_mask=mask,
            is_causal=it.start == 0 and t > 1, scale=self.scale,
        )
        return out[0].transpose(0, 1)

    def _attend_cascade(self, layer: int, prefix: list[int], members, q, k, v, pool: ChunkPool,
                        attn: torch.Tensor) -> None:
        """Sequences whose cached prefix starts with the same full chunks: the new tokens of all of
        them attend to those chunks in one product (read once, as in the chunk-first phase), then
        to the rest of their own paths (cached chunks past the prefix, then their new tokens,
        causally) in one padded batched product; the two parts merge by log-sum-exp."""
        C, Hk, G, d = pool.chunk_size, self.kv_heads, self.q_heads // self.kv_heads, self.head_dim
        dev = q.device
        n_p = len(prefix) * C
        kp, vp = pool.gather(layer, torch.tensor(prefix, dtype=torch.long), n_p)
        rows = torch.cat([torch.arange(a, b) for _, (a, b) in members]).to(dev)  # members' new rows
        qm = _by_kv_head(q[rows], Hk)  # [Hk, G, R, d]
        o1, m1, l1 = _partial_attention(qm, kp.float(), vp.float(), None, self.scale)

        # The second part, padded to the longest member: member i has `rest` cached tokens past
        # the prefix (its own chunks) and t new ones. Keys come from one table: every member's own
        # chunks, then every new token, then a zero row that padding points at.
        owns = [it.path_slots[len(prefix) : -(-it.start // C)] for it, _ in members]
        own_slots = [slot for own in owns for slot in own]
        n_own, R = len(own_slots) * C, len(rows)
        key_idx, row_idx, rests = [], [], []
        base = off = 0
        for (it, (a, b)), own in zip(members, owns):
            t, rest = b - a, it.start - n_p
            key_idx.append(list(range(base, base + rest)) + list(range(n_own + off, n_own + off + t)))
            row_idx.append(list(range(off, off + t)))
            rests.append(rest)
            base += len(own) * C
            off += t
        T = max(len(r) for r in row_idx)
        L = max(len(kx) for kx in key_idx)
        pad_key, pad_row = n_own + R, R
        kidx = torch.tensor([kx + [pad_key] * (L - len(kx)) for kx in key_idx], dtype=torch.long, device=dev)
        ridx = torch.tensor([r + [pad_row] * (T - len(r)) for r in row_idx], dtype=torch.long, device=dev)
        M = len(members)
        zero = torch.zeros(Hk, 1, d, dtype=torch.float32, device=dev)
        new_k, new_v = k[rows].transpose(0, 1).float(), v[rows].transpose(0, 1).float()
        if own_slots:
            ok, ov = pool.gather(layer, torch.tensor(own_slots, dtype=torch.long), n_own)
            new_k, new_v = torch.cat([ok.float(), new_k], 1), torch.cat([ov.float(), new_v], 1)
        k2 = torch.cat([new_k, zero], 1)[:, kidx]  # [Hk, M, L, d]
        v2 = torch.cat([new_v, zero], 1)[:, kidx]
        q2 = torch.cat([qm, qm.new_zeros(Hk, G, 1, d)], 2)[:, :, ridx]  # [Hk, G, M, T, d]
        q2 = q2.permute(0, 2, 1, 3, 4).reshape(Hk, M, G * T, d)
        s2 = torch.matmul(q2, k2.transpose(-1, -2)).view(Hk, M, G, T, L) * self.scale
        # Query i of a member sits at position rest + i of its own part: it sees keys 0..rest+i.
        # Padded queries see at least key 0, so no row is all -inf (their output is dropped).
        limit = torch.tensor(rests, device=dev)[:, None] + torch.arange(T, device=dev)[None, :]
        visible = torch.arange(L, device=dev)[None, None, :] <= limit[:, :, None]  # [M, T, L]
        s2 = s2.masked_fill(~visible[None, :, None], float("-inf"))
        m2 = s2.amax(-1)
        p2 = torch.exp(s2 - m2[..., None])
        l2 = p2.sum(-1)
        o2 = torch.matmul(p2.view(Hk, M, G * T, L), v2).view(Hk, M, G, T, d)

        def by_member(x: torch.Tensor) -> torch.Tensor:  # [Hk, G, R, ...] -> [Hk, M, G, T, ...]
            x = torch.cat([x, x.new_zeros(x.shape[:2] + (1,) + x.shape[3:])], 2)[:, :, ridx]
            return x.transpose(1, 2)

        m1, l1, o1 = by_member(m1), by_member(l1), by_member(o1)
        m = torch.maximum(m1, m2)
        w1, w2 = torch.exp(m1 - m), torch.exp(m2 - m)
        o = (o1 * w1[..., None] + o2 * w2[..., None]) / (l1 * w1 + l2 * w2)[..., None]
        o = o.permute(1, 3, 0, 2, 4).reshape(M * T, Hk * G, d)  # [member, query, heads, d]
        real = ridx.view(-1) != pad_row
        attn[rows[ridx.view(-1)[real]]] = o[real].to(attn.dtype)

    # -- decode ----------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, step: ContextArrays, k_cache: torch.Tensor, v_cache: torch.Tensor,
               workspace: torch.Tensor, chunk_first: bool = True) -> torch.Tensor:
        """One token per row of `step` (the kernel context's arrays and the step's inputs, on the
        model's device); returns logits [rows, vocab] (fp32). A plain forward: no host data is read
        and no tensor is built from Python values, so it compiles to one graph and replays as one."""
        x = F.embedding(step.tokens, self.embed)
        cos, sin = self.rope_cos[step.positions], self.rope_sin[step.positions]
        out = torch.empty(x.shape[0], self.q_heads, self.head_dim, dtype=torch.float32, device=x.device)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)
            decode_step_attention(q.float().contiguous(), k, v, k_cache, v_cache, i, step, workspace, out,
                                  self.scale, chunk_first)
            x = self._finish_layer(x, out.to(x.dtype), layer)
        return self._logits(x)
