"""PrefixTree: the KV cache as a forest of fixed-size chunks shared by every sequence through them.

Each path from a root to a node is a token prefix; a sequence is a path. Invariants:
- every chunk on a path is full except possibly the last (the sequence's tail), so a partial chunk
  has no children and token position p lives in chunk p // chunk_size at offset p % chunk_size;
- a sequence writes only into a tail that no other live sequence reads (copy-on-write otherwise);
- `ref` counts the live sequences whose path passes through a chunk, so it never grows downwards.
Chunks whose last sequence left stay as a cache until the pool needs their slots (LRU leaves first).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Hashable, Sequence

from chunkgen.cache.pool import ChunkPool, PoolExhausted

SeqId = Hashable


@dataclass(eq=False)
class Chunk:
    slot: int
    tokens: list[int]
    parent: "Chunk | None"
    children: list["Chunk"] = field(default_factory=list)
    ref: int = 0
    last_used: int = 0
    ready: bool = False  # K/V written; only ready chunks are matched by later prompts

    def __repr__(self) -> str:  # the default would recurse through parent/children
        return f"Chunk(slot={self.slot}, n={len(self.tokens)}, ref={self.ref}, children={len(self.children)})"


class Append(Enum):
    IN_PLACE = 0  # the token went into the sequence's own tail chunk
    NEW_CHUNK = 1  # the tail was full: a new private chunk (shared structure unchanged)
    COPIED = 2  # the tail was a shared partial chunk: copied to a private one (structure changed)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixTree:
    def __init__(self, pool: ChunkPool, share: bool = True) -> None:
        self.pool = pool
        self.chunk_size = pool.chunk_size
        self.share = share
        self.root = Chunk(slot=-1, tokens=[], parent=None)
        self.paths: dict[SeqId, list[Chunk]] = {}
        self.lengths: dict[SeqId, int] = {}
        self.version = 0  # bumped when the set of sequences or the shared structure changes
        self._clock = 0
        self._evictable: dict[Chunk, None] = {}  # ref-0 leaves, in no particular order
        self.cache_hit_tokens = 0
        self.inserted_tokens = 0

    # -- joins -------------------------------------------------------------------------------
    def insert(self, seq: SeqId, tokens: Sequence[int]) -> int:
        """Add a sequence; returns how many leading tokens already have K/V in the tree.

        The caller must then write K/V for positions [returned, len(tokens)). Raises PoolExhausted
        (leaving tree and pool unchanged, apart from evicted cache) when the chunks do not fit.
        """
        if seq in self.paths:
            raise KeyError(f"sequence {seq!r} is already in the tree")
        tokens = list(tokens)
        if not tokens:
            raise ValueError("cannot insert an empty sequence")
        path, copy_src, copy_len, i = self._match(tokens, include_pending=False)
        C = self.chunk_size
        n_new = -(-(len(tokens) - i) // C)
        for c in path:
            self._acquire(c)
        if copy_src is not None:
            copy_src.ref += 1  # pinned while slots are found, so eviction cannot take it
            self._evictable.pop(copy_src, None)
        slots: list[int] = []
        try:
            for _ in range(n_new):
                slots.append(self._allocate())
        except PoolExhausted:
            for s in slots:
                self.pool.free(s)
            for c in path:
                self._release(c)
            if copy_src is not None:
                self._release(copy_src)
            raise
        if copy_src is not None:
            self.pool.copy_tokens(copy_src.slot, slots[0], copy_len)
            self._release(copy_src)

        parent = path[-1] if path else self.root
        for j, slot in enumerate(slots):
            chunk = Chunk(slot=slot, tokens=tokens[i + j * C : i + (j + 1) * C], parent=parent)
            self._attach(chunk)
            self._acquire(chunk)
            path.append(chunk)
            parent = chunk
        self.paths[seq] = path
        self.lengths[seq] = len(tokens)
        cached = i + copy_len
        self.cache_hit_tokens += cached
        self.inserted_tokens += len(tokens)
        self.version += 1
        return cached

    def _match(self, tokens: list[int], include_pending: bool) -> tuple[list[Chunk], Chunk | None, int, int]:
        """Longest cached prefix: (whole chunks to share, chunk to copy a partial match from,
        tokens to copy, tokens covered by the shared chunks)."""
        C = self.chunk_size
        path: list[Chunk] = []
        node, i = self.root, 0
        while self.share and i < len(tokens):
            rest = tokens[i : i + C]
            best, best_len = None, 0
            for child in node.children:
                if child.ready or include_pending:
                    n = _common_prefix(child.tokens, rest)
                    if n > best_len:
                        best, best_len = child, n
            if best is None:
                break
            if best_len == len(best.tokens) == len(rest):
                path.append(best)  # whole chunk matches (a full chunk, or an identical tail)
                i += best_len
                node = best
                continue
            return path, best, best_len, i  # diverges inside this chunk: copy, don't recompute
        return path, None, 0, i

    def pending_gain(self, tokens: Sequence[int]) -> int:
        """How many more prompt tokens would be cached once the chunks still being prefilled are
        ready: a large gain means the prompt should wait for them instead of recomputing."""
        tokens = list(tokens)
        _, _, with_len, with_i = self._match(tokens, include_pending=True)
        _, _, now_len, now_i = self._match(tokens, include_pending=False)
        return (with_i + with_len) - (now_i + now_len)

    def mark_ready(self, seq: SeqId) -> None:
        """The sequence's K/V are all written: its chunks may now be matched by other prompts."""
        for chunk in self.paths[seq]:
            chunk.ready = True

    # -- decode ------------------------------------------------------------------------------
    def append(self, seq: SeqId, token: int) -> tuple[int, int, Append]:
        """Reserve the next position of `seq` for `token`; returns (slot, offset, what happened)."""
        path = self.paths[seq]
        tail = path[-1]
        C = self.chunk_size
        n = len(tail.tokens)
        if n < C and tail.ref == 1:
            tail.tokens.append(token)
            kind = Append.IN_PLACE
            slot, offset = tail.slot, n
        elif n < C:  # another live sequence reads this partial tail: copy it before writing
            chunk = Chunk(slot=self._allocate(), tokens=tail.tokens + [token], parent=tail.parent, ready=True)
            self.pool.copy_tokens(tail.slot, chunk.slot, n)
            self._attach(chunk)
            self._acquire(chunk)
            self._release(tail)
            path[-1] = chunk
            self.version += 1
            kind, slot, offset = Append.COPIED, chunk.slot, n
        else:
            chunk = Chunk(slot=self._allocate(), tokens=[token], parent=tail, ready=True)
            self._attach(chunk)
            self._acquire(chunk)
            path.append(chunk)
            kind, slot, offset = Append.NEW_CHUNK, chunk.slot, 0
        self.lengths[seq] += 1
        return slot, offset, kind

    # -- leaves ------------------------------------------------------------------------------
    def remove(self, seq: SeqId, keep_cache: bool = True) -> None:
        """Drop a sequence. Its chunks stay as cache unless sharing is off or keep_cache is False
        (e.g. its K/V were never fully written), in which case unreferenced chunks are freed."""
        path = self.paths.pop(seq)
        del self.lengths[seq]
        for chunk in reversed(path):
            self._release(chunk)
            if chunk.ref == 0 and not chunk.children and (not keep_cache or not self.share):
                self._evictable.pop(chunk, None)
                self._detach_and_free(chunk)
        self.version += 1

    # -- queries -----------------------------------------------------------------------------
    def tokens(self, seq: SeqId) -> list[int]:
        return [t for c in self.paths[seq] for t in c.tokens]

    def slots(self, seq: SeqId) -> list[int]:
        return [c.slot for c in self.paths[seq]]

    def positions(self, seq: SeqId, start: int, end: int) -> tuple[list[int], list[int]]:
        """(slot, offset) of token positions [start, end) of a sequence."""
        C = self.chunk_size
        path = self.paths[seq]
        return [path[p // C].slot for p in range(start, end)], [p % C for p in range(start, end)]

    def batch_order(self) -> list[SeqId]:
        """Live sequences in leaf (DFS) order: every chunk covers a contiguous run of them."""
        ending: dict[int, list[SeqId]] = {}
        for seq, path in self.paths.items():
            ending.setdefault(id(path[-1]), []).append(seq)
        order: list[SeqId] = []
        stack = [c for c in reversed(self.root.children) if c.ref > 0]
        while stack:
            node = stack.pop()
            order.extend(ending.get(id(node), ()))
            stack.extend(c for c in reversed(node.children) if c.ref > 0)
        return order

    def iter_chunks(self):
        stack = list(self.root.children)
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children)

    @property
    def evictable_chunks(self) -> int:
        """Cached leaves that can be evicted right now (evicting them may expose more)."""
        return len(self._evictable)

    @property
    def cached_chunks(self) -> int:
        """Chunks no live sequence reads, kept for later prompts with the same prefix."""
        return sum(1 for c in self.iter_chunks() if c.ref == 0)

    # -- internals ---------------------------------------------------------------------------
    def _allocate(self) -> int:
        while True:
            try:
                return self.pool.allocate()
            except PoolExhausted:
                if not self._evict_one():
                    raise

    def _evict_one(self) -> bool:
        if not self._evictable:
            return False
        victim = min(self._evictable, key=lambda c: c.last_used)
        del self._evictable[victim]
        self._detach_and_free(victim)
        return True

    def _detach_and_free(self, chunk: Chunk) -> None:
        parent = chunk.parent
        parent.children.remove(chunk)
        self.pool.free(chunk.slot)
        if parent is not self.root and parent.ref == 0 and not parent.children:
            self._evictable[parent] = None

    def _attach(self, chunk: Chunk) -> None:
        chunk.parent.children.append(chunk)
        self._evictable.pop(chunk.parent, None)

    def _acquire(self, chunk: Chunk) -> None:
        chunk.ref += 1
        self._clock += 1
        chunk.last_used = self._clock
        self._evictable.pop(chunk, None)

    def _release(self, chunk: Chunk) -> None:
        chunk.ref -= 1
        self._clock += 1
        chunk.last_used = self._clock
        if chunk.ref == 0 and not chunk.children:
            self._evictable[chunk] = None

    def check(self) -> None:
        """Full invariant check, for tests (O(tree))."""
        self.pool.check()
        C = self.chunk_size
        refs: dict[int, int] = {}
        for seq, path in self.paths.items():
            assert path, f"{seq!r} has an empty path"
            assert path[0].parent is self.root
            for a, b in zip(path, path[1:]):
                assert b.parent is a and len(a.tokens) == C, "non-tail chunk must be full"
            assert sum(len(c.tokens) for c in path) == self.lengths[seq]
            for c in path:
                refs[id(c)] = refs.get(id(c), 0) + 1
        seen_slots: set[int] = set()
        n_chunks = 0
        for c in self.iter_chunks():
            n_chunks += 1
            assert c.ref == refs.get(id(c), 0), f"ref mismatch on {c}"
            assert 1 <= len(c.tokens) <= C
            assert not c.children or len(c.tokens) == C, "a partial chunk cannot have children"
            assert c.slot not in seen_slots, "two chunks share a slot"
            seen_slots.add(c.slot)
            assert (c in self._evictable) == (c.ref == 0 and not c.children)
        assert n_chunks == self.pool.used, f"{n_chunks} chunks but {self.pool.used} slots used"
        assert not seen_slots & set(self.pool._free), "a slot is both free and used"
