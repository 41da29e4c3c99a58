"""The next-token choice for a batch of logits, on their device: greedy rows by argmax, sampled
rows by top-k / top-p and one uniform draw from their own generator."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from chunkgen._native import native_cpu_available
from chunkgen.engine.params import SamplingParams

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def sample_seed(seed: int, index: int) -> int:
    """The generator seed of sample `index` of a request seeded with `seed`.

    Sample 0 uses the request's seed itself, so a request's first sample does not depend on n.
    Other samples hash (seed, index), so seed 1's second sample is not seed 2's first as with
    seed + index. torch's CPU generator (mt19937) keys its stream on the low 32 bits of a seed
    only, so those bits decide: derived seeds set bit 31 (and bit 63, outside the range a request
    may ask for), which keeps every derived stream apart from every request seed below 2**31, the
    seeds people pick by hand. Two derived streams coincide only by a 1-in-2**31 chance per pair.
    """
    if index == 0:
        return seed
    return _mix64(_mix64(seed) + index) | (1 << 63) | (1 << 31)


def make_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """One generator per sample: its draws depend only on its own seed, never on the batch."""
    if params.greedy:
        return None
    g = torch.Generator()
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(sample_seed(params.seed, index))
    return g


# Sampled rows look for their top-k / top-p cut among a fixed number of best tokens: the largest k
# asked plus one (to see whether ties with the k-th run past the list), or CANDIDATES for rows with
# top-p but no top-k. A row whose cut the list cannot settle (nucleus not reached, ties past its
# end) is redone exactly over its whole vocabulary after the step's one read: that costs a sync,
# counted in FALLBACKS, and happens only for such rows.
CANDIDATES = 1024
_BLOCK = 256  # the draw's two-level inverse CDF: block sums, then one block's running sum
_ROWS = 32  # rows filtered at once: bounds the reused scratch memory to ~25 bytes x _ROWS x vocab
_SUBNORMAL = math.log(torch.finfo(torch.float32).tiny)


class Fallbacks:
    """How many rows were redone over their whole vocabulary (a sync each); tests read it."""

    rows = 0


FALLBACKS = Fallbacks()


class _Scratch(threading.local):
    """[rows, vocab] temporaries reused from call to call: on CPU, fresh ones cost more in page
    faults than the arithmetic done on them. CUDA's caching allocator already reuses memory."""

    def __init__(self) -> None:
        self.bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        n = math.prod(shape)
        buf = self.bufs.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self.bufs[(name, dtype)] = torch.empty(n, dtype=dtype)
        return buf[:n].view(shape)


_scratch = _Scratch()


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor for copies to or from `device`: pinned for CUDA, so they run asynchronously
    (the caller waits on what uses them), plain memory on the CPU, where there is nothing to copy."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


class _Part:
    """One slice of a batch's sampled rows, filtered together: its parameters on the device."""

    def __init__(self, rows: list[int], params: list[SamplingParams], device: torch.device) -> None:
        self.rows = rows
        self.run = rows[-1] - rows[0] == len(rows) - 1  # consecutive rows: a view, no copy
        self.index = torch.tensor(rows, device=device)
        self.temperature = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([params[i].top_k for i in rows], device=device)
        self.top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float64, device=device)
        self.total = any(params[i].top_p < 1.0 and not params[i].top_k for i in rows)
        self.cap = max(
            [params[i].top_k + 1 for i in rows if params[i].top_k]
            + [CANDIDATES for i in rows if params[i].top_p < 1.0 and not params[i].top_k],
            default=0,
        )


