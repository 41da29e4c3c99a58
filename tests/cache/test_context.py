"""KernelContext's arrays against a plain reading of the tree's paths, on random trees.

The context lays its arrays out from one walk over the live forest and numpy; the reference here
reads each live path chunk by chunk, as the arrays are defined, and orders the rows by a depth-first
walk over every live chunk."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkgen.cache import ChunkPool, KernelContext, PoolExhausted, PrefixTree


def reference_order(tree: PrefixTree, excluded: frozenset) -> list:
    """Leaf order: depth first over the live chunks, each node's children in the order the paths
    (in insertion order) first reach them, the sequences ending at a node before its children."""
    children: dict[int, list] = {}
    ending: dict[int, list] = {}
    seen: set[int] = set()
    for seq, path in tree.paths.items():
        ending.setdefault(id(path[-1]), []).append(seq)
        parent = tree.root
        for chunk in path:
            if id(chunk) not in seen:
                seen.add(id(chunk))
                children.setdefault(id(parent), []).append(chunk)
            parent = chunk
    order: list = []
    stack = list(reversed(children.get(id(tree.root), [])))
    while stack:
        node = stack.pop()
        order.extend(ending.get(id(node), []))
        stack.extend(reversed(children.get(id(node), [])))
    return [s for s in order if s not in excluded]


def assert_context_reads_the_paths(ctx: KernelContext, tree: PrefixTree, excluded: frozenset = frozenset()) -> None:
    """Every array as the paths define it for the rows in ctx.order, which holds every live
    sequence but the excluded ones, each shared chunk's rows next to each other. (A context rebuilt
    from scratch orders them as reference_order; one refreshed in place keeps its order.)"""
    order = ctx.order
    assert sorted(order, key=str) == sorted((s for s in tree.paths if s not in excluded), key=str)
    B, rows = len(order), ctx.rows
    assert rows >= B
    shared: list = []  # first reached in row order, along each path
    lists: list[list[int]] = []
    for seq in order:
        mine = []
        for chunk in tree.paths[seq]:
            if chunk.ref > 1:
                if not any(c is chunk for c in shared):
                    shared.append(chunk)
                mine.append(next(i for i, c in enumerate(shared) if c is chunk))
        lists.append(mine)
    S = len(shared)
    assert len(ctx.shared_chunks) == S and all(a is b for a, b in zip(ctx.shared_chunks, shared))
    assert ctx.shared_slot[:S].tolist() == [c.slot for c in shared]
    assert ctx.shared_len[:S].tolist() == [len(c.tokens) for c in shared]
    for c in range(S):
        covered = [r for r, mine in enumerate(lists) if c in mine]
        assert covered == list(range(covered[0], covered[-1] + 1)), f"shared chunk {c} covers rows {covered}"
        assert (int(ctx.shared_begin[c]), int(ctx.shared_end[c])) == (covered[0], covered[-1] + 1)
    runs = [len([m for m in lists if c in m]) for c in range(S)]
    assert ctx.part_off[: S + 1].tolist() == [0, *np.cumsum(runs, dtype=np.int64).tolist()]
    ptr, idx = ctx.seq_shared_ptr.tolist(), ctx.seq_shared_idx.tolist()
    for r, mine in enumerate(lists):
        assert idx[ptr[r] : ptr[r + 1]] == mine, f"row {r}"
    assert ptr[B : rows + 1] == [ptr[B]] * (rows + 1 - B)  # padded rows list no shared chunk
    for r, seq in enumerate(order):
        private = [c for c in tree.paths[seq] if c.ref == 1]
        n = int(ctx.priv_count[r])
        assert n == len(private) and ctx.priv_slot[r, :n].tolist() == [c.slot for c in private], f"row {r}"
        assert int(ctx.priv_last_len[r]) == (len(private[-1].tokens) if private else 0)
    assert not ctx.priv_count[B:rows].any() and not ctx.priv_last_len[B:rows].any()


# A prompt: one of a few prefixes cut anywhere, then a few tokens of its own.
PREFIXES = [[1, 2, 3] * 30, [4, 5] * 45, [1, 2, 3] * 12 + [9] * 50]
prompt = st.tuples(st.integers(0, len(PREFIXES) - 1), st.integers(0, 90), st.lists(st.integers(0, 3), max_size=12))
step = st.one_of(
    st.tuples(st.just("insert"), prompt),
    st.tuples(st.just("append"), st.tuples(st.integers(0, 40), st.integers(1, 12))),
    st.tuples(st.just("remove"), st.integers(0, 40)),
)


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(step, min_size=1, max_size=30),
    chunk=st.sampled_from([4, 16]),
    buckets=st.sampled_from([None, [1, 2, 4, 8, 16, 24, 32, 40]]),
    exclude=st.sets(st.integers(0, 40), max_size=6),
)
def test_arrays_are_those_the_paths_define(steps, chunk, buckets, exclude):
    pool = ChunkPool(1, 1, 8, chunk, torch.float32, budget_bytes=1 << 30, storage=False)
    tree = PrefixTree(pool)
    ctx = KernelContext(tree, buckets=buckets)
    next_id = 0
    for op, arg in steps:
        live = list(tree.paths)
        if op == "insert":
            which, cut, own = arg
            tokens = PREFIXES[which][:cut] + own
            if not tokens:
                continue
            tree.insert(next_id, tokens)
            tree.mark_ready(next_id)
            next_id += 1
        elif op == "append" and live:
            seq, n = live[arg[0] % len(live)], arg[1]
            for _ in range(n):
                try:
                    tree.append(seq, 7)
                except PoolExhausted:
                    break
        elif op == "remove" and live:
            tree.remove(live[arg % len(live)])
        if not tree.paths:
            continue
        excluded = frozenset(s for s in exclude if s in tree.paths and len(tree.paths) > 1) - {next(iter(tree.paths))}
        ctx.refresh(exclude=excluded)  # in place when only appends happened
        assert_context_reads_the_paths(ctx, tree, excluded)
        fresh = KernelContext(tree, buckets=buckets)
        assert fresh.order == reference_order(tree, frozenset())
        assert_context_reads_the_paths(fresh, tree)
        assert tree.batch_order() == reference_order(tree, frozenset())


def test_rows_that_share_nothing_and_rows_that_end_on_a_shared_chunk():
    """Unrelated prompts (nothing shared: every row private), identical prompts whose last chunk is
    full (rows ending on a shared chunk, then growing private chunks under it), and both at once."""
    pool = ChunkPool(1, 1, 8, 4, torch.float32, budget_bytes=1 << 30, storage=False)
    tree = PrefixTree(pool)
    for seq, tokens in [
        *((("alone", i), [100 + i] * 9) for i in range(3)),
        *((("same", i), [1, 2, 3, 4] * 2) for i in range(3)),
    ]:
        tree.insert(seq, tokens)
        tree.mark_ready(seq)
    ctx = KernelContext(tree)
    assert ctx.order == reference_order(tree, frozenset())
    assert_context_reads_the_paths(ctx, tree)
    assert int(ctx.priv_count[ctx.row_of[("same", 0)]]) == 0
    tree.append(("same", 1), 5)  # a full shared tail: a private chunk under it, no structure change
    ctx.refresh()
    assert_context_reads_the_paths(ctx, tree)
    assert int(ctx.priv_count[ctx.row_of[("same", 1)]]) == 1
