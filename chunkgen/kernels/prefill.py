"""Prefill attention over the prefix tree: the new tokens of a wave attend to their cached paths
(read from the pool) and to each other, causally.

Sequences of a wave whose cached paths start with the same full chunks form a group. Their new
tokens attend to those shared chunks in one product (the chunks are read once, as in the decode
kernel's chunk-first phase), then each to the rest of its own path in one padded, masked batch;
the two normalized parts merge by their log-sum-exp. Both products are fused (flash) attention
in the model's dtype with fp32 softmax state.

On a GPU both go through torch's memory-efficient kernel, which returns the log-sum-exp
(`fused_attention_lse`). The shared prefix's product folds the GQA group into the query rows, so
the prefix K/V are read once per KV head. A wave's lone sequences (every sequence of a wave that
shares nothing cached, and with batch-invariant numerics every sequence) run as one
variable-length causal product a layer instead, and in fp16 and bf16 so do the groups, as two
more (kernels/varlen.py): a few kernels a layer for the whole wave.

On the CPU: chunkgen's own kernel in bf16 on AMX or AVX512_BF16 (csrc/cpu/prefill_attention.cpp),
torch's otherwise. A group's shared prefix is read in place from the pool by the decode kernel's
chunk-first code (csrc/cpu/prefix_attention.cpp) in fp32, and in bf16 on the same paths; in fp32 a
lone sequence (a long shared prompt's first wave) reads its whole path there too, causally, new
tokens included (they are stored before attention), in one product: on an AVX2 build 71% of the
FMA peak against torch's kernel's 57% on a 6,144-token prompt (7.9 against 9.9 s for its 30
layers, Zen 4). No score matrix is materialized, no K/V is expanded to every query head, and
everything that depends only on the wave's shape is planned once, not once per layer.

Sliding-window layers and attention soft-capping: where a lone sequence's whole path is read in
place (in fp32, and in bf16 with batch-invariant numerics: every sequence of the wave) the same
product takes them as the decode kernel does, each position from the first chunk its window
reaches, its scores capped; so a row's bits stay its own whatever the wave. Everything else (a
group of several members, bf16 without batch-invariant numerics, the GPU) takes a plain torch path
instead of the fused kernels (neither torch's flash kernel nor chunkgen's bf16 one caps scores):
scores in fp32 by blocks of queries, masked by position. A group's prefix chunks that end before
the window of its earliest query (so of every member's) are not gathered or read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkgen._native import native, native_cpu_available
from chunkgen.cache.pool import ChunkPool, WriteIndices
from chunkgen.kernels import invariant
from chunkgen.kernels.varlen import VarlenWave, wave_attention

MAX_GROUP_TOKENS = 512  # new tokens per group: bounds the padded own-part batch


@dataclass
class PrefillSpan:
    """One sequence of a wave: K/V of its first `start` tokens are in the pool along `path_slots`;
    its new tokens are rows [row, row + count) of the wave."""

    start: int
    path_slots: list[int]
    row: int
    count: int


@dataclass
class Group:
    """Sequences that read the same cached chunks first (a lone sequence: its whole cached path)."""

    rows: torch.Tensor  # [R] the members' new rows in the wave
    contiguous: tuple[int, int] | None  # (a, b) when rows == range(a, b)
    prefix_slots: torch.Tensor  # cached chunks every member reads
    prefix_len: int  # tokens of them (0: none)
    # The own part, only for groups of several members (a lone sequence's is plain causal).
    own_slots: torch.Tensor | None  # every member's cached chunks past the prefix
    own_len: int  # tokens gathered from own_slots
    key_idx: torch.Tensor | None  # [M, L] into (own keys, new keys, one zero row)
    query_idx: torch.Tensor | None  # [M, T] into the group's rows (R: padding)
    mask: torch.Tensor | None  # [M, 1, T, L] additive, the model's dtype
    real: torch.Tensor | None  # positions of [M * T] that are real queries, in row order
    positions: torch.Tensor | None = None  # [R] each row's position in its sequence (for windows)
    # A lone sequence's chunks up to its last new token: int32 on the host for the CPU's in-place
    # kernels, int64 on the device elsewhere (gathered whole: _whole_path).
    path_slots: torch.Tensor | None = None
    path: list[int] | None = None  # the same chunks as a list (planning a VarlenWave)
    members: list[PrefillSpan] | None = None  # a group's sequences (planning a VarlenWave)


@dataclass
class PrefillStep:
    """A prefill wave's inputs on the model's device, prepared by the runner: the new tokens and
    their positions, where their K/V go in the pool, the attention plan, and the rows whose logits
    are wanted (each sequence's last)."""

    tokens: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    write_at: WriteIndices  # pool slot and offset of every stored row (a row before write_from is not)
    write_rows: torch.Tensor | None  # the stored rows, None when every row is stored (no gather)
    writes: bool
    groups: list[Group]
    logit_rows: list[int]
    lone: LoneSpans | None = None  # the lone groups as one causal product a layer (lone_spans)
    varlen: VarlenWave | None = None  # off the CPU: lone sequences, and groups, as varlen products


@dataclass
class LoneSpans:
    """A wave's lone sequences as one native causal_attention call a layer (planned once a wave):
    spans int64 [N, 4] of (first row, rows, first position, offset into slots), in row order, and
    slots (int32) every one's path in turn."""

    spans: torch.Tensor
    slots: torch.Tensor


def lone_spans(groups: list[Group]) -> LoneSpans | None:
    """The lone groups of a wave (each sequence attended over its whole path; with batch-invariant
    numerics every sequence of the wave), or None where there are none."""
    lone = sorted((g for g in groups if g.key_idx is None), key=lambda g: g.contiguous[0])
    if not lone:
        return None
    spans, at = [], 0
    for g in lone:
        a, b = g.contiguous
        spans.append((a, b - a, g.prefix_len, at))
        at += len(g.path_slots)
    return LoneSpans(torch.tensor(spans, dtype=torch.long), torch.cat([g.path_slots for g in lone]))


def plan_groups(
    spans: list[PrefillSpan], chunk: int, dtype: torch.dtype, device: torch.device, alone: bool = False
) -> list[Group]:
    """Everything about a wave's attention that is the same in every layer. alone: every sequence
    its own group, attended over its whole path (batch-invariant numerics: what a sequence reads
    and in which order does not depend on the wave's other members)."""
    if alone:
        return [_lone(sp, chunk, device) for sp in spans]
    by_prefix: dict[tuple[int, ...], list[PrefillSpan]] = {}
    alone_spans: list[PrefillSpan] = []
    for sp in spans:
        full = tuple(sp.path_slots[: sp.start // chunk])
        (by_prefix.setdefault(full, []) if full else alone_spans).append(sp)
    groups = [_lone(sp, chunk, device) for sp in alone_spans]
    groups += _grouped(by_prefix, chunk, dtype, device)
    return groups


def _grouped(
    by_prefix: dict[tuple[int, ...], list[PrefillSpan]], chunk: int, dtype: torch.dtype, device: torch.device
) -> list[Group]:
    groups: list[Group] = []
    for prefix, members in by_prefix.items():
        if len(members) == 1:
            groups.append(_lone(members[0], chunk, device))
            continue
        batch: list[PrefillSpan] = []
        tokens = 0
        for sp in members:
            if batch and tokens + sp.count > MAX_GROUP_TOKENS:
                groups.append(_shared(list(prefix), batch, chunk, dtype, device))
                batch, tokens = [], 0
            batch.append(sp)
            tokens += sp.count
        groups.append(
            _shared(list(prefix), batch, chunk, dtype, device) if len(batch) > 1 else _lone(batch[0], chunk, device)
        )
    return groups


def _slots(slots: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.long, device=device)


def _lone(sp: PrefillSpan, chunk: int, device: torch.device) -> Group:
    path = sp.path_slots[: -(-(sp.start + sp.count) // chunk)]
    return Group(
        rows=torch.arange(sp.row, sp.row + sp.count, device=device),
        contiguous=(sp.row, sp.row + sp.count),
        prefix_slots=_slots(sp.path_slots[: -(-sp.start // chunk)], device),
        prefix_len=sp.start,
        own_slots=None,
        own_len=0,
        key_idx=None,
        query_idx=None,
        mask=None,
        real=None,
        positions=torch.arange(sp.start, sp.start + sp.count, device=device),
        path_slots=(
            torch.tensor(path, dtype=torch.int32) if torch.device(device).type == "cpu" else _slots(path, device)
        ),
        path=path,
    )


def _shared(
    prefix: list[int], members: list[PrefillSpan], chunk: int, dtype: torch.dtype, device: torch.device
) -> Group:
    # Member i has `rest` cached tokens past the prefix (its own chunks) and t new ones. Keys come
    # from one table: every member's own chunks, then every new token, then a zero row that
    # padding points at.
    n_p = len(prefix) * chunk
    owns = [sp.path_slots[len(prefix) : -(-sp.start // chunk)] for sp in members]
    own_slots = [slot for own in owns for slot in own]
    n_own, R = len(own_slots) * chunk, sum(sp.count for sp in members)
    key_idx, query_idx, rests = [], [], []
    base = off = 0
    for sp, own in zip(members, owns):
        rest = sp.start - n_p
        key_idx.append(list(range(base, base + rest)) + list(range(n_own + off, n_own + off + sp.count)))
        query_idx.append(list(range(off, off + sp.count)))
        rests.append(rest)
        base += len(own) * chunk
        off += sp.count
    T = max(len(r) for r in query_idx)
    L = max(len(k) for k in key_idx)
    kidx = torch.tensor([k + [n_own + R] * (L - len(k)) for k in key_idx], dtype=torch.long)
    qidx = torch.tensor([r + [R] * (T - len(r)) for r in query_idx], dtype=torch.long)
    # Query i of a member sits at position rest + i of its own part: it sees keys 0..rest+i.
    # Padded queries see key 0, so no row is empty (their output is dropped).
    limit = torch.tensor(rests)[:, None] + torch.arange(T)[None, :]
    visible = torch.arange(L)[None, None, :] <= limit[:, :, None]  # [M, T, L]
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))[:, None]
    rows = torch.cat([torch.arange(sp.row, sp.row + sp.count) for sp in members])
    first, last = members[0].row, members[-1].row + members[-1].count
    contiguous = (first, last) if torch.equal(rows, torch.arange(first, last)) else None
    return Group(
        rows=rows.to(device),
        contiguous=contiguous,
        prefix_slots=_slots(prefix, device),
        prefix_len=n_p,
        own_slots=_slots(own_slots, device) if own_slots else None,
        own_len=n_own,
        key_idx=kidx.to(device),
        query_idx=qidx.to(device),
        mask=mask.to(device),
        real=(qidx.view(-1) != R).nonzero().view(-1).to(device),
        positions=torch.cat([torch.arange(sp.start, sp.start + sp.count) for sp in members]).to(device),
        members=members,
    )


def _own_kernel() -> bool:
    """Whether bf16 products go to chunkgen's kernel: on its AMX and AVX512_BF16 paths, where it
    beats torch's fused kernel (on Zen 4, AVX512_BF16 without AMX: 2-2.8x on a 2,048-token causal
    pass and on 640-5,120 queries over 2,048 keys). CHUNKGEN_CPU_ISA=fp32 turns it off."""
    return native_cpu_available() and native().cpu_kernel_isa() in ("amx", "avx512_bf16")


def _prefix_in_place(q: torch.Tensor, pool: ChunkPool) -> bool:
    """Whether a group's prefix product reads the pool in place with the decode kernel's chunk-first
    code (csrc/cpu/prefix_attention.cpp), where it outruns a gather and torch's fused kernel: on the
    CPU, queries in the pool's dtype, fp32 or bf16 with bf16 products (AVX512_BF16 or AMX), chunks
    and heads of whole vectors (multiples of 16, as the decode kernel takes)."""
    if not _pool_readable(q, pool):
        return False
    return q.dtype == torch.float32 or native().cpu_kernel_isa() in ("amx", "avx512_bf16")


def _pool_readable(q: torch.Tensor, pool: ChunkPool) -> bool:
    """Whether the prefix product's kernel can read this pool for these queries."""
    return (
        q.device.type == "cpu"
        and q.dtype == pool.dtype
        and q.dtype in (torch.float32, torch.bfloat16)
        and pool.chunk_size % 16 == 0
        and pool.head_dim % 16 == 0
        and native_cpu_available()
    )


def _causal_in_place(q: torch.Tensor, pool: ChunkPool) -> bool:
    """Whether a lone sequence's whole path is read in place, causally, by the prefix product's
    kernel (sliding windows and soft-capping included): in fp32, and in bf16 with batch-invariant
    numerics (each row one chunk at a time, the same whatever the wave: on the bf16 products where
    the CPU has them, else in fp32 arithmetic)."""
    if q.dtype == torch.float32:
        return _prefix_in_place(q, pool)
    return q.dtype == torch.bfloat16 and invariant.enabled() and _pool_readable(q, pool)


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + mask) v and its row log-sum-exp (fp32): q `[B, Hq, T, d]`, k, v
    `[B, Hk, S, d]` with Hq a multiple of Hk (query head h reads kv head h // (Hq / Hk)); a causal
    product aligns the last query with the last key. Output in q's dtype."""
    if q.device.type == "cpu":
        if q.dtype == torch.bfloat16 and q.shape[-1] % 16 == 0 and _own_kernel():
            return native().prefill_attention(q, k, v, scale, causal, mask)
        if causal and q.shape[2] != k.shape[2]:  # torch's kernel aligns causality top-left
            return fused_attention_lse(q, k, v, scale, causal, mask)
        # The fused kernel reads rows as unit-stride vectors whatever the strides say (a one-chunk
        # gather of the transposed K is such a view).
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
    return fused_attention_lse(q, k, v, scale, causal, mask)


def fused_attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_lse through torch's fused kernels that return the log-sum-exp (the GPU's path): in
    q's dtype, no score matrix in memory, no fp32 product for a 16-bit model.

    Those kernels want one KV head per query head. A product with neither mask nor causality (a
    group's shared prefix) folds the GQA group into the query rows instead: query head h reads KV
    head h // G, so [B, Hq, T, d] is [B, Hk, G * T, d] against the K/V as they are, read once. A
    masked or causal product expands K/V to Hq heads (its K/V are one group's own tokens)."""
    B, Hq, T, d = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = Hq // Hk
    if causal and T != S:  # the kernels align causality top-left; this contract aligns the last rows
        hidden = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(S - T + 1)
        causal_mask = torch.zeros(T, S, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
        mask = causal_mask if mask is None else mask + causal_mask
        causal = False
    if G > 1 and not causal and mask is None:
        o, lse = _fused_lse(q.reshape(B, Hk, G * T, d), k, v, scale, False, None)
        return o.reshape(B, Hq, T, d), lse.reshape(B, Hq, T)
    if G > 1:
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    return _fused_lse(q, k, v, scale, causal, mask)


def aligned_bias(mask: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """An additive mask `[B or 1, 1 or H, T, S]` as torch's memory-efficient kernel reads a bias:
    rows 16-element aligned (padded, then viewed back to S columns), broadcast by strides (no copy
    per head)."""
    T, S = mask.shape[-2:]
    pad = -S % 16
    if pad or mask.stride(-1) != 1 or mask.stride(-2) % 16:
        wide = mask.new_zeros(*mask.shape[:-1], S + pad)
        wide[..., :S] = mask
        mask = wide[..., :S]
    return mask.expand(batch, heads, T, S)


def _fused_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused product with equal head counts: (o [B, H, T, d] in q's dtype, lse [B, H, T] fp32).
    CUDA: torch's memory-efficient kernel (every dtype, a bias, causal; its LSE comes padded to 32
    rows); the CPU (where the tests run this path): torch's flash kernel, the same contract."""
    T = q.shape[2]
    if q.device.type == "cuda":
        bias = aligned_bias(mask, q.shape[0], q.shape[1]) if mask is not None else None
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)[
            :2
        ]
        return o, lse[..., :T]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )[:2]
    return o, lse


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from the normalized parts: o `[..., d]`,
    lse `[...]`. In fp32; an empty part (lse -inf) gets weight 0."""
    w1 = torch.sigmoid(lse1 - lse2)[..., None]
    return o2.float() + (o1.float() - o2.float()) * w1


def prefill_attention(
    groups: list[Group],
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: ChunkPool,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
    lone: LoneSpans | None = None,
    varlen: VarlenWave | None = None,
) -> None:
    """out[rows] = attention of the wave's new tokens over their paths: q `[rows, q_heads, d]`,
    k, v `[rows, kv_heads, d]` (the new tokens' own K/V, also already written to the pool).

    window > 0: a token at position t attends positions t - window + 1..t only (transformers'
    sliding window); softcap > 0: scaled scores s become softcap * tanh(s / softcap).
    lone: the lone groups as one product (lone_spans(groups)), where they are read in place: the
    same bits as one call each, in one OpenMP region instead of one a sequence.
    varlen: the lone groups, and where planned the shared groups, as variable-length products
    (varlen.plan_wave), the way off the CPU, in layers without a window or a cap (which the fused
    kernels do not take)."""
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must be >= 0 (0: off), got {window} and {softcap}")
    if q.dtype == torch.float16 and pool.dtype == torch.float32 and q.device.type == "cpu":
        # An fp16 model's K/V are fp32 on the CPU: its queries widened too, so that the wave takes
        # the in-place fp32 products (with batch-invariant numerics, the fold that is the same for a
        # row whatever the wave), not a gather and torch's kernels.
        wide = torch.empty(out.shape, dtype=torch.float32)
        prefill_attention(
            groups, layer, q.float(), k.float(), v.float(), pool, scale, wide, window, softcap, lone, varlen
        )
        out.copy_(wide)
        return
    in_place = _causal_in_place(q, pool)
    if lone is not None and in_place:
        native().causal_attention(q, pool.k[layer], pool.v[layer], lone.slots, lone.spans, scale, out, window, softcap)
        groups = [g for g in groups if g.key_idx is not None]
    elif varlen is not None and not window and not softcap:
        wave_attention(varlen, layer, q, pool, scale, out)
        groups = [] if varlen.groups else [g for g in groups if g.key_idx is not None]
    for g in groups:
        a_b = g.contiguous
        if g.key_idx is None and in_place:
            # One sequence: its whole path (cached and new, stored before attention) read in place,
            # causally, by the prefix product's kernel (its window and cap too): one product, no merge.
            n = g.prefix_len + a_b[1] - a_b[0]
            out[a_b[0] : a_b[1]] = native().prefix_attention(
                q[a_b[0] : a_b[1]], pool.k[layer], pool.v[layer], g.path_slots, n, scale, g.prefix_len, window, softcap
            )[0]
            continue
        if g.key_idx is None and _gathers_whole_path(q):
            _whole_path(g, layer, q, pool, scale, out, window, softcap)
            continue
        if window or softcap:
            _masked_group(g, layer, q, k, v, pool, scale, out, window, softcap)
            continue
        qg = q[a_b[0] : a_b[1]] if a_b else q[g.rows]
        kg = k[a_b[0] : a_b[1]] if a_b else k[g.rows]
        vg = v[a_b[0] : a_b[1]] if a_b else v[g.rows]
        if g.key_idx is None:  # one sequence: its new tokens, causally
            o, lse = attention_lse(
                qg.transpose(0, 1)[None], kg.transpose(0, 1)[None], vg.transpose(0, 1)[None], scale, causal=True
            )
            o, lse = o[0].transpose(0, 1), lse[0].transpose(0, 1)  # [R, Hq, d], [R, Hq]
        else:
            o, lse = _own_parts(g, layer, qg, kg, vg, pool, scale)
        if g.prefix_len and _prefix_in_place(q, pool):
            op, lsep = native().prefix_attention(
                qg, pool.k[layer], pool.v[layer], g.prefix_slots.to(torch.int32), g.prefix_len, scale
            )
            o = merge(op, lsep, o, lse)
        elif g.prefix_len:
            kp, vp = pool.gather(layer, g.prefix_slots, g.prefix_len)
            op, lsep = attention_lse(qg.transpose(0, 1)[None], kp[None].to(q.dtype), vp[None].to(q.dtype), scale)
            o = merge(op[0].transpose(0, 1), lsep[0].transpose(0, 1), o, lse)
        if a_b:
            out[a_b[0] : a_b[1]] = o
        else:
            out[g.rows] = o.to(out.dtype)


def _gathers_whole_path(q: torch.Tensor) -> bool:
    """Whether a lone sequence the in-place kernels do not read is gathered whole (_whole_path):
    off the CPU."""
    return q.device.type != "cpu"


def _whole_path(
    g: Group, layer: int, q: torch.Tensor, pool: ChunkPool, scale: float, out: torch.Tensor, window: int, softcap: float
) -> None:
    """A lone sequence off the CPU: its whole path (cached and new tokens, stored before attention)
    gathered from the pool and attended in one causal product. No cached part merged with a new
    one, so a row's bits do not depend on where the cache ended, which other rows of a batch
    decide (batch-invariant numerics ask that; the CPU reads the path in place to the same end)."""
    a, b = g.contiguous
    n = g.prefix_len + b - a
    kp, vp = pool.gather(layer, g.path_slots, n)  # [Hk, n, d]
    qg = q[a:b].transpose(0, 1)[None]
    if window or softcap:
        key_pos = torch.arange(n, device=q.device)
        lower = g.positions - window if window else torch.full_like(g.positions, -1)
        visible = (key_pos[None, :] <= g.positions[:, None]) & (key_pos[None, :] > lower[:, None])
        o, _ = _masked_attention_lse(qg, kp[None], vp[None], scale, visible[None], softcap)
    else:
        o, _ = attention_lse(qg, kp[None].to(q.dtype), vp[None].to(q.dtype), scale, causal=True)
    out[a:b] = o[0].transpose(0, 1).to(out.dtype)


def _own_parts(
    g: Group, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: ChunkPool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each member's new tokens over its own chunks past the prefix and its new tokens, causally,
    as one padded batch: (o `[R, Hq, d]`, lse `[R, Hq]`) in the group's row order."""
    R, Hq, d = q.shape
    zero = k.new_zeros(1, k.shape[1], d)
    keys, values = [k], [v]
    if g.own_slots is not None:
        ok, ov = pool.gather(layer, g.own_slots, g.own_len)  # [Hk, n_own, d]
        keys.insert(0, ok.transpose(0, 1).to(k.dtype))
        values.insert(0, ov.transpose(0, 1).to(v.dtype))
    k2 = torch.cat(keys + [zero])[g.key_idx].transpose(1, 2)  # [M, Hk, L, d]
    v2 = torch.cat(values + [zero])[g.key_idx].transpose(1, 2)
    q2 = torch.cat([q, q.new_zeros(1, Hq, d)])[g.query_idx].transpose(1, 2)  # [M, Hq, T, d]
    o, lse = attention_lse(q2, k2, v2, scale, mask=g.mask)
    o = o.transpose(1, 2).reshape(-1, Hq, d)[g.real]
    return o, lse.transpose(1, 2).reshape(-1, Hq)[g.real]


QUERY_BLOCK = 256  # queries per score matrix of the masked path: bounds its memory


def _masked_attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible: torch.Tensor, softcap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_lse's contract for what the fused kernels cannot do (soft-capped scores, windows):
    q `[B, Hq, T, d]`, k, v `[B, Hk, S, d]`, visible `[B, T, S]` (bool). In fp32; a row that sees
    no key gets o = 0, lse = -inf (weight 0 in a merge)."""
    B, Hq, T, d = q.shape
    group = Hq // k.shape[1]
    kf = k.float().repeat_interleave(group, 1).transpose(-1, -2)
    vf = v.float().repeat_interleave(group, 1)
    o = q.new_empty(B, Hq, T, d, dtype=torch.float32)
    lse = q.new_empty(B, Hq, T, dtype=torch.float32)
    for t0 in range(0, T, QUERY_BLOCK):
        t1 = min(T, t0 + QUERY_BLOCK)
        # Only the keys some query of the block sees: with a window, a long prompt's block reads
        # about window + QUERY_BLOCK keys, not all of them.
        seen = visible[:, t0:t1].any(0).any(0).nonzero()
        if seen.numel() == 0:
            o[:, :, t0:t1] = 0
            lse[:, :, t0:t1] = float("-inf")
            continue
        c0, c1 = int(seen[0]), int(seen[-1]) + 1
        s = torch.matmul(q[:, :, t0:t1].float(), kf[..., c0:c1]) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~visible[:, None, t0:t1, c0:c1], float("-inf"))
        block_lse = torch.logsumexp(s, -1)
        p = torch.exp(s - block_lse.clamp_min(torch.finfo(torch.float32).min)[..., None])
        o[:, :, t0:t1] = torch.matmul(p, vf[:, :, c0:c1])
        lse[:, :, t0:t1] = block_lse
    return o, lse


def _masked_group(
    g: Group,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: ChunkPool,
    scale: float,
    out: torch.Tensor,
    window: int,
    softcap: float,
) -> None:
    """One group on the masked path: its own part (each member's cached tokens past the prefix and
    its new tokens, or a lone sequence's new tokens), then the prefix from its first chunk that
    some member's window reaches."""
    qg, kg, vg, pos = q[g.rows], k[g.rows], v[g.rows], g.positions
    far = torch.iinfo(torch.long).max // 2  # no window: every earlier position is inside it
    lower = pos - window if window else pos - far  # a key at position p is seen when p > lower
    if g.key_idx is None:  # one sequence: its new tokens, causally
        visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > lower[:, None])
        o, lse = _masked_attention_lse(
            qg.transpose(0, 1)[None], kg.transpose(0, 1)[None], vg.transpose(0, 1)[None], scale, visible[None], softcap
        )
        o, lse = o[0].transpose(0, 1), lse[0].transpose(0, 1)
    else:
        o, lse = _masked_own_parts(g, layer, qg, kg, vg, pool, scale, lower, softcap)
    first_pos = int(pos.min()) - window + 1 if window else 0
    first_chunk = max(0, first_pos) // pool.chunk_size
    if g.prefix_len > first_chunk * pool.chunk_size:  # else the prefix is before every window
        base = first_chunk * pool.chunk_size
        kp, vp = pool.gather(layer, g.prefix_slots[first_chunk:], g.prefix_len - base)
        key_pos = torch.arange(base, g.prefix_len, device=q.device)
        visible = key_pos[None, :] > lower[:, None]  # prefix keys all precede the new tokens
        op, lsep = _masked_attention_lse(qg.transpose(0, 1)[None], kp[None], vp[None], scale, visible[None], softcap)
        o = merge(op[0].transpose(0, 1), lsep[0].transpose(0, 1), o, lse)
    out[g.rows] = o.to(out.dtype)


def _masked_own_parts(
    g: Group,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: ChunkPool,
    scale: float,
    lower: torch.Tensor,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """_own_parts with the window's lower bound and soft-capping: key j of a member's own part
    sits at position prefix_len + j."""
    R, Hq, d = q.shape
    zero = k.new_zeros(1, k.shape[1], d)
    keys, values = [k], [v]
    if g.own_slots is not None:
        ok, ov = pool.gather(layer, g.own_slots, g.own_len)
        keys.insert(0, ok.transpose(0, 1).to(k.dtype))
        values.insert(0, ov.transpose(0, 1).to(v.dtype))
    k2 = torch.cat(keys + [zero])[g.key_idx].transpose(1, 2)  # [M, Hk, L, d]
    v2 = torch.cat(values + [zero])[g.key_idx].transpose(1, 2)
    q2 = torch.cat([q, q.new_zeros(1, Hq, d)])[g.query_idx].transpose(1, 2)  # [M, Hq, T, d]
    # Padded queries (index R) see nothing; their rows are dropped.
    low = torch.cat([lower, lower.new_full((1,), torch.iinfo(torch.long).max // 2)])[g.query_idx]  # [M, T]
    key_pos = g.prefix_len + torch.arange(g.key_idx.shape[1], device=q.device)
    visible = (g.mask[:, 0] == 0) & (key_pos[None, None, :] > low[:, :, None])
    o, lse = _masked_attention_lse(q2, k2, v2, scale, visible, softcap)
    o = o.transpose(1, 2).reshape(-1, Hq, d)[g.real]
    return o, lse.transpose(1, 2).reshape(-1, Hq)[g.real]
