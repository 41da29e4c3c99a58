"""Sampling parameters and the next-token choice for a batch of logits."""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Callable

import torch

MAX_N = 128
MAX_STOP = 16
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # alternatives per token, as the Chat Completions API allows
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2], as OpenAI and vLLM take them
GREEDY_BELOW = 1e-5  # as vLLM: smaller temperatures overflow the scaled logits, so take the argmax


class ParamError(ValueError):
    """A bad SamplingParams value; `field` names the parameter so callers can point at it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field
        self.message = message


def _integer(name: str, v: Any, lo: int, hi: int | None = None, hi_text: str | None = None) -> int:
    bound = f">= {lo}" if hi is None else f"in [{lo}, {hi_text or hi}]"
    if isinstance(v, bool) or not isinstance(v, Integral) or v < lo or (hi is not None and v > hi):
        raise ParamError(name, f"must be an integer {bound}, got {v!r}")
    return int(v)


def _number(name: str, v: Any, rule: str, ok: Callable[[float], bool]) -> float:
    if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v) or not ok(v):
        raise ParamError(name, f"must be a number {rule}, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # below GREEDY_BELOW: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    # Log-probabilities of the model's own distribution (before penalties, constraints and
    # temperature, as vLLM returns by default): None for none, k for the chosen token's plus the
    # k most likely alternatives at every step.
    logprobs: int | None = None
    # Subtracted from the logit of every token already generated (prompt tokens do not count):
    # presence once per token seen, frequency once per occurrence, as vLLM and OpenAI apply them.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Constrained decoding (engine/constraint.py), at most one: a JSON schema (kept as its JSON
    # text so the dataclass stays hashable; a dict is accepted), a regex, a Lark grammar.
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("max_new_tokens", _integer("max_new_tokens", self.max_new_tokens, 1))
        put("temperature", _number("temperature", self.temperature, ">= 0", lambda v: v >= 0))
        put("top_p", _number("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1))
        put("top_k", _integer("top_k", self.top_k, 0))
        if self.seed is not None:
            put("seed", _integer("seed", self.seed, 0, MAX_SEED, "2**63 - 1"))
        put("n", _integer("n", self.n, 1, MAX_N))
        if self.logprobs is not None:
            put("logprobs", _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        for name in ("presence_penalty", "frequency_penalty"):
            put(name, _number(name, getattr(self, name), f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                              lambda v: -MAX_PENALTY <= v <= MAX_PENALTY))
        if not isinstance(self.ignore_eos, bool):
            raise ParamError("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop  # one string is one stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ParamError("stop", f"must be a non-empty string or a list of them, got {self.stop!r}")
        if len(stop) > MAX_STOP:
            raise ParamError("stop", f"takes at most {MAX_STOP} strings, got {len(stop)}")
        put("stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, Integral) or t < 0
                                                       for t in ids):
            raise ParamError("stop_token_ids", f"must be a list of token ids (integers >= 0), got {ids!r}")
        put("stop_token_ids", tuple(int(t) for t in ids))
        self._check_constraint(put)

    def _check_constraint(self, put: Callable[[str, Any], None]) -> None:
        from chunkgen.engine import constraint  # it imports ParamError from here

        given = [k for k in constraint.KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ParamError(given[1], f"cannot be combined with {given[0]} (give at most one constraint)")
        if not given:
            return
        kind = given[0]
        if kind == "json_schema":
            put(kind, constraint.normalize_schema(self.json_schema))
        elif not isinstance(getattr(self, kind), str) or not getattr(self, kind):
            raise ParamError(kind, f"must be a non-empty string, got {getattr(self, kind)!r}")
        constraint.compile_spec(kind, getattr(self, kind))  # cached: a spec compiles once per process

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    def as_dict(self) -> dict:
        # Fields added after the first release are left out while unset: request hashes and records
        # of requests that do not use them stay what they were (resume compares those hashes).
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()
                if _OPTIONAL.get(k, ...) != v}


_OPTIONAL = {"json_schema": None, "regex": None, "grammar": None, "logprobs": None,
             "presence_penalty": 0.0, "frequency_penalty": 0.0}


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


# Top-p over a whole vocabulary uses a histogram of log-weights below the row's maximum: _BINS
# bins over [0, _SPAN), everything further down (each token under e**-_SPAN) in the last bin.
_BINS = 4096
_SPAN = 32.0
_BLOCK = 256  # the draw's two-level inverse CDF: block sums, then one block's running sum
_ROWS = 32  # rows filtered at once: bounds the reused scratch memory to ~25 bytes x _ROWS x vocab
_SUBNORMAL = math.log(torch.finfo(torch.float32).tiny)


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


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Next token per row of `logits` [batch, vocab]: greedy rows take the argmax, the others draw
    from the temperature-scaled distribution cut to its top-k, then to its top-p nucleus.

    Rows are filtered together on the logits' device. Each sampled row takes exactly one uniform
    number per call from its own CPU generator and maps it through the inverse CDF in vocabulary
    order, and which tokens are kept depends on the row alone, so a seeded row draws the same
    token whatever else is in the batch and on whichever device, up to float rounding at a
    boundary."""
    dev = logits.device
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == len(params):  # the common case: one argmax, no index tensor
        return logits.argmax(dim=-1).tolist()
    out = torch.empty(logits.shape[0], dtype=torch.long, device=dev)
    if greedy:
        sel = torch.tensor(greedy, device=dev)
        out[sel] = logits.index_select(0, sel).argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    u = [float(torch.rand((), generator=generators[i], dtype=torch.float64)) for i in rows]
    for lo in range(0, len(rows), _ROWS):
        part = rows[lo:lo + _ROWS]
        sel = torch.tensor(part, device=dev)
        if part[-1] - part[0] == len(part) - 1:  # a run of rows: no copy
            x = logits[part[0]:part[-1] + 1]
        else:
            x = _scratch.take("x", (len(part), logits.shape[1]), logits.dtype, dev)
            torch.index_select(logits, 0, sel, out=x)
        uniforms = torch.tensor(u[lo:lo + _ROWS], dtype=torch.float64, device=dev)
        out[sel] = _draw_rows(x.float(), [params[i] for i in part], uniforms)
    return out.tolist()


