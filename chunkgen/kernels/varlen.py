"""A prefill wave's attention as variable-length products, the way off the CPU: every sequence
of a wave in a few kernel calls a layer, whatever the number of sequences and groups.

A product is a list of runs over one packed query tensor: run i's queries are rows
cu_q[i]..cu_q[i + 1] of it, its keys the pool positions (key_slots, key_offsets)[cu_k[i]..
cu_k[i + 1]], gathered by one index a layer. torch's flash kernel (fp16, bf16) takes the runs as
they are, the GQA group included; its memory-efficient kernel (fp32) takes them with K/V widened
to every query head. A wave (`VarlenWave`, planned once a wave) has up to three products:

- lone sequences (nothing shared cached; with batch-invariant numerics every sequence): a run
  each over its whole path, cached and new tokens, causally (its last query on its last key);
- the groups' shared prefixes: a run a group, every member's rows over the prefix, not causal;
- the members' own parts: a run a member over its path past the prefix, causally.

The last two merge by their log-sum-exp, as the per-group path merges them. New tokens' K/V are
stored in the pool before attention, so every key is read from the pool, in the pool's dtype,
whether it was cached or computed in this wave.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkgen.cache.pool import ChunkPool


@dataclass
class Runs:
    """One variable-length product's runs (see the module's docstring), on the device."""

    key_slots: torch.Tensor  # [total_k] int64: the chunk each key is in
    key_offsets: torch.Tensor  # [total_k] int64: its position in that chunk
    cu_q: torch.Tensor  # [N + 1] int32: where each run's queries start, then the end
    cu_k: torch.Tensor  # [N + 1] int32: the same for its keys
    max_q: int
    max_k: int
    causal: bool


def plan_runs(
    queries: list[int], keys: list[tuple[list[int], int, int]], chunk: int, causal: bool, device: torch.device | str
) -> Runs:
    """Runs of queries[i] packed queries over the positions [first, end) of a path of chunks,
    keys[i] = (path, first, end)."""
    slots, offsets = [], []
    for path, first, end in keys:
        pos = torch.arange(first, end)
        slots.append(torch.tensor(path, dtype=torch.long)[pos // chunk])
        offsets.append(pos % chunk)
    n_k = [end - first for _, first, end in keys]

    def starts(counts: list[int]) -> torch.Tensor:
        return torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)

    return Runs(
        key_slots=torch.cat(slots).to(device),
        key_offsets=torch.cat(offsets).to(device),
        cu_q=starts(queries),
        cu_k=starts(n_k),
        max_q=max(queries),
        max_k=max(n_k),
        causal=causal,
    )


@dataclass
class VarlenWave:
    """A wave's lone sequences and (where planned) its groups as variable-length products."""

    lone_rows: slice | torch.Tensor | None  # the lone sequences' rows of the wave, one after another
    lone: Runs | None
    group_rows: slice | torch.Tensor | None  # the groups' rows, group after group, member after member
    prefix: Runs | None
    own: Runs | None

    @property
    def groups(self) -> bool:
        """Whether the groups are planned here too (else they take the per-group path)."""
        return self.prefix is not None


def plan_wave(groups: list, chunk: int, device: torch.device | str, with_groups: bool) -> VarlenWave | None:
    """The wave's lone groups (prefill.Group with no own-part plan) as one product, and with
    with_groups its shared-prefix groups as two more; None where there is nothing to plan."""
    lone = sorted((g for g in groups if g.key_idx is None), key=lambda g: g.contiguous[0])
    shared = [g for g in groups if g.key_idx is not None] if with_groups else []
    if not lone and not shared:
        return None
    wave = VarlenWave(None, None, None, None, None)
    if lone:
        wave.lone_rows = _rows([torch.arange(*g.contiguous) for g in lone], device)
        spans = [g.contiguous[1] - g.contiguous[0] for g in lone]
        wave.lone = plan_runs(spans, [(g.path, 0, g.prefix_len + n) for g, n in zip(lone, spans)], chunk, True, device)
    if shared:
        members = [sp for g in shared for sp in g.members]
        wave.group_rows = _rows([torch.arange(sp.row, sp.row + sp.count) for sp in members], device)
        wave.prefix = plan_runs(
            [sum(sp.count for sp in g.members) for g in shared],
            [(g.members[0].path_slots, 0, g.prefix_len) for g in shared],
            chunk,
            False,
            device,
        )
        prefix_len = [g.prefix_len for g in shared for _ in g.members]
        wave.own = plan_runs(
            [sp.count for sp in members],
            [(sp.path_slots, n_p, sp.start + sp.count) for sp, n_p in zip(members, prefix_len)],
            chunk,
            True,
            device,
        )
    return wave


