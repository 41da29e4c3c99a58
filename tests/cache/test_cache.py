"""PrefixTree / ChunkPool / KernelContext under random joins, appends and leaves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
        st.tuples(
            st.just("insert"),
            st.integers(0, 3),
            st.integers(0, 120),
            st.lists(st.integers(0, 5), min_size=0, max_size=40),
        ),
        st.tuples(st.just("append"), st.integers(0, 50), st.integers(1, 20), st.integers(0, 5)),
        st.tuples(st.just("remove"), st.integers(0, 50), st.booleans(), st.just(0)),
        # inserted but never prefilled (a refused admission, a failed prefill): removed at once
        st.tuples(st.just("abort"), st.integers(0, 3), st.integers(0, 120), st.lists(st.integers(0, 5), max_size=40)),
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
            assert tree.match_len(toks) == (len(toks) if share else 0)
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
            tree.remove(seq)
            del expected[seq]
        elif op == "abort":
            toks = prefixes[a][:b] + list(c)
            if not toks:
                continue
            before, used = tree.match_len(toks), pool.used
            no_eviction = pool.free_slots >= -(-len(toks) // chunk)
            try:
                cached = tree.insert("aborted", toks)
                # all it matched, or (evicting the cached chunk it would have copied from) the
                # whole chunks of it
                assert cached == before or (not no_eviction and cached == before // chunk * chunk)
            except PoolExhausted:
                check_all(pool, tree, expected)
                continue
            tree.remove("aborted")
            if no_eviction:  # nothing it found is lost, nothing it added stays
                assert tree.match_len(toks) == before and pool.used == used
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
    tree.remove("b")  # its own tail was never written: freed, not cached
    assert pool.used == 3 and tree.cached_chunks == 3
    assert tree.insert("c", [7] * 40) == 0  # needs 3 slots: 1 free, 2 evicted from a's path, leaf first
    tree.check()
    assert pool.used == 4 and tree.cached_chunks == 1
    assert tree.match_len(list(range(48))) == 16  # a's first chunk is the one left


def test_lru_evicts_least_recently_used_leaves_first():
    pool = make_pool(16, slots=6)
    tree = PrefixTree(pool)
    prompts = [[p] * 32 for p in range(3)]  # three unrelated prompts of two chunks each
    for p, toks in enumerate(prompts):
        tree.insert(p, toks)
        tree.mark_ready(p)
    for p in range(3):
        tree.remove(p)
    assert tree.insert("again", prompts[0]) == 32  # prompt 0 is now the most recently used
    tree.remove("again")
    assert [tree.match_len(t) for t in prompts] == [32, 32, 32]
    tree.insert("new", [9] * 16)  # one slot: the least recently used leaf, prompt 1's tail
    assert [tree.match_len(t) for t in prompts] == [32, 16, 32]
    tree.remove("new")  # unwritten: freed
    tree.insert("new2", [9] * 48)  # three slots: the free one, then prompt 1's first chunk, then 2's tail
    assert [tree.match_len(t) for t in prompts] == [32, 0, 16]
    tree.check()


def test_removing_a_never_prefilled_sequence_keeps_the_cache_it_found():
    pool = make_pool(16, slots=16)
    tree = PrefixTree(pool)
    system = list(range(96))
    tree.insert("a", system + [1, 2])
    tree.mark_ready("a")
    tree.remove("a")
    cached, used = tree.cached_chunks, pool.used
    assert cached == 7 and tree.match_len(system + [5]) == 96
    assert tree.insert("b", system + [5, 6, 7]) == 96  # refused or failed before its prefill ran
    tree.remove("b")
    assert tree.cached_chunks == cached and pool.used == used  # its unwritten tail is gone, the rest stays
    assert tree.match_len(system + [5]) == 96
    tree.check()


def test_an_insert_refused_for_its_reserve_touches_nothing():
    pool = make_pool(16, slots=8)
    tree = PrefixTree(pool)
    tree.insert("a", list(range(64)))
    tree.mark_ready("a")
    tree.remove("a")  # 4 cached chunks, 4 free slots
    lru = sorted((c.last_used, c.slot) for c in tree.iter_chunks())
    with pytest.raises(PoolExhausted, match="reserved"):
        tree.insert("b", list(range(40)) + [7] * 40, reserve=3)  # 3 new chunks: 4 free + 1 evictable - 3 = 2 left
    assert pool.used == 4 and pool.free_slots == 4 and tree.match_len(list(range(64))) == 64
    assert sorted((c.last_used, c.slot) for c in tree.iter_chunks()) == lru  # not even the LRU order moved
    assert tree.insert("b", list(range(40)) + [7] * 40, reserve=1) == 40
    tree.check()


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


def test_arrays_on_another_device_are_views_of_one_buffer():
    """A host context driving a kernel elsewhere: every array equal to the context's own view, all
    of them views of one buffer (one copy, not a copy per array)."""
    pool = make_pool(16)
    tree = PrefixTree(pool)
    for i in range(3):
        tree.insert(i, [1] * 40 + [i] * (i + 1))
        tree.mark_ready(i)
    ctx = KernelContext(tree)
    moved = ctx.arrays_on("cpu")
    for name, got, want in zip(moved._fields, moved, ctx.arrays()):
        assert torch.equal(got, want), name
    base = {t.untyped_storage().data_ptr() for t in moved if t.numel()}
    assert len(base) == 1  # views of one buffer


def test_chunks_being_prefilled_are_not_matched_until_ready():
    pool = make_pool(16)
    tree = PrefixTree(pool)
    tree.insert("a", list(range(40)))
    assert tree.waits_for_pending(list(range(40)) + [5]) and tree.match_len(list(range(40)) + [5]) == 0
    assert tree.insert("b", list(range(40)) + [5]) == 0  # a's K/V do not exist yet
    tree.mark_ready("a")
    assert not tree.waits_for_pending(list(range(40)) + [6]) and tree.match_len(list(range(40)) + [6]) == 40
    assert tree.insert("c", list(range(40)) + [6]) == 40
    tree.check()


# -- prompt matching: indexed lookups against a scan of every child ---------------------------


def scan_match(tree: PrefixTree, tokens: list[int], include_pending: bool) -> tuple[int, int]:
    """The longest cached prefix found by comparing against every child at every level:
    (tokens covered by whole shared chunks, tokens copied from a chunk it diverges inside)."""
    C = tree.chunk_size
    node, i = tree.root, 0
    while i < len(tokens):
        rest = tokens[i : i + C]
        best, best_len = None, 0
        for child in node.children:
            if child.ready or include_pending:
                n = next(
                    (k for k, (a, b) in enumerate(zip(child.tokens, rest)) if a != b), min(len(child.tokens), len(rest))
                )
                if n > best_len:
                    best, best_len = child, n
        if best is None:
            return i, 0
        if best_len == len(best.tokens) == len(rest):
            i, node = i + best_len, best
            continue
        return i, best_len
    return i, 0


def assert_match_close_to_scan(tree: PrefixTree, tokens: list[int], include_pending: bool) -> None:
    path, src, copied, i = tree._match(tokens, include_pending)
    assert [t for c in path for t in c.tokens] == tokens[:i]
    assert all(c.ready or include_pending for c in path)
    if src is not None:
        assert src.ready or include_pending
        assert src.parent is (path[-1] if path else tree.root)
        assert src.tokens[:copied] == tokens[i : i + copied]
    ref_i, ref_copied = scan_match(tree, tokens, include_pending)
    # Never more than the scan (it is exact) and at least the largest power of two of its copy,
    # the documented approximation; where the scan copies an identical tail, it is shared instead.
    assert i + copied <= ref_i + ref_copied
    assert i + copied >= ref_i + (1 << (ref_copied.bit_length() - 1) if ref_copied else 0)


def bookkeeping_pool(chunk: int) -> ChunkPool:
    return ChunkPool(1, 1, 16, chunk, torch.float32, budget_bytes=1 << 40, storage=False)


@settings(max_examples=150, deadline=None)
@given(
    chunk=st.sampled_from([4, 8, 16]),
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=40), min_size=1, max_size=25),
    pending=st.booleans(),
    queries=st.lists(
        st.tuples(st.integers(0, 100), st.integers(0, 40), st.lists(st.integers(0, 3), max_size=20)),
        min_size=1,
        max_size=8,
    ),
)
def test_indexed_matching_agrees_with_a_scan_of_every_child(chunk, prompts, pending, queries):
    tree = PrefixTree(bookkeeping_pool(chunk))
    for n, toks in enumerate(prompts):
        tree.insert(n, toks)
        if not (pending and n == len(prompts) - 1):  # one prompt still being prefilled
            tree.mark_ready(n)
            if n % 3 == 1:
                tree.remove(n)  # stays as cache
    tree.check()
    for k, cut, tail in queries:
        q = prompts[k % len(prompts)][:cut] + tail
        if q:
            for include_pending in (False, True):
                assert_match_close_to_scan(tree, q, include_pending)


def test_matching_cost_does_not_grow_with_the_number_of_cached_prompts(monkeypatch):
    from chunkgen.cache import tree as tree_module

    C = 16
    tree = PrefixTree(bookkeeping_pool(C))
    system = list(range(1000, 1000 + 2 * C))
    # 5,000 cached prompts under one node whose third chunks all begin with the same 8 tokens, so
    # every prefix length up to 8 is shared by all of them.
    rows = [system + [7] * 8 + [n // 100, n % 100] + [0] * 6 + [1, 2, 3] for n in range(5000)]
    for n, toks in enumerate(rows):
        tree.insert(n, toks)
        tree.mark_ready(n)
        tree.remove(n)
    assert len(tree.paths) == 0 and tree.cached_chunks == 2 + 5000 * 2

    calls = 0
    original = tree_module._common_prefix

    def counting(a, b):
        nonlocal calls
        calls += 1
        return original(a, b)

    monkeypatch.setattr(tree_module, "_common_prefix", counting)
    queries = [
        rows[4321],  # a cached prompt: whole chunks all the way
        rows[4321][:-1] + [9],  # diverges inside its tail
        system + [7] * 8 + [0, 55, 5],  # diverges inside the 5,000-way chunk
        system + [7] * 8 + [31, 99, 5],  # same, past what the first candidates share
        system[:20] + [5] * 30,  # diverges inside the system prompt
    ]
    lengths = [tree.match_len(q) for q in queries]
    assert calls <= tree_module.REFINE_CANDIDATES * len(queries)
    monkeypatch.setattr(tree_module, "_common_prefix", original)
    assert lengths[0] == len(rows[4321]) and lengths[1] == len(rows[4321]) - 1
    assert lengths[2] == 2 * C + 9 and lengths[4] == 20
    assert 2 * C + 8 <= lengths[3] <= 2 * C + 9  # an approximation may copy a token fewer
    for q in queries:
        assert_match_close_to_scan(tree, q, include_pending=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_write_and_gather_match_plain_indexing(dtype):
    check_pool_write_and_gather(dtype, "cpu")


def check_pool_write_and_gather(dtype: torch.dtype, device: str) -> None:
    """The native K/V write and path gather (prefill's) against plain tensor indexing of the layout;
    bad indices are errors naming them, checked on the host (tests/kernels/test_cuda.py: a GPU pool)."""
    g = torch.Generator().manual_seed(0)
    pool = ChunkPool(2, 3, 16, 8, dtype, budget_bytes=40 * 2 * 2 * 3 * 16 * 8 * 4, device=device)
    slots = [pool.allocate() for _ in range(5)]
    path = torch.tensor([slots[3], slots[0], slots[4]])
    n = 19  # two full chunks of 8 and three tokens of the third
    pos = torch.arange(n)
    k = torch.randn(n, 3, 16, generator=g).to(device)
    kv = torch.randn(n, 2, 3, 16, generator=g).to(device)  # a strided v, as split from one product
    pool.write(1, pool.write_indices(path[pos // 8], pos % 8), k, kv[:, 1])
    at = (path[pos // 8].to(device), pos.to(device) % 8)
    assert torch.equal(pool.k[1, at[0], :, :, at[1]], k.to(dtype))
    assert torch.equal(pool.v[1, at[0], :, at[1]], kv[:, 1].to(dtype))
    gk, gv = pool.gather(1, path, n)
    assert gk.shape == gv.shape == (3, n, 16)
    assert torch.equal(gk, k.to(dtype).transpose(0, 1))
    assert torch.equal(gv, kv[:, 1].to(dtype).transpose(0, 1))
    end = pool.max_slots + 1  # the scratch slot is the last one
    with pytest.raises(ValueError, match=rf"write_slot\[0\] = {end} is outside \[0, {end}\)"):
        pool.write_indices(torch.tensor([pool.max_slots + 1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="write_offset\\[1\\] = 8 is outside"):
        pool.write_indices(torch.tensor([0, 1]), torch.tensor([7, 8]))
    with pytest.raises(ValueError, match="do not fit"):
        pool.gather(0, path, 25)
    assert torch.equal(pool.gather(1, path, n)[0], gk)  # nothing written, the device still usable


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 120), st.booleans()), min_size=1, max_size=8),
    steps=st.integers(1, 60),
    slots=st.sampled_from([12, 16, 4096]),
)
def test_append_all_is_append_one_by_one(prompts, steps, slots):
    """The decode step's batched append against append() in a loop, on twin trees: the same
    positions, the same tokens in the same chunks, and where the pool runs out, the same sequence
    stopped at with nothing of it changed."""
    bases = [[1, 2, 3] * 40, [4, 5] * 60, [2] * 120, [1, 2, 3] * 20 + [9] * 60]
    twins = []
    for _ in range(2):
        tree = PrefixTree(make_pool(16, slots))
        for i, (which, n, own) in enumerate(prompts):  # without a token of its own: a shared tail
            try:
                tree.insert(i, bases[which][:n] + ([50 + i] if own else []))
            except PoolExhausted:
                break
            tree.mark_ready(i)
        twins.append(tree)
    one, many = twins
    seqs = list(one.paths)
    for step in range(steps):
        tokens = [7 + step + s % 2 for s in seqs]
        want: dict = {}
        for s, t in zip(seqs, tokens):
            try:
                want[s] = one.append(s, t)[:2]
            except PoolExhausted:
                break
        got: dict = {}
        assert many.append_all(seqs, tokens, got) == len(want)
        assert got == want
        for s in seqs:
            assert many.tokens(s) == one.tokens(s) and many.slots(s) == one.slots(s)
        many.check()
        if len(want) < len(seqs):
            break