def _draw_rows(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """One token per row of logits `x` [rows, vocab], from uniforms `u` [rows]."""
    R, V = x.shape
    dev = x.device
    top = x.amax(dim=-1, keepdim=True)
    # NaN, +inf or an all -inf row has no distribution to draw from: it takes its argmax instead
    # (for every row, whatever it holds: asking which rows are bad would wait for the device).
    bad = ~torch.isfinite(top.squeeze(1))
    fallback = torch.nan_to_num(x, nan=-math.inf).argmax(dim=-1)
    x = x.masked_fill(bad[:, None], 0.0)
    top = top.masked_fill(bad[:, None], 0.0)
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    s = torch.sub(x, top, out=_scratch.take("s", (R, V), torch.float32, dev))
    s.div_(temp[:, None])  # log-weights: <= 0, the row's best is 0
    # Weights below float32's smallest normal (a chance under 1e-38 against the best token) would
    # be subnormal, which is slow on CPUs; they count as nothing.
    torch.threshold_(s, _SUBNORMAL, -math.inf)
    blocks = -(-V // _BLOCK)
    buf = _scratch.take("w", (R, blocks * _BLOCK), torch.float32, dev)
    buf[:, V:] = 0.0
    w = torch.exp(s, out=buf[:, :V])  # unnormalised probabilities, the best is 1
    _cut(s, w, [p.top_k for p in params], [p.top_p for p in params])
    drawn = _draw(buf.view(R, blocks, _BLOCK), u)
    return torch.where(bad, fallback, drawn)


def _cut(s: torch.Tensor, w: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    """Zero the weights `w` of the tokens top-k, then top-p, leave out, given log-weights `s`.

    Top-k keeps every token tied with the k-th. Top-p then keeps the shortest prefix of the
    top-k tokens, sorted by weight and among equal weights by token id, whose mass reaches p
    (at least one token). Rows with a top-k find that prefix in their sorted top-k list; the
    others (and the rare row whose ties with the k-th run past the list) through a histogram:
    sorting a whole vocabulary costs ~30x more on CPU."""
    with_p = [q < 1.0 for q in top_p]
    if not any(top_k) and not any(with_p):
        return
    R, V = s.shape
    dev = s.device
    floor = torch.full((R,), -math.inf, device=dev)  # per row: the smallest log-weight kept
    listed = [False] * R  # rows whose top-k list holds every token their prefix may need
    if any(top_k):
        k = torch.tensor(top_k, device=dev).clamp_(max=V)
        # one more than the largest k: a list ends in a tie with the k-th only if that one is too
        vals, ids = s.topk(min(max(top_k) + 1, V), dim=-1)
        kth = torch.where(k > 0, vals.gather(1, (k.clamp(min=1) - 1)[:, None]).squeeze(1), -math.inf)
        floor = kth
        complete = ((vals[:, -1] < kth) | (vals.shape[1] == V)).tolist()
        listed = [bool(kk) and p and c for kk, p, c in zip(top_k, with_p, complete)]
    drop_r = drop_c = None
    if any(with_p):
        p = torch.tensor(top_p, dtype=torch.float64, device=dev)
        parts = []  # candidates for the end of the prefix: rows, token ids, log-weights, weights
        above = torch.zeros(R, dtype=torch.float64, device=dev)  # per row: weight above its candidates
        target = torch.zeros(R, dtype=torch.float64, device=dev)  # per row: the mass to reach
        if any(listed):
            r, j = (torch.tensor(listed, device=dev)[:, None] & (vals >= kth[:, None])).nonzero(as_tuple=True)
            wts = w[r, ids[r, j]].double()
            target.index_add_(0, r, wts).mul_(p)
            parts.append((r, ids[r, j], vals[r, j], wts))
        hist = [q and not c for q, c in zip(with_p, listed)]
        if any(hist):
            idx = torch.tensor([i for i, h in enumerate(hist) if h], device=dev)
            whole = len(idx) == R
            hs, hw = (s, w) if whole else (s[idx], w[idx])
            if any(top_k):  # the histogram weighs the top k only
                hw.mul_(_at_least(hs, floor[idx]))
            r, c, v, wts, above[idx], target[idx] = _histogram_candidates(hs, hw, p[idx])
            parts.append((idx[r], c, v, wts))
        cut, drop_r, drop_c = _prefix(*(torch.cat(t) for t in zip(*parts)), above, target)
        floor = torch.maximum(floor, cut)
    w.mul_(_at_least(s, floor))
    if drop_r is not None:
        w[drop_r, drop_c] = 0.0


def _histogram_candidates(s: torch.Tensor, w: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tokens among which each row's top-p prefix ends: weights summed per log-weight bin
    find the bin where the mass reaches p of the row's; that bin's tokens are the candidates.
    Returns their rows, token ids, log-weights and weights, and per row the weight of the bins
    above and the mass to reach."""
    B, V = s.shape
    dev = s.device
    scaled = torch.mul(s, -(_BINS / _SPAN), out=_scratch.take("tmp", s.shape, s.dtype, dev)).clamp_(max=_BINS - 1)
    bins = _scratch.take("bins", s.shape, torch.long, dev).copy_(scaled)
    cum = torch.zeros(B, _BINS, dtype=w.dtype, device=dev).scatter_add_(1, bins, w).double().cumsum(dim=-1)
    target = p * cum[:, -1]
    star = torch.searchsorted(cum, target[:, None]).clamp_(max=_BINS - 1)  # first bin reaching it
    above = torch.where(star > 0, cum.gather(1, (star - 1).clamp(min=0)), 0.0).squeeze(1)
    hit = torch.eq(bins, star, out=_scratch.take("hit", s.shape, torch.bool, dev))
    flat = hit.view(-1).nonzero().squeeze(1)  # flat is ~2x faster than per dimension
    r, c = flat // V, flat % V
    return r, c, s[r, c], w[r, c].double(), above, target


def _prefix(r: torch.Tensor, c: torch.Tensor, v: torch.Tensor, wts: torch.Tensor, above: torch.Tensor,
            target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-p's cut among candidates (row r, token c, log-weight v, weight wts; `above`: weight of
    the row above all its candidates): a candidate is kept while the mass before it, in order of
    log-weight then token id, is below the row's target. Returns per row the smallest kept
    log-weight (-inf for rows without candidates) and the (rows, tokens) tied with it but past
    the cut, which that floor alone would keep."""
    rows = above.shape[0]
    o = c.argsort(stable=True)
    o = o[v[o].argsort(descending=True, stable=True)]
    o = o[r[o].argsort(stable=True)]
    r, c, v, wts = r[o], c[o], v[o], wts[o]
    run = torch.cat([wts.new_zeros(1), wts.cumsum(dim=0)])  # run[j]: weight of candidates before j
    counts = torch.bincount(r, minlength=rows)
    first = torch.cumsum(counts, dim=0) - counts
    kept = above[r] + run[:-1] - run[first][r] < target[r]
    kept[first[counts > 0]] = True  # at least one token, even where float sums disagree
    n = torch.bincount(r[kept], minlength=rows)  # kept candidates are a prefix of their row's
    last = (first + n - 1).clamp(min=0)
    floor = torch.where(n > 0, v[last] if v.numel() else v.new_zeros(rows), -math.inf)
    drop = ~kept & (v == floor[r])
    return floor, r[drop], c[drop]


def _at_least(s: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """1.0 where s >= its row's floor, else 0.0. Float arithmetic: boolean masks cost ~5x more
    on CPU. The sign of a difference is exact; -inf floors become the lowest float, since
    -inf - -inf is NaN."""
    low = torch.finfo(s.dtype).min
    keep = torch.sub(s, floor.clamp(min=low)[:, None], out=_scratch.take("tmp", s.shape, s.dtype, s.device))
    return keep.sign_().add_(1.0).clamp_(max=1.0)


def _draw(blocks: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in vocabulary order of weights [B, blocks, _BLOCK], u in [0, 1) per row: block
    sums pick the block, that block's running sum picks the token. A token of weight 0 is never
    picked: u * total may round up to the total, so each pick is capped at the last weighted one."""
    B = blocks.shape[0]
    cum = blocks.sum(dim=-1).double().cumsum(dim=-1)
    b = _pick(cum, u[:, None] * cum[:, -1:])
    left = u[:, None] * cum[:, -1:] - torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(B, device=blocks.device), b.squeeze(1)].double().cumsum(dim=-1)
    return (b * blocks.shape[2] + _pick(inner, left)).squeeze(1)


def _pick(cum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """First index whose running sum exceeds target, capped at the last index that adds weight."""
    last = torch.searchsorted(cum, cum[:, -1:].contiguous())
    return torch.minimum(torch.searchsorted(cum, target, right=True), last)
