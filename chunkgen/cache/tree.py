"""PrefixTree: the KV cache as a forest of fixed-size chunks shared by every sequence through them.

Each path from a root to a node is a token prefix; a sequence is a path. Invariants:
- every chunk on a path is full except possibly the last (the sequence's tail), so a partial chunk
  has no children and token position p lives in chunk p // chunk_size at offset p % chunk_size;
- a sequence writes only into a tail that no other live sequence reads (copy-on-write otherwise);
- `ref` counts the live sequences whose path passes through a chunk, so it never grows downwards;
- a chunk whose K/V are not all written yet (not `ready`) belongs to exactly one live sequence.
Chunks whose last sequence left stay as a cache until the pool needs their slots (LRU leaves first),
or until `release_unshared` finds that no prompt still to come can share them.

Matching a prompt costs O(prompt length), whatever the number of cached prompts: children are
indexed by their whole token tuple (a full-chunk match is a dict lookup) and by their first 1, 2,
4, ... tokens (an in-chunk divergence is found from the longest indexed prefix it shares).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

from chunkgen.cache.pool import ChunkPool, PoolExhausted

if TYPE_CHECKING:
    from chunkgen.cache.pending import PendingPrefixes

SeqId = Hashable
# Candidates compared token by token when a prompt diverges inside a chunk (see _match_partial).
REFINE_CANDIDATES = 4


@dataclass(eq=False)
class Chunk:
    slot: int
    tokens: list[int]
    parent: Chunk | None
    children: list[Chunk] = field(default_factory=list)
    ref: int = 0
    last_used: int = 0
    ready: bool = False  # K/V written; only ready chunks are matched by later prompts
    pos: int = 0  # index in parent.children, so a detach is O(1)
    # Prompt logprobs of its tokens, once a scored prompt computed them (engine/prompt_scores.py):
    # one entry per token, None where not computed. Kept with the chunk so a shared prefix is scored once.
    scores: list | None = None
    key: int | None = None  # of its whole path, once full (cache/pending.py)

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


# (id of the parent chunk, tokens) -> the parent's children with those tokens (an ordered set:
# identical siblings exist, e.g. a chunk still being prefilled and its ready twin, or no sharing).
_Key = tuple[int, tuple[int, ...]]
_Index = dict[_Key, dict[Chunk, None]]


ENTER, LEAVE, ROWS = "enter", "leave", "rows"  # LiveForest.walk's events
Row = tuple[SeqId, list[Chunk]]  # a live sequence and its private chunks (its path's tail)


class LiveForest(NamedTuple):
    """PrefixTree.live_forest: for the root and each shared live chunk (by id), `ends` the
    sequences whose path ends there, and `below` what hangs under it in the order the paths first
    reach it: shared children (Chunk) and runs of sequences that go on alone (lists of Row)."""

    root: Chunk
    ends: dict[int, list[Row]]
    below: dict[int, list[Chunk | list[Row]]]

    def walk(self) -> Iterator[tuple[str, Chunk | list[Row]]]:
        """The forest depth first, as events: (ENTER, chunk) and (LEAVE, chunk) around a shared
        chunk's subtree, and (ROWS, rows) for its sequences, in leaf order: every shared chunk's
        rows come between its ENTER and its LEAVE. Runs of rows come whole, so a caller's work
        per row can be one list operation over the run."""
        stack: list = list(reversed(self.below.get(id(self.root), ())))
        while stack:
            item = stack.pop()
            if type(item) is list:
                yield ROWS, item
            elif type(item) is tuple:  # (chunk,): its subtree is done
                yield LEAVE, item[0]
            else:
                yield ENTER, item
                ending = self.ends.get(id(item))
                if ending:
                    yield ROWS, ending
                stack.append((item,))
                stack.extend(reversed(self.below.get(id(item), ())))


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
        self._evictable: dict[Chunk, None] = {}  # ref-0 leaves
        self._lru: list[tuple[int, int, Chunk]] = []  # heap of (last_used, tiebreak, chunk); stale entries skipped
        self._tiebreak = itertools.count()
        self._whole: _Index = {}
        self._prefix: _Index = {}
        # Prefix lengths indexed: powers of two below the chunk size (a common prefix of a whole
        # chunk is a whole match, found in _whole).
        self._levels = [1 << k for k in range(self.chunk_size.bit_length()) if (1 << k) < self.chunk_size]
        # Tails appended to in place since they were last indexed -> the length they are indexed at.
        self._grown: dict[Chunk, int] = {}
        self.cache_hit_tokens = 0
        self.inserted_tokens = 0
        self.live_chunks = 0  # chunks a live sequence reads (ref > 0); the rest of pool.used is cache
        self.live_peak = 0
        self.released_chunks = 0  # cached chunks freed because no prompt to come could share them

    # -- joins -------------------------------------------------------------------------------
    def insert(self, seq: SeqId, tokens: Sequence[int], reserve: int = 0) -> int:
        """Add a sequence; returns how many leading tokens already have K/V in the tree.

        The caller must then write K/V for positions [returned, len(tokens)) and call mark_ready.
        Fewer than match_len(tokens) when the cached chunk a partial match would be copied from
        has to be evicted to make room: those tokens are recomputed (a live chunk as long is
        preferred as the source, so this happens only when none is).
        Raises PoolExhausted when the chunks do not fit, leaving the tree unchanged apart from
        cache evicted while looking for slots; or, before touching anything, when fewer than
        `reserve` chunks would be left free or evictable afterwards (counting evictable leaves
        only, so it errs on the safe side).
        """
        if seq in self.paths:
            raise KeyError(f"sequence {seq!r} is already in the tree")
        tokens = list(tokens)
        if not tokens:
            raise ValueError("cannot insert an empty sequence")
        path, copy_src, copy_len, i = self._match(tokens, include_pending=False)
        C = self.chunk_size
        n_new = -(-(len(tokens) - i) // C)
        if reserve > 0:
            pinned = sum(1 for c in (path[-1] if path else None, copy_src) if c is not None and c in self._evictable)
            left = self.pool.free_slots + len(self._evictable) - pinned - n_new
            if left < reserve:
                raise PoolExhausted(f"inserting would leave {left} chunks free or evictable, {reserve} are reserved")
        for c in path:
            self._acquire(c)
        if copy_src is not None:
            self._acquire(copy_src)  # pinned while slots are found, so eviction cannot take it
        slots: list[int] = []
        while len(slots) < n_new:
            try:
                slots.append(self._allocate())
            except PoolExhausted:
                if copy_src is None:
                    for s in slots:
                        self.pool.free(s)
                    for c in path:
                        self._release(c)
                    raise
                # The pinned copy source may hold the very slot that is missing: recompute instead.
                self._release(copy_src)
                copy_src, copy_len = None, 0
        copied_scores = None
        if copy_src is not None:
            self.pool.copy_tokens(copy_src.slot, slots[0], copy_len)
            if copy_src.scores is not None:
                copied_scores = copy_src.scores[:copy_len]
            self._release(copy_src)

        parent = path[-1] if path else self.root
        for j, slot in enumerate(slots):
            chunk = Chunk(slot=slot, tokens=tokens[i + j * C : i + (j + 1) * C], parent=parent)
            if j == 0 and copied_scores is not None:
                chunk.scores = copied_scores + [None] * (len(chunk.tokens) - len(copied_scores))
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
        self._settle_all()
        C, n = self.chunk_size, len(tokens)
        path: list[Chunk] = []
        node, i = self.root, 0
        while self.share and i < n:
            whole = None
            for chunk in self._whole.get((id(node), tuple(tokens[i : i + C]))) or ():
                if chunk.ready or include_pending:
                    whole = chunk
                    break
            if whole is not None:  # a full chunk, or an identical tail
                path.append(whole)
                i += len(whole.tokens)
                node = whole
                continue
            best, best_len = self._match_partial(node, tokens[i : i + C], include_pending)
            if best is None:
                break
            return path, best, best_len, i  # diverges inside this chunk: copy, don't recompute
        return path, None, 0, i

    def _match_partial(self, node: Chunk, rest: list[int], include_pending: bool) -> tuple[Chunk | None, int]:
        """The child of node sharing the most leading tokens with rest, found from the longest
        indexed prefix length L (a power of two) any child shares, comparing at most
        REFINE_CANDIDATES of those children. An approximation: the true best shares fewer than 2L
        tokens (else it would be indexed at 2L), so this copies more than half of what a scan of
        every child would, and usually all of it; the rest is recomputed."""
        for L in reversed(self._levels):
            if L > len(rest):
                continue
            bucket = self._prefix.get((id(node), tuple(rest[:L])))
            if not bucket:
                continue
            best, best_len, tried = None, 0, 0
            for child in bucket:
                if child.ready or include_pending:
                    n = _common_prefix(child.tokens, rest)
                    # a live chunk over a cached one as long: eviction may need the cached one's slot
                    if n > best_len or (n == best_len and best is not None and best.ref == 0 < child.ref):
                        best, best_len = child, n
                    tried += 1
                    if tried == REFINE_CANDIDATES:
                        break
            if best is not None:
                return best, best_len
        return None, 0

    def match_len(self, tokens: Sequence[int]) -> int:
        """Leading tokens whose K/V insert(tokens) would find in the tree now (shared or copied)."""
        _, _, copy_len, i = self._match(list(tokens), include_pending=False)
        return i + copy_len

    def waits_for_pending(self, tokens: Sequence[int]) -> bool:
        """Whether the prompt would share a whole chunk that is still being prefilled: inserted now,
        it would compute a second copy of that chunk (however few tokens that is), so it should
        wait for the chunk instead. Every prompt that waits when this says so leaves the tree with
        one chunk per distinct chunk-aligned prefix, the fewest a chunk-granular tree can hold."""
        path, _, _, _ = self._match(list(tokens), include_pending=True)
        return any(not c.ready for c in path)

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
            # Re-indexed when next needed (a match, a detach), not on every decode token.
            self._grown.setdefault(tail, n)
            tail.tokens.append(token)
            kind = Append.IN_PLACE
            slot, offset = tail.slot, n
        elif n < C:  # another live sequence reads this partial tail: copy it before writing
            chunk = Chunk(slot=self._allocate(), tokens=tail.tokens + [token], parent=tail.parent, ready=True)
            if tail.scores is not None:
                chunk.scores = tail.scores[:n] + [None]
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

    def append_all(self, seqs: Sequence[SeqId], tokens: Sequence[int], out: dict[SeqId, tuple[int, int]]) -> int:
        """append(seqs[i], tokens[i]) for each in turn, its (slot, offset) put in `out`, until one
        finds no chunk: returns how many were appended (fewer than len(seqs): the next one raised
        PoolExhausted and changed nothing). A decode step's common case, a private tail with room,
        is done inline: one step of 256 rows is 256 of these."""
        paths, lengths, grown, C = self.paths, self.lengths, self._grown, self.chunk_size
        for i, seq in enumerate(seqs):
            tail = paths[seq][-1]
            n = len(tail.tokens)
            if n < C and tail.ref == 1:
                if tail not in grown:
                    grown[tail] = n
                tail.tokens.append(tokens[i])
                lengths[seq] += 1
                out[seq] = (tail.slot, n)
                continue
            try:
                slot, offset, _ = self.append(seq, tokens[i])
            except PoolExhausted:
                return i
            out[seq] = (slot, offset)
        return len(seqs)

    # -- leaves ------------------------------------------------------------------------------
    def remove(self, seq: SeqId) -> None:
        """Drop a sequence. Chunks no other sequence reads stay as cache when sharing is on and
        their K/V were written (`ready`); the others, e.g. those of a prefill that never ran, are
        freed. So removing a sequence never loses cache it found when it was inserted."""
        path = self.paths.pop(seq)
        del self.lengths[seq]
        for chunk in reversed(path):
            self._release(chunk)
            if chunk.ref == 0 and not chunk.children and (not chunk.ready or not self.share):
                self._evictable.pop(chunk, None)
                self._detach_and_free(chunk)
        self.version += 1

    def release_unshared(self, pending: PendingPrefixes) -> int:
        """Free the cached chunks (ref 0) that no prompt in `pending` can share: not whole, and not
        as the source of a copy, where one cached chunk per copy is enough (the most recently used
        one: in prefix order the nearest). The caller vouches that prompts not in `pending` share
        nothing these do not (they come later in prefix order, or there are none). Returns how
        many chunks were freed."""
        freed = 0
        stack: list[Chunk] = []
        served: set[int] = set()  # copies that a chunk kept whole offers anyway
        for chunk in self._evictable:
            if pending.shares_whole(chunk):
                key = pending.copy_key(chunk)
                if key is not None:
                    served.add(key)
            else:
                stack.append(chunk)
        copy_source: dict[int, Chunk] = {}
        while stack:
            chunk = stack.pop()
            if chunk not in self._evictable or pending.shares_whole(chunk):
                continue
            key = pending.copy_key(chunk)
            if key is not None and key not in served:
                kept = copy_source.setdefault(key, chunk)
                if kept is chunk:
                    continue
                if kept.last_used < chunk.last_used:  # keep the newer one, free the other
                    copy_source[key], chunk = chunk, kept
            parent = chunk.parent
            del self._evictable[chunk]
            self._detach_and_free(chunk)
            freed += 1
            if parent in self._evictable:  # its last child gone: it may go too
                stack.append(parent)
        self.released_chunks += freed  # (live paths unchanged: no new version)
        return freed

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

    def live_forest(self) -> LiveForest:
        """The live sequences' paths as a forest of their shared chunks (ref > 1), each sequence
        hung from the deepest one with its private chunks (ref 1, always the path's tail: a ref
        never grows downwards). A path is walked from its tail up to the first chunk already
        seen, so the cost is the live chunks' count, not the paths' lengths."""
        root = self.root
        ends: dict[int, list[Row]] = {}
        below: dict[int, list[Chunk | list[Row]]] = {}
        seen: set[int] = {id(root)}
        last, run = None, []  # the previous sequence's anchor, and the run of rows it joined
        for seq, path in self.paths.items():
            i = len(path)
            while i and path[i - 1].ref == 1:
                i -= 1
            anchor = path[i - 1] if i else root
            if i == len(path):
                ends.setdefault(id(anchor), []).append((seq, []))
                last = None
            elif anchor is last:  # nothing hung there since: the same run, the chunks above seen
                run.append((seq, path[i:]))
                continue
            else:
                under = below.setdefault(id(anchor), [])
                if under and type(under[-1]) is list:  # the run of rows hung there last
                    run = under[-1]
                else:
                    run = []
                    under.append(run)
                run.append((seq, path[i:]))
                last = anchor
            node = anchor
            while id(node) not in seen:
                seen.add(id(node))
                below.setdefault(id(node.parent), []).append(node)
                node = node.parent
        return LiveForest(root, ends, below)

    def batch_order(self) -> list[SeqId]:
        """Live sequences in leaf (DFS) order: every chunk covers a contiguous run of them.
        Walks the live chunks only, so the cached chunks beside them cost nothing."""
        return [seq for kind, item in self.live_forest().walk() if kind is ROWS for seq, _ in item]

    def iter_chunks(self) -> Iterator[Chunk]:
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
        """Free the least recently used cached leaf, if any."""
        while self._lru:
            last_used, _, victim = heapq.heappop(self._lru)
            # Entries go stale when a chunk is used again (new last_used) or stops being a leaf.
            if victim in self._evictable and victim.last_used == last_used:
                del self._evictable[victim]
                self._detach_and_free(victim)
                return True
        return False

    def _make_evictable(self, chunk: Chunk) -> None:
        self._evictable[chunk] = None
        heapq.heappush(self._lru, (chunk.last_used, next(self._tiebreak), chunk))
        if len(self._lru) > 2 * len(self._evictable) + 64:  # drop stale entries now and then
            self._lru = [(c.last_used, next(self._tiebreak), c) for c in self._evictable]
            heapq.heapify(self._lru)

    def _detach_and_free(self, chunk: Chunk) -> None:
        parent = chunk.parent
        self._settle(chunk)
        self._unindex_whole(chunk)
        for L in self._levels:
            if L > len(chunk.tokens):
                break
            self._drop(self._prefix, chunk, L)
        siblings = parent.children
        last = siblings.pop()
        if last is not chunk:  # move the last sibling into its place
            siblings[chunk.pos] = last
            last.pos = chunk.pos
        self.pool.free(chunk.slot)
        if parent is not self.root and parent.ref == 0 and not parent.children:
            self._make_evictable(parent)

    def _attach(self, chunk: Chunk) -> None:
        parent = chunk.parent
        chunk.pos = len(parent.children)
        parent.children.append(chunk)
        self._index_whole(chunk)
        for L in self._levels:
            if L > len(chunk.tokens):
                break
            self._add(self._prefix, chunk, L)
        self._evictable.pop(parent, None)

    def _settle(self, chunk: Chunk) -> None:
        """Bring the indexes of a tail grown in place up to its tokens."""
        old = self._grown.pop(chunk, None)
        if old is None:
            return
        self._drop(self._whole, chunk, old, tuple(chunk.tokens[:old]))
        self._index_whole(chunk)
        for L in self._levels:
            if old < L <= len(chunk.tokens):
                self._add(self._prefix, chunk, L)

    def _settle_all(self) -> None:
        for chunk in list(self._grown):
            self._settle(chunk)

    def _index_whole(self, chunk: Chunk) -> None:
        self._add(self._whole, chunk, len(chunk.tokens))

    def _unindex_whole(self, chunk: Chunk) -> None:
        self._drop(self._whole, chunk, len(chunk.tokens))

    @staticmethod
    def _add(index: _Index, chunk: Chunk, n: int) -> None:
        index.setdefault((id(chunk.parent), tuple(chunk.tokens[:n])), {})[chunk] = None

    @staticmethod
    def _drop(index: _Index, chunk: Chunk, n: int, tokens: tuple[int, ...] | None = None) -> None:
        key = (id(chunk.parent), tuple(chunk.tokens[:n]) if tokens is None else tokens)
        bucket = index[key]
        del bucket[chunk]
        if not bucket:
            del index[key]

    def _acquire(self, chunk: Chunk) -> None:
        if chunk.ref == 0:
            self.live_chunks += 1
            self.live_peak = max(self.live_peak, self.live_chunks)
        chunk.ref += 1
        self._clock += 1
        chunk.last_used = self._clock
        self._evictable.pop(chunk, None)

    def _release(self, chunk: Chunk) -> None:
        chunk.ref -= 1
        if chunk.ref == 0:
            self.live_chunks -= 1
        self._clock += 1
        chunk.last_used = self._clock
        if chunk.ref == 0 and not chunk.children:
            self._make_evictable(chunk)

    def check(self) -> None:
        """Full invariant check, for tests (O(tree)); indexes of tails grown in place are settled first."""
        self._settle_all()
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
        n_chunks = n_keys = 0
        for c in self.iter_chunks():
            n_chunks += 1
            assert c.ref == refs.get(id(c), 0), f"ref mismatch on {c}"
            assert c.ready or c.ref == 1, f"{c} is unwritten yet not owned by exactly one sequence"
            assert 1 <= len(c.tokens) <= C
            assert not c.children or len(c.tokens) == C, "a partial chunk cannot have children"
            assert c.parent.children[c.pos] is c, "stale position in the parent's children"
            assert c.slot not in seen_slots, "two chunks share a slot"
            seen_slots.add(c.slot)
            assert (c in self._evictable) == (c.ref == 0 and not c.children)
            assert c in self._whole[(id(c.parent), tuple(c.tokens))]
            for L in self._levels:
                if L <= len(c.tokens):
                    assert c in self._prefix[(id(c.parent), tuple(c.tokens[:L]))]
                    n_keys += 1
        assert sum(map(len, self._whole.values())) == n_chunks, "whole-token index out of date"
        assert sum(map(len, self._prefix.values())) == n_keys, "prefix index out of date"
        queued = {id(c) for last_used, _, c in self._lru if c.last_used == last_used}
        assert all(id(c) in queued for c in self._evictable), "an evictable chunk is missing from the LRU heap"
        assert n_chunks == self.pool.used, f"{n_chunks} chunks but {self.pool.used} slots used"
        assert self.live_chunks == len(refs), f"{self.live_chunks} live chunks counted, {len(refs)} read"
        assert not seen_slots & set(self.pool._free), "a slot is both free and used"
