"""Memory figures of the cache: one source for inspect-tree, run summaries and bench."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from chunkgen.cache.pool import ChunkPool, PoolExhausted
from chunkgen.cache.tree import PrefixTree


@dataclass
class TreeStats:
    sequences: int
    tokens: int  # tokens of all live sequences
    chunks_shared: int  # chunks the live sequences use, with sharing
    chunks_unshared: int  # chunks they would use if each had its own
    bytes_shared: int
    bytes_unshared: int
    sharing_ratio: float  # fraction of chunks saved by sharing
    cached_chunks: int  # chunks kept for reuse that no live sequence reads
    cache_hit_tokens: int  # prompt tokens found in the tree at insert time, since the start
    inserted_tokens: int
    alignment_loss: float  # unused token slots in the live chunks / tokens stored

    def as_dict(self) -> dict:
        return asdict(self)


def unshared_chunks(tree: PrefixTree) -> int:
    c = tree.chunk_size
    return sum(-(-n // c) for n in tree.lengths.values())


def tree_stats(tree: PrefixTree) -> TreeStats:
    live = {id(ch): ch for path in tree.paths.values() for ch in path}
    shared = len(live)
    unshared = unshared_chunks(tree)
    stored = sum(len(ch.tokens) for ch in live.values())
    per = tree.pool.bytes_per_slot
    return TreeStats(
        sequences=len(tree.paths),
        tokens=sum(tree.lengths.values()),
        chunks_shared=shared,
        chunks_unshared=unshared,
        bytes_shared=shared * per,
        bytes_unshared=unshared * per,
        sharing_ratio=1.0 - shared / unshared if unshared else 0.0,
        cached_chunks=tree.cached_chunks,
        cache_hit_tokens=tree.cache_hit_tokens,
        inserted_tokens=tree.inserted_tokens,
        alignment_loss=(shared * tree.chunk_size - stored) / stored if stored else 0.0,
    )


def plan_tree(pool: ChunkPool, prompts: Iterable[list[int]], max_prefill_tokens: int | None = None) -> PrefixTree:
    """The tree a run would build for these prompts, with bookkeeping only (no K/V computed).

    With `max_prefill_tokens`, prompts are grouped into prefill waves by the scheduler's rule: a wave
    closes when its new tokens reach that budget or when the next prompt would reuse a whole chunk
    that the wave is still computing (so no chunk is computed twice: one chunk per distinct
    chunk-aligned prefix). Chunks become matchable only when their wave ends, as in a
    run, so a prompt copies a partial chunk only from an earlier wave and the saved-token count
    is the run's (for a file whose prompts are admitted together, in file order)."""
    tree = PrefixTree(pool)
    wave: list[int] = []
    budget = max_prefill_tokens
    for seq, tokens in enumerate(prompts):
        if max_prefill_tokens is not None and wave and (budget <= 0 or tree.waits_for_pending(tokens)):
            for s in wave:
                tree.mark_ready(s)
            wave, budget = [], max_prefill_tokens
        cached = tree.insert(seq, tokens)
        if max_prefill_tokens is None:
            tree.mark_ready(seq)
        else:
            wave.append(seq)
            budget -= len(tokens) - cached
    for s in wave:
        tree.mark_ready(s)
    return tree


class CacheReplay:
    """The prompt tokens a run's prefix cache serves when prompts run in a given order, without the
    model: each prompt is inserted into a PrefixTree of the run's KV budget (bookkeeping only)
    while the `live` prompts before it still hold their chunks, as a batch decoding together does,
    and the tree evicts cached chunks least recently used first, as a run's does. Generated tokens
    are not modelled, so a run with long answers evicts somewhat sooner."""

    def __init__(self, pool: ChunkPool, live: int) -> None:
        self.tree = PrefixTree(pool)
        self.live = max(1, live)
        self._running: deque[int] = deque()
        self._next = 0
        self.too_long = 0  # prompts that do not fit the budget at all (a run refuses them)

    def add(self, tokens: list[int]) -> None:
        if not tokens:
            return
        seq, self._next = self._next, self._next + 1
        while True:
            try:
                self.tree.insert(seq, tokens)
                break
            except PoolExhausted:
                if not self._running:
                    self.too_long += 1
                    return
                self.tree.remove(self._running.popleft())
        self.tree.mark_ready(seq)
        self._running.append(seq)
        if len(self._running) > self.live:
            self.tree.remove(self._running.popleft())

    @property
    def prompt_tokens(self) -> int:
        return self.tree.inserted_tokens

    @property
    def cached_tokens(self) -> int:
        return self.tree.cache_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