def _rows(parts: list[torch.Tensor], device: torch.device | str) -> slice | torch.Tensor:
    """Rows as a slice where they are one range (no gather), else as an index on the device."""
    rows = torch.cat(parts)
    first = int(rows[0])
    if torch.equal(rows, torch.arange(first, first + len(rows))):
        return slice(first, first + len(rows))
    return rows.to(device)


def wave_attention(wave: VarlenWave, layer: int, q: torch.Tensor, pool: ChunkPool, scale: float, out: torch.Tensor):
    """out at the wave's planned rows: the lone sequences over their paths; the groups' rows over
    their prefix and their own part, merged by the two parts' log-sum-exp."""
    from chunkgen.kernels.prefill import merge

    if wave.lone is not None:
        o, _ = attend(q[wave.lone_rows], pool, layer, wave.lone, scale, want_lse=False)
        out[wave.lone_rows] = o.to(out.dtype)
    if wave.prefix is not None:
        qg = q[wave.group_rows]
        op, lsep = attend(qg, pool, layer, wave.prefix, scale, want_lse=True)
        oo, lseo = attend(qg, pool, layer, wave.own, scale, want_lse=True)
        out[wave.group_rows] = merge(op, lsep, oo, lseo).to(out.dtype)


def attend(
    q: torch.Tensor, pool: ChunkPool, layer: int, runs: Runs, scale: float, want_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One product: its keys gathered from the pool's layer, then each run's queries over them.
    (o [total_q, Hq, d] in q's dtype, lse [total_q, Hq] fp32 or None)."""
    # Advanced indices on either side of sliced dims put the keys first: [total_k, kv_heads, d],
    # as the kernels take them, in one index kernel each from the pool's layouts.
    k = pool.k[layer][runs.key_slots, :, :, runs.key_offsets].to(q.dtype)
    v = pool.v[layer][runs.key_slots, :, runs.key_offsets].to(q.dtype)
    return varlen_attention(q, k, v, runs, scale, want_lse)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: Runs, scale: float, want_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run i's queries q[cu_q[i]:cu_q[i + 1]] over its keys k, v[cu_k[i]:cu_k[i + 1]] (causally:
    its last query on its last key): q `[total_q, Hq, d]`, k, v `[total_k, Hk, d]` (Hq a multiple
    of Hk); o `[total_q, Hq, d]` in q's dtype and, if wanted, lse `[total_q, Hq]` in fp32. No run's
    rows depend on another's: each is its own work in the kernels' grids, in the same kernel
    whatever the batch, and its keys are never split across blocks."""
    if q.device.type == "cuda":
        if flash_takes(q.dtype, q.shape[-1], q.device):
            # A longest query count of 1 would send the whole batch down the kernel's decode path
            # (other tiles, other bits), so a one-token sequence's rows would follow its batch:
            # the count only sizes the grid, and 2 sizes it as 1 does.
            o, lse = torch.ops.aten._flash_attention_forward(
                q, k, v, runs.cu_q, runs.cu_k, max(runs.max_q, 2), runs.max_k, 0.0, runs.causal, False,
                scale=scale, num_splits=1,
            )[:2]  # fmt: skip
            return o, lse.transpose(0, 1) if want_lse else None
        if want_lse:
            raise ValueError("the memory-efficient path plans no runs that need their log-sum-exp")
        G = q.shape[1] // k.shape[1]
        if G > 1:  # the memory-efficient kernel takes one KV head per query head
            k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        mask_type = 2 if runs.causal else 0  # 2: causal from the bottom right
        o = torch.ops.aten._efficient_attention_forward(
            q[None], k[None], v[None], None, runs.cu_q, runs.cu_k, runs.max_q, runs.max_k, 0.0, mask_type, False,
            scale=scale,
        )[0][0]  # fmt: skip
        return o, None
    # Elsewhere (the tests run the GPU's data flow on the CPU): the same contract, a run at a time.
    from chunkgen.kernels.prefill import fused_attention_lse

    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    cq, ck = runs.cu_q.tolist(), runs.cu_k.tolist()
    for i in range(len(cq) - 1):
        qi = q[cq[i] : cq[i + 1]].transpose(0, 1)[None]
        ki, vi = (x[ck[i] : ck[i + 1]].transpose(0, 1)[None] for x in (k, v))
        oi, li = fused_attention_lse(qi, ki, vi, scale, causal=runs.causal)
        o[cq[i] : cq[i + 1]] = oi[0].transpose(0, 1)
        lse[cq[i] : cq[i + 1]] = li[0].transpose(0, 1)
    return o, lse if want_lse else None


def flash_takes(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether torch's flash kernel takes such queries: fp16 or bf16, heads of a multiple of 8 up
    to 256, an sm80 or newer GPU, a torch built with it."""
    return (
        dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
        and torch.device(device).type == "cuda"
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability(device) >= (8, 0)
    )
