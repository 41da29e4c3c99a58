"""PrefixTree / ChunkPool / KernelContext under random joins, appends and leaves."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from chunkgen.cache import Append, ChunkPool, KernelContext, PoolExhausted, PrefixTree

LAYERS, KVH, D = 2, 2, 16


def make_pool(chunk: int, slots: int = 4096, dtype=torch.float32) -> ChunkPool:
    per_slot = 2 * LAYERS * KVH * D * chunk * torch.empty((), dtype=dtype).element_size()
    return ChunkPool(LAYERS, KVH, D, chunk, dtype, budget_bytes=slots * per_slot, slab_slots=8)


def token_kv(seq_tokens: list[int], pos: int) -> torch.Tensor:
    """Deterministic K/V content for a token at a position given its prefix: what a model would write.
    Depends on the whole prefix (like real K/V), via a hash of it."""
    h = hash(tuple(seq_tokens[: pos + 1])) % 100003
    return torch.full((LAYERS, KVH, D), float(h))


def write_kv(pool: ChunkPool, tree: PrefixTree, seq, start: int, end: int) -> None:
    tokens = tree.tokens(seq)
    slots, offsets = tree.positions(seq, start, end)
    for pos, s, o in zip(range(start, end), slots, offsets):
        val = token_kv(tokens, pos)
        pool.k[:, s, :, :, o] = val
        pool.v[:, s, :, o] = val
    tree.mark_ready(seq)


def check_all(pool: ChunkPool, tree: PrefixTree, expected: dict) -> None:
    tree.check()
    for seq, toks in expected.items():
        assert tree.tokens(seq) == toks
        slots, offsets = tree.positions(seq, 0, len(toks))
        for pos, s, o in zip(range(len(toks)), slots, offsets):
            want = token_kv(toks, pos)
            assert torch.equal(pool.k[:, s, :, :, o], want), f"K of {seq} at {pos} differs"
            assert torch.equal(pool.v[:, s, :, o], want), f"V of {seq} at {pos} differs"
    ctx = KernelContext(tree)
    assert sorted(ctx.order, key=str) == sorted(expected, key=str)
    ctx.check()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 3), st.integers(0, 120), st.lists(st.integers(0, 5), min_size=0, max_size=40)),
        st.tuples(st.just("append"), st.integers(0, 50), st.integers(1, 20), st.integers(0, 5)),
        st.tuples(st.just("remove"), st.integers(0, 50), st.booleans(), st.just(0)),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops, chunk=st.sampled_from([16, 32]), share=st.booleans(), slots=st.sampled_from([12, 40, 4096]))
def test_random_interleavings_keep_invariants(ops, chunk, share, slots):
    prefixes = [[1, 2, 3] * 40, [4, 5] * 60, [2] * 120, [1, 2, 3] * 20 + [9] * 60]
    pool = make_pool(chunk, slots)
    tree = PrefixTree(pool, share=share)
    expected: dict[int, list[int]] = {}
    next_id = 0
    for op, a, b, c in ops:
        live = sorted(expected)
        if op == "insert":
            toks = prefixes[a][:b] + list(c)
            if not toks:
                continue
            try:
                cached = tree.insert(next_id, toks)
            except PoolExhausted:
                check_all(pool, tree, expected)
                continue
            assert 0 <= cached <= len(toks)
            write_kv(pool, tree, next_id, cached, len(toks))
            expected[next_id] = toks
            next_id += 1
        elif op == "append" and live:
            seq = live[a % len(live)]
            for _ in range(b):
                try:
                    slot, off, kind = tree.append(seq, c)
                except PoolExhausted:
                    break
                expected[seq].append(c)
                pos = len(expected[seq]) - 1
                val = token_kv(expected[seq], pos)
                pool.k[:, slot, :, :, off] = val
                pool.v[:, slot, :, off] = val
        elif op == "remove" and live:
            seq = live[a % len(live)]
            tree.remove(seq, keep_cache=b)
            del expected[seq]
        check_all(pool, tree, expected)


def test_identical_prompts_share_everything_then_copy_on_write():
    pool = make_pool(16)
    tree = PrefixTree(pool)
    toks = list(range(40))
    assert tree.insert("a", toks) == 0
    write_kv(pool, tree, "a", 0, 40)
    assert tree.insert("b", toks) == 40
    assert pool.used == 3  # 16 + 16 + 8, all shared
    _, _, kind = tree.append("a", 7)
    assert kind is Append.COPIED
    _, _, kind = tree.append("b", 8)
    assert kind is Append.IN_PLACE  # "a" left the shared tail, so "b" owns it now
    tree.check()


def test_divergence_inside_a_chunk_copies_matched_tokens():
    pool = make_pool(16)
    tree = PrefixTree(pool)
    tree.insert("a", list(range(20)))
    write_kv(pool, tree, "a", 0, 20)
    cached = tree.insert("b", list(range(18)) + [99, 98])
    assert cached == 18  # 16 shared + 2 copied at token granularity
    write_kv(pool, tree, "b", 18, 20)
    check_all(pool, tree, {"a": list(range(20)), "b": list(range(18)) + [99, 98]})


def test_finished_prefix_stays_cached_then_evicted_lru():
    pool = make_pool(16, slots=4)
    tree = PrefixTree(pool)
    tree.insert("a", list(range(48)))
    tree.mark_ready("a")
    tree.remove("a")
    assert pool.used == 3 and tree.cached_chunks == 3
    assert tree.insert("b", list(range(48)) + [1]) == 48  # cache hit, no prefill
    tree.remove("b")
    assert tree.insert("c", [7] * 40) == 0  # needs 3 slots: evicts the least recently used
    tree.check()
    assert pool.used <= 4


def test_budget_exhaustion_is_typed_and_leaves_state_consistent():
    pool = make_pool(16, slots=3)
    tree = PrefixTree(pool)
    tree.insert("a", list(range(30)))
    with pytest.raises(PoolExhausted):
        tree.insert("b", [5] * 40)
    tree.check()
    assert "b" not in tree.paths
    tree.append("a", 1)
    tree.append("a", 1)
    with pytest.raises(PoolExhausted):
        for _ in range(20):
            tree.append("a", 1)
    tree.check()


def test_forest_of_unrelated_prompts_and_contiguous_ranges():
    pool = make_pool(16)
    tree = PrefixTree(pool)
    for i in range(6):
        tree.insert(i, [i % 2] * 40 + [100 + i])
        tree.mark_ready(i)
    ctx = KernelContext(tree)
    ctx.check()
    assert len(ctx.shared_chunks) == 4  # two trees, two shared full chunks each
    assert len(tree.root.children) == 2


def test_context_updates_in_place_until_structure_changes():
    pool = make_pool(16)
    tree = PrefixTree(pool)
    for i in range(4):
        tree.insert(i, [1] * 32 + [i])
        tree.mark_ready(i)
    ctx = KernelContext(tree)
    rebuilds = ctx.rebuilds
    for _ in range(40):  # crosses chunk boundaries: private chunks grow without a rebuild
        for i in range(4):
            tree.append(i, 3)
        ctx.refresh()
    assert ctx.rebuilds == rebuilds
    fresh = KernelContext(tree)
    for name in ["priv_count", "priv_last_len", "shared_slot", "shared_begin", "shared_end"]:
        assert torch.equal(getattr(ctx, name), getattr(fresh, name)), name
    for row in range(4):
        n = int(ctx.priv_count[row])
        assert torch.equal(ctx.priv_slot[row, :n], fresh.priv_slot[row, :n])
    tree.remove(0)
    ctx.refresh()
    assert ctx.rebuilds == rebuilds + 1 and ctx.batch_size == 3


def test_chunks_being_prefilled_are_not_matched_until_ready():
    pool = make_pool(16)
    tree = PrefixTree(pool)
    tree.insert("a", list(range(40)))
    assert tree.pending_gain(list(range(40)) + [5]) == 40
    assert tree.insert("b", list(range(40)) + [5]) == 0  # a's K/V do not exist yet
    tree.mark_ready("a")
    assert tree.pending_gain(list(range(40)) + [6]) == 0
    assert tree.insert("c", list(range(40)) + [6]) == 40
    tree.check()