class SamplingBatch:
    """A batch's sampling parameters, on the logits' device, built once per batch composition
    (the engine keeps it while the same sequences run in the same order): a step then moves only
    its rows' uniform numbers to the device."""

    def __init__(
        self, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None], device: torch.device
    ) -> None:
        self.params = list(params)
        self.generators = list(generators)
        self.device = device
        self.sampled = [i for i, p in enumerate(self.params) if not p.greedy]
        self.parts = [
            _Part(self.sampled[lo : lo + _ROWS], self.params, device) for lo in range(0, len(self.sampled), _ROWS)
        ]
        # Each sampled row's uniform number of the step, drawn on the host from its own generator
        # straight into this buffer (no Python floats), then moved in one copy. The previous
        # step's copy has finished by then: every step waits for its sampled tokens.
        self.u_host = host_buffer((len(self.sampled),), torch.float64, device)
        # rows asking for logprobs (engine/logits.py reads them on the device)
        self.logprob_rows = [i for i, p in enumerate(self.params) if p.logprobs is not None]
        self.logprob_index = (  # None: every row asks, or none (no copy to the device then)
            None
            if len(self.logprob_rows) in (0, len(self.params))
            else torch.tensor(self.logprob_rows, dtype=torch.long, device=device)
        )
        self.max_logprobs = max((self.params[i].logprobs or 0 for i in self.logprob_rows), default=0)

    def uniforms(self) -> torch.Tensor:
        """One uniform number per sampled row from its generator: the row's stream advances by
        exactly one draw per step, whatever else is in the batch."""
        for j, i in enumerate(self.sampled):
            torch.rand(1, generator=self.generators[i], dtype=torch.float64, out=self.u_host[j : j + 1])
        return self.u_host.to(self.device, non_blocking=True)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value (the first of equals; a row with NaN: its first NaN).
    On the CPU chunkgen's op (fp32 or the model's bf16 logits as they are, ~10x torch's max);
    elsewhere max's indices, which torch computes several times faster than argmax."""
    if (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.dim() == 2
        and x.shape[1] > 0
        and x.stride(1) == 1
        and native_cpu_available()
    ):
        return torch.ops.chunkgen.argmax_rows.default(x)
    return x.max(dim=-1).indices


