"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's log-probability given the tokens
before it, and its likeliest alternatives, read off the prefill's hidden states.

A prompt token's entry depends only on the tokens before it, so it belongs with the tree chunk that
holds the token: once computed it is kept there (`Chunk.scores`) and a later prompt through the same
chunk reads it instead of computing it again. The token at a sequence's first computed position is
predicted by the position before it, which is cached: that one position is computed again (its K/V
are not written twice), unless its entry is already in the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkgen.cache.tree import Chunk

# Rows of logits made at once: a wave of thousands of prompt tokens never holds [tokens, vocab].
SLICE_ROWS = 256

# One stored entry: (logprob of the token, ((alternative id, its logprob), ...) likeliest first).
Entry = tuple[float, tuple[tuple[int, float], ...]]


def stored_width(k: int) -> int:
    """Alternatives kept per token: at least the likeliest one, which says whether the token was greedy."""
    return max(k, 1)


@dataclass
class ScoreSpan:
    """One scored sequence's rows of a prefill wave: row `row + i` predicts `targets[i]`.
    `alternatives`: further token ids whose logprobs at the first row are wanted (the first tokens
    of other continuations of the same context, which that row predicts as well)."""

    row: int
    targets: list[int]
    width: int
    alternatives: tuple[int, ...] = ()


@torch.inference_mode()
def score_spans(model, hidden: torch.Tensor, spans: list[ScoreSpan]) -> list[tuple[list[Entry], list[float]]]:
    """Per span, one entry per target token and the logprob of each alternative, computed in fp32
    a slice of rows at a time. Only the spans' rows go through the lm head: a prompt scored from
    its end (a choice after its context) costs one row of logits, not one per prompt token."""
    rows = [sp.row + i for sp in spans for i in range(len(sp.targets))]
    if not rows:
        return [([], []) for _ in spans]
    targets = torch.tensor([t for sp in spans for t in sp.targets], device=hidden.device)
    index = torch.tensor(rows, device=hidden.device)
    # Alternatives as (index into rows, token): a span's first row is its first entry in rows.
    alt_at, alt_tok, first = [], [], 0
    for sp in spans:
        if sp.targets:
            alt_at += [first] * len(sp.alternatives)
            alt_tok += list(sp.alternatives)
        first += len(sp.targets)
    alt_at_t = torch.tensor(alt_at, dtype=torch.long)
    alt_tok_t = torch.tensor(alt_tok, dtype=torch.long, device=hidden.device)
    alt_lp = torch.empty(len(alt_at), dtype=torch.float32, device=hidden.device)
    width = max(sp.width for sp in spans)
    chosen, top_v, top_i = [], [], []
    for lo in range(0, len(rows), SLICE_ROWS):
        h = hidden.index_select(0, index[lo : lo + SLICE_ROWS])
        lp = torch.log_softmax(model._logits(h).float(), dim=-1)
        chosen.append(lp.gather(1, targets[lo : lo + SLICE_ROWS, None])[:, 0])
        v, i = lp.topk(min(width, lp.shape[-1]), dim=-1)
        top_v.append(v)
        top_i.append(i)
        if alt_at:
            here = ((alt_at_t >= lo) & (alt_at_t < lo + SLICE_ROWS)).nonzero().view(-1).to(hidden.device)
            if here.numel():
                alt_lp[here] = lp[alt_at_t.to(hidden.device)[here] - lo, alt_tok_t[here]]
    lps = torch.cat(chosen).double().tolist()
    vs = torch.cat(top_v).double().tolist()
    ids = torch.cat(top_i).tolist()
    alts = alt_lp.double().tolist()
    out, j, a = [], 0, 0
    for sp in spans:
        mine = []
        for _ in sp.targets:
            mine.append((lps[j], tuple(zip(ids[j][: sp.width], vs[j][: sp.width]))))
            j += 1
        n_alt = len(sp.alternatives) if sp.targets else 0
        out.append((mine, alts[a : a + n_alt]))
        a += n_alt
    return out


def _entry(path: list[Chunk], chunk_size: int, p: int) -> Entry | None:
    scores = path[p // chunk_size].scores
    off = p % chunk_size
    return scores[off] if scores is not None and off < len(scores) else None


def first_missing(path: list[Chunk], chunk_size: int, lo: int, hi: int, width: int) -> int:
    """The first position in [lo, hi) whose entry the tree lacks (or holds with fewer alternatives), else hi."""
    for p in range(lo, hi):
        e = _entry(path, chunk_size, p)
        if e is None or len(e[1]) < width:
            return p
    return hi


def read_stored(path: list[Chunk], chunk_size: int, lo: int, hi: int) -> list[Entry]:
    return [_entry(path, chunk_size, p) for p in range(lo, hi)]  # type: ignore[misc]


def store(path: list[Chunk], chunk_size: int, first: int, entries: list[Entry]) -> None:
    """Keep entries of positions [first, first + len(entries)) with their chunks, where the chunk
    has none yet for that position or one with fewer alternatives."""
    for j, e in enumerate(entries):
        p = first + j
        chunk = path[p // chunk_size]
        off = p % chunk_size
        if chunk.scores is None:
            chunk.scores = [None] * len(chunk.tokens)
        elif len(chunk.scores) < len(chunk.tokens):
            chunk.scores.extend([None] * (len(chunk.tokens) - len(chunk.scores)))
        old = chunk.scores[off]
        if old is None or len(old[1]) < len(e[1]):
            chunk.scores[off] = e
