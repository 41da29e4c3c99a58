"""PendingPrefixes: what the prompts still to come could take from the cache, so the chunks no
such prompt can share are released at once instead of kept until the pool is full.

A prompt takes a cached chunk in one of two ways (PrefixTree._match): whole, when its tokens
from the chunk's start on hold the chunk's tokens (a full chunk, or an identical tail), or as the
source of a copy, when they part inside the chunk (a prefix of it is copied, not recomputed). So a
prompt is kept as the keys of its chunk-aligned pieces, each key naming a piece together with the
whole path before it (a chained hash), and of the first 1, 2, 4, ... tokens of each piece (the
lengths the tree indexes partial matches at). A cached chunk is shared whole when its own key is
among the pending ones, and is a copy source when one of its leading-token keys is: of several
cached chunks that offer a prompt the same copy, one is enough.

Keys are hashes: two different prefixes with the same key (a collision) keep a chunk that could
have gone, never the other way round.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from chunkgen.cache.tree import Chunk

ROOT_KEY = 0


def piece_key(parent: int, tokens: Sequence[int]) -> int:
    """The key of a piece of tokens that follows the path whose key is `parent`."""
    return hash((parent, tuple(tokens)))


def partial_levels(chunk_size: int) -> list[int]:
    """Leading-token counts a partial match is indexed at (PrefixTree._levels): 1, 2, 4, ... below a chunk."""
    return [1 << k for k in range(chunk_size.bit_length()) if (1 << k) < chunk_size]


def prompt_keys(tokens: Sequence[int], chunk_size: int) -> list[int]:
    """Every key under which a prompt of these tokens could take a cached chunk."""
    levels = partial_levels(chunk_size)
    keys: list[int] = []
    parent = ROOT_KEY
    for start in range(0, len(tokens), chunk_size):
        piece = tokens[start : start + chunk_size]
        keys.extend(piece_key(parent, piece[:n]) for n in levels if n < len(piece))
        parent = piece_key(parent, piece)
        keys.append(parent)
    return keys


class PendingPrefixes:
    """The keys of the prompts still to come (a multiset: prompts sharing a prefix share keys)."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._levels = partial_levels(chunk_size)
        self._count: Counter[int] = Counter()
        self._keys: dict[Hashable, list[int]] = {}
        self.version = 0  # bumped when the set of prompts changes

    def add(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        keys = self._keys[seq_id] = prompt_keys(tokens, self.chunk_size)
        self._count.update(keys)
        self.version += 1

    def discard(self, seq_id: Hashable) -> None:
        keys = self._keys.pop(seq_id, None)
        if keys is None:
            return
        self._count.subtract(keys)
        for k in keys:
            if self._count[k] <= 0:
                del self._count[k]
        self.version += 1

    def __len__(self) -> int:
        return len(self._keys)

    # -- what a cached chunk is to them ---------------------------------------------------------
    def path_key(self, chunk: Chunk) -> int:
        """The key of the path from the root through `chunk` (kept on full chunks, which never change)."""
        if chunk.parent is None:
            return ROOT_KEY
        if chunk.key is not None and len(chunk.tokens) == self.chunk_size:
            return chunk.key
        key = piece_key(self.path_key(chunk.parent), chunk.tokens)
        if len(chunk.tokens) == self.chunk_size:
            chunk.key = key
        return key

    def shares_whole(self, chunk: Chunk) -> bool:
        """Whether a prompt to come holds the chunk's whole path."""
        return self.path_key(chunk) in self._count

    def copy_key(self, chunk: Chunk) -> int | None:
        """The key of the longest leading part of the chunk that a prompt to come parts inside of
        (it would copy those tokens from this chunk or from another offering the same), or None."""
        parent = self.path_key(chunk.parent)
        for n in reversed(self._levels):
            if n < len(chunk.tokens):
                key = piece_key(parent, chunk.tokens[:n])
                if key in self._count:
                    return key
        return None