def draw(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next token per row of `logits` [batch, vocab] on their device, without waiting for it:
    (tokens [batch] int64, per row whether it must be redone on the host by `redo_short_rows`,
    or None when no row is sampled). Greedy rows take the argmax; the others draw from the
    temperature-scaled distribution cut to its top-k, then to its top-p nucleus.

    Each sampled row takes exactly one uniform number per step from its own CPU generator and
    maps it through the inverse CDF in vocabulary order, and which tokens are kept depends on the
    row alone, so a seeded row draws the same token whatever else is in the batch and on
    whichever device, up to float rounding at a boundary."""
    B, V = logits.shape
    if not batch.sampled:  # the common case: one argmax
        return _argmax(logits), None
    u = batch.uniforms()
    out = _argmax(logits) if len(batch.sampled) < B else torch.empty(B, dtype=torch.long, device=logits.device)
    redo = torch.zeros(B, dtype=torch.bool, device=logits.device)
    at = 0
    for part in batch.parts:
        n = len(part.rows)
        if part.run:
            x = logits[part.rows[0] : part.rows[0] + n]
        else:
            x = _scratch.take("x", (n, V), logits.dtype, logits.device)
            torch.index_select(logits, 0, part.index, out=x)
        tokens, part_redo = _draw_rows(
            x.float(), part.temperature, part.top_k, part.top_p, u[at : at + n], min(part.cap, V), part.total
        )
        out.index_copy_(0, part.index, tokens)
        redo.index_copy_(0, part.index, part_redo)
        at += n
    return out, redo


class StepReader:
    """A step's one device-to-host read: its tensors flattened into one float64 row on the
    device (token ids are exact in float64), copied at once into a reused host buffer (pinned
    for CUDA, copied asynchronously and waited for once), split back into Python lists."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.copies = 0  # reads done: one per step

    def read(self, *parts: torch.Tensor) -> list[list[float]]:
        flat = torch.cat([p.reshape(-1).double() for p in parts])
        n = flat.numel()
        if self.buf is None or self.buf.numel() < n or self.buf.is_pinned() != (flat.device.type == "cuda"):
            self.buf = host_buffer(
                (max(n, 2 * (self.buf.numel() if self.buf is not None else 0)),), torch.float64, flat.device
            )
        host = self.buf[:n]
        host.copy_(flat, non_blocking=True)
        if flat.device.type == "cuda":
            torch.cuda.current_stream(flat.device).synchronize()
        self.copies += 1
        values = host.tolist()
        out, at = [], 0
        for p in parts:
            out.append(values[at : at + p.numel()])
            at += p.numel()
        return out


def redo_short_rows(logits: torch.Tensor, batch: SamplingBatch, tokens: list[int], redo: list[bool]) -> list[int]:
    """The rows `draw` could not settle on the device (a cut its candidate list was too short
    for, or no distribution at all: NaN or infinite logits), drawn again over the whole
    vocabulary with the same uniform numbers (the step's u_host): what `draw` would give with an
    unlimited list. Their count goes to FALLBACKS.rows."""
    rows = [i for i, r in enumerate(redo) if r]
    if not rows:
        return tokens
    FALLBACKS.rows += len(rows)
    where = {i: j for j, i in enumerate(batch.sampled)}
    p = [batch.params[i] for i in rows]
    dev = logits.device
    x = logits.index_select(0, torch.tensor(rows, device=dev)).float()
    u = torch.tensor([float(batch.u_host[where[i]]) for i in rows], dtype=torch.float64, device=dev)
    new, _ = _draw_rows(
        x,
        torch.tensor([q.temperature for q in p], dtype=torch.float32, device=dev),
        torch.tensor([q.top_k for q in p], device=dev),
        torch.tensor([q.top_p for q in p], dtype=torch.float64, device=dev),
        u,
        x.shape[1],
        True,
        exact=True,
    )
    tokens = list(tokens)
    for i, t in zip(rows, new.tolist()):
        tokens[i] = t
    return tokens


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """`draw` for one batch, read back to the host (rows needing it redone exactly)."""
    batch = SamplingBatch(params, generators, logits.device)
    tokens, redo = draw(logits, batch)
    if redo is None:
        return tokens.tolist()
    toks, flags = StepReader().read(tokens, redo)
    return redo_short_rows(logits, batch, [int(t) for t in toks], [bool(f) for f in flags])


def _draw_rows(
    x: torch.Tensor,
    temp: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
    cap: int,
    total: bool,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits `x` [rows, vocab], from uniforms `u` [rows], with its
    parameters as tensors [rows]; the cut is sought among the `cap` best tokens (0: no row cuts;
    `total`: some row needs its whole mass, for top-p without top-k). Returns the tokens and
    which rows must be redone `exact`: those the list could not settle, and rows without a
    distribution (NaN, +inf or all -inf logits), whose token is their argmax, found only when
    exact: looking past NaNs costs two more passes over the logits."""
    R, V = x.shape
    dev = x.device
    top = x.amax(dim=-1, keepdim=True)
    bad = ~torch.isfinite(top.squeeze(1))
    top = top.masked_fill(bad[:, None], 0.0)
    s = torch.sub(x, top, out=_scratch.take("s", (R, V), torch.float32, dev))
    s.masked_fill_(bad[:, None], 0.0)  # a bad row draws from nothing in particular until redone
    s.div_(temp[:, None])  # log-weights: <= 0, the row's best is 0
    # Weights below float32's smallest normal (a chance under 1e-38 against the best token) would
    # be subnormal, which is slow on CPUs; they count as nothing.
    torch.threshold_(s, _SUBNORMAL, -math.inf)
    blocks = -(-V // _BLOCK)
    buf = _scratch.take("w", (R, blocks * _BLOCK), torch.float32, dev)
    buf[:, V:].fill_(0.0)
    w = torch.exp(s, out=buf[:, :V])  # unnormalised probabilities, the best is 1
    redo = _cut(s, w, top_k, top_p, cap, total) if cap else torch.zeros(R, dtype=torch.bool, device=dev)
    tokens = _draw(buf.view(R, blocks, _BLOCK), u)
    if exact:
        tokens = torch.where(bad, _argmax(torch.nan_to_num(x, nan=-math.inf)), tokens)
        return tokens, torch.zeros_like(bad)
    return tokens, redo | bad


def _order_keys(vals: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering (log-weight, token) pairs by log-weight, then among equal log-weights
    by token id, the lowest id the greatest key: float32 bits made monotonic in the high half,
    the inverted id in the low half. One sort by these is the order top-p walks."""
    bits = vals.contiguous().view(torch.int32)
    mono = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    return mono * (1 << 32) + ((1 << 32) - 1 - ids)


def _cut(
    s: torch.Tensor, w: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, cap: int, total: bool = True
) -> torch.Tensor:
    """Zero the weights `w` of the tokens top-k, then top-p, leave out, given log-weights `s`
    [rows, vocab], top_k [rows] (0: off) and top_p [rows], looking among the `cap` best tokens
    (`total` False: no row has top-p without top-k, whose mass is then the whole row's).

    Top-k keeps every token tied with the k-th. Top-p then keeps the shortest prefix of the
    top-k tokens, sorted by weight and among equal weights by token id, whose mass reaches p
    (at least one token). Returns per row whether the list was too short to settle this (the
    nucleus not reached within it, or ties at its cut running past its end); such rows' weights
    are left cut at a guess and must be redone with cap = vocab. Fixed shapes throughout."""
    R, V = s.shape
    C = min(cap, V)
    vals, ids = s.topk(C, dim=-1)
    order = _order_keys(vals, ids).argsort(dim=-1, descending=True)
    vals, ids = vals.gather(1, order), ids.gather(1, order)
    has_k = top_k > 0
    kth = vals.gather(1, (top_k.clamp(1, C) - 1)[:, None]).squeeze(1)
    kth = kth.masked_fill(~has_k, -math.inf)
    in_k = vals >= kth[:, None]
    wc = vals.exp().double() * in_k
    cum = wc.cumsum(dim=-1)
    total = torch.where(has_k, cum[:, -1], w.sum(dim=-1, dtype=torch.float64)) if total else cum[:, -1]
    with_p = top_p < 1.0
    target = top_p * total
    before = torch.cat([cum.new_zeros(R, 1), cum[:, :-1]], dim=1)  # mass ahead of each candidate
    reach = (before < target[:, None]) & in_k
    n = torch.where(with_p, reach.sum(dim=-1).clamp(min=1), in_k.sum(dim=-1))
    cuts = has_k | with_p
    last = (n - 1).clamp(min=0)[:, None]
    floor = vals.gather(1, last).squeeze(1).masked_fill_(~cuts, -math.inf)
    # tokens tied with the floor but past the cut: the list holds them all unless it is short
    drop = (torch.arange(C, device=s.device) >= n[:, None]) & (vals == floor[:, None])
    w.masked_fill_(torch.lt(s, floor[:, None], out=_scratch.take("below", s.shape, torch.bool, s.device)), 0.0)
    w.scatter_(1, ids, w.gather(1, ids).masked_fill_(drop, 0.0))
    if C == V:
        return torch.zeros(R, dtype=torch.bool, device=s.device)
    end = vals[:, -1]
    return (
        (has_k & (kth > -math.inf) & (end == kth))
        | (cuts & (floor > -math.inf) & (end == floor))
        | (~has_k & with_p & (cum[:, -1] < target))
    )


def _draw(blocks: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in vocabulary order of weights [B, blocks, _BLOCK], u in [0, 1) per row: block
    sums pick the block, that block's running sum picks the token. A token of weight 0 is never
    picked: u * total may round up to the total, so each pick is capped at the last weighted one."""
    B = blocks.shape[0]
    cum = blocks.sum(dim=-1).double().cumsum(dim=-1)
    b = _pick(cum, u[:, None] * cum[:, -1:])
    left = u[:, None] * cum[:, -1:] - cum.gather(1, (b - 1).clamp(min=0)).masked_fill_(b == 0, 0.0)
    inner = blocks[torch.arange(B, device=blocks.device), b.squeeze(1)].double().cumsum(dim=-1)
    return (b * blocks.shape[2] + _pick(inner, left)).squeeze(1)


def _pick(cum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """First index whose running sum exceeds target, capped at the last index that adds weight."""
    last = torch.searchsorted(cum, cum[:, -1:].contiguous())
    return torch.minimum(torch.searchsorted(cum, target, right=True), last)
