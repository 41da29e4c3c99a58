"""PendingPrefixes and PrefixTree.release_unshared: a cached chunk is freed exactly when no prompt
still to come can take it (whole, or as the one copy source it needs), on hand-made and random trees."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkgen.cache import ChunkPool, PrefixTree
from chunkgen.cache.pending import PendingPrefixes, partial_levels, prompt_keys

C = 8


def tree_of(slots: int = 4096) -> PrefixTree:
    pool = ChunkPool(1, 1, 4, C, torch.float32, budget_bytes=slots * 2 * 4 * C * 4, storage=False)
    return PrefixTree(pool)


def finish(tree: PrefixTree, prompts: dict[str, list[int]]) -> None:
    """Rows that ran and finished: their chunks are cache now."""
    for seq, tokens in prompts.items():
        tree.insert(seq, tokens)
        tree.mark_ready(seq)
    for seq in prompts:
        tree.remove(seq)


def pending_of(*prompts: list[int]) -> PendingPrefixes:
    pending = PendingPrefixes(C)
    for i, p in enumerate(prompts):
        pending.add(i, p)
    return pending


def cached_paths(tree: PrefixTree) -> list[list[int]]:
    """Tokens of the path to each cached leaf."""
    out = []
    for c in tree.iter_chunks():
        if c.ref == 0 and not c.children:
            path, node = [], c
            while node.parent is not None:
                path = node.tokens + path
                node = node.parent
            out.append(path)
    return sorted(out)


SYSTEM = list(range(100, 100 + 2 * C + 3))  # two full chunks and 3 tokens of a third


def test_chunks_no_pending_prompt_can_share_are_freed_and_shared_ones_kept():
    tree = tree_of()
    finish(tree, {"a": SYSTEM + [1, 2], "b": SYSTEM + [7, 8, 9], "other": [50] * (2 * C + 1)})
    assert tree.pool.used == 2 + 2 + 3  # the system's two full chunks, a's and b's tails, other's three
    # A prompt to come shares the system prompt and parts inside the third chunk: it keeps the two
    # full chunks whole and one of the two tails to copy the system's 3 tokens from; "other" goes.
    freed = tree.release_unshared(pending_of(SYSTEM + [4, 4, 4]))
    assert freed == 4 and tree.pool.used == 3 and tree.released_chunks == 4
    assert cached_paths(tree) == [SYSTEM + [7, 8, 9]]  # the newer of the two copy sources
    assert tree.match_len(SYSTEM + [4, 4, 4]) == len(SYSTEM)
    tree.check()
    # Nothing to come: everything goes.
    assert tree.release_unshared(pending_of()) == 3 and tree.pool.used == 0
    tree.check()


def test_a_chunk_a_pending_prompt_holds_whole_stays_even_when_others_part_inside_it():
    tree = tree_of()
    finish(tree, {"a": SYSTEM + [1, 2], "b": SYSTEM + [7, 8, 9]})
    tree.release_unshared(pending_of(SYSTEM + [1, 2], SYSTEM + [7]))
    # a's tail is the whole of the first prompt; b's tail is the copy source of the second.
    assert cached_paths(tree) == [SYSTEM + [1, 2], SYSTEM + [7, 8, 9]]
    assert tree.match_len(SYSTEM + [1, 2]) == len(SYSTEM) + 2


def test_live_chunks_are_never_released_and_a_preempted_prompt_keeps_its_own():
    tree = tree_of()
    tree.insert("live", SYSTEM + [1] * 20)
    tree.mark_ready("live")
    finish(tree, {"preempted": SYSTEM + [3] * 20})
    before = tree.pool.used
    assert tree.release_unshared(pending_of(SYSTEM + [3] * 20)) == 0 and tree.pool.used == before
    assert tree.release_unshared(pending_of()) == 3  # the preempted prompt's own chunks once it is not pending
    assert tree.tokens("live") == SYSTEM + [1] * 20
    tree.check()


def test_pending_prompts_come_and_go_as_a_multiset():
    pending = PendingPrefixes(C)
    pending.add("x", SYSTEM)
    pending.add("y", SYSTEM + [1])
    keys = prompt_keys(SYSTEM, C)
    assert len(keys) == 3 + 2 * len(partial_levels(C)) + 2  # a key a piece, the partial levels below each
    pending.discard("x")
    assert all(k in pending._count for k in prompt_keys(SYSTEM[: 2 * C], C))  # y holds them still
    pending.discard("y")
    pending.discard("never added")
    assert not pending._count and len(pending) == 0


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _whole_part(tree: PrefixTree, tokens: list[int]) -> int:
    path, _, _, i = tree._match(tokens, include_pending=False)
    return i


prompts = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4 * C + 3), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(finished=prompts, to_come=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4 * C + 3), max_size=6))
def test_release_keeps_exactly_what_prompts_to_come_can_take(finished, to_come):
    """On random trees: every chunk a prompt to come takes whole stays, and of what it would copy
    at least the power-of-two part the tree's partial index finds stays; every cached leaf left is
    one some prompt to come takes (whole or as a copy source), at most one per copy; with nothing
    to come, the cache empties."""
    tree = tree_of()
    finish(tree, {i: p for i, p in enumerate(finished)})
    before = {i: (_whole_part(tree, p), tree.match_len(p)) for i, p in enumerate(to_come)}
    tree.release_unshared(pending_of(*to_come))
    tree.check()
    for i, p in enumerate(to_come):
        whole, total = before[i]
        assert _whole_part(tree, p) == whole
        copied = total - whole
        if copied:
            floor = max(n for n in [1, *partial_levels(C)] if n <= copied)
            assert tree.match_len(p) - whole >= floor
        else:
            assert tree.match_len(p) == whole
    copy_only = 0
    for path in cached_paths(tree):
        start = (len(path) - 1) // C * C  # where the leaf's chunk begins
        takes_whole = any(p[: len(path)] == path for p in to_come)
        copies = any(p[:start] == path[:start] and _common(p[start:], path[start:]) > 0 for p in to_come)
        assert takes_whole or copies, f"cached {path} is of no use to any prompt to come"
        copy_only += not takes_whole
    assert copy_only <= len(to_come) * (len(partial_levels(C)) + 1)
    tree.release_unshared(pending_of())
    assert tree.pool.used == 0
