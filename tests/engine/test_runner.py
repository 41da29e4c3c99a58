"""ModelRunner and the decode forward: one graph, no recompiles, no host work, one upload a step.

Checked on the CPU over workloads with joins, leaves, chunk-boundary crossings, context rebuilds
and preemption: what a CUDA graph or a compiled forward would get wrong (stale buffers, frozen
sizes, hidden host syncs) shows up here as a wrong token or a counted op."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkgen.engine import Request, SamplingParams
from chunkgen.engine.runner import ModelRunner, PrefillItem, batch_buckets, wave_pieces
from chunkgen.llm import LLM
from tests.helpers import CHUNK, HOST_READS, OpLog, run


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=str(tiny_model), dtype="fp32", device="cpu", chunk_size=CHUNK, kv_memory="64MiB", max_batch=8)


def workload(n: int = 16) -> list[Request]:
    """Two prompt families (shared chunks), ragged lengths and budgets: sequences leave at
    different steps and waiting ones join, so the batch changes while it stays in bucket 8."""
    reqs = []
    for i in range(n):
        prefix = [3 + i % 2] * (CHUNK + 5) + [7, 9] * (i % 3)
        reqs.append(Request(i, prefix + [20 + i], SamplingParams(max_new_tokens=20 + 8 * (i % 5), ignore_eos=True)))
    return reqs


def with_runner(llm, **runner_args):
    engine = llm.new_engine()
    engine.runner = ModelRunner(llm.model, engine.pool, engine.tree, engine.config.max_batch, **runner_args)
    return engine


def test_buckets():
    assert batch_buckets(8) == [1, 2, 4, 8]


def test_only_a_captured_or_compiled_step_is_padded_to_a_bucket(llm):
    """Eager steps (the CPU's default) run their rows as they are: a padded row would cost its work
    and write its K/V to the pool's scratch slot, whose pages in every layer a CPU pool would then
    back. Captured ones take a bucket's shape."""
    for runner_args, padded in (({}, False), ({"enforce_eager": False}, True)):
        engine = with_runner(llm, **runner_args)
        _, rows = run(engine, workload(6))
        batches = {r for r, _ in rows}
        assert batches <= set(batch_buckets(8)) if padded else 3 in batches or 5 in batches, batches
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]


def test_compiled_decode_is_one_graph_without_recompiles_and_equals_eager(llm, monkeypatch):
    from torch._dynamo.testing import CompileCounterWithBackend

    import chunkgen.engine.engine as engine_module

    # dynamo guards on torch's thread count, which the thread governor moves while another process
    # is busy (another test worker): a recompile this test is not about. The count stays as it is.
    monkeypatch.setattr(engine_module, "steer_threads", torch.get_num_threads)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")  # functionalizes the op's pool writes as inductor does
    eager, rows_eager = run(llm.new_engine(), workload())
    compiled = with_runner(llm, compile_backend=counter)
    rebuilds = compiled.runner.ctx.rebuilds
    got, rows = run(compiled, workload())
    assert got == eager
    in_bucket = [r for r in rows if r == (8, rows[-1][1])]
    assert len(in_bucket) >= 50  # steps of one bucket: joins, leaves, boundary crossings between them
    assert compiled.runner.ctx.rebuilds - rebuilds >= 5  # structure changed within the run
    assert max(len(t) for t in got.values()) > 2 * CHUNK  # private tails crossed chunk boundaries
    assert counter.frame_count == len(set(rows))  # one compile per bucket, never a recompile
    assert counter.op_count > 0 and torch._dynamo.utils.counters["graph_break"] == {}


def test_graph_replay_over_mirrored_buffers_equals_eager_with_preemption(llm):
    """Replayed per bucket over the buffers bound at capture, reading a device copy refreshed by
    one upload a step: joins, leaves, preemption (a KV budget too small for the batch) and
    rebuilds all go through the buffer refresh, not through new tensors."""
    from tests.helpers import template_prompts

    prompts = [llm.encode(p) for p in template_prompts("tool_dispatcher", 12)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    # The shared prompt plus room for about 4 sequences: admission stops short, growth preempts.
    chunks = -(-max(map(len, prompts)) // CHUNK) + 4 * (-(-(20 + CHUNK) // CHUNK) + 1)
    tight = chunks * llm.new_engine().pool.bytes_per_slot
    requests = lambda: [Request(i, p, params) for i, p in enumerate(prompts)]  # noqa: E731
    eager, _ = run(llm.new_engine(kv_memory=tight), requests())  # waves mixed into decode steps
    engine = llm.new_engine(kv_memory=tight, mixed_prefill_tokens=0)  # every decode step replayed
    engine.runner = ModelRunner(llm.model, engine.pool, engine.tree, 8, enforce_eager=False, mirror=True)
    got, rows = run(engine, requests())
    assert engine.stats.preemptions > 0
    assert got == eager
    assert engine.runner.captures == len(set(rows))  # one capture per (bucket, layout)
    assert engine.runner.ctx.uploads == engine.stats.decode_steps


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_kv_stored_by_rotary_gives_the_same_tokens(llm, monkeypatch, compiled):
    """The GPU's data flow (the rotary op stores a decode step's K/V, the decode op stores none)
    run on the CPU, whose own keeps the decode op's write: the same tokens, over steps that mix
    prefill waves into decode rows (the wave's K/V still stored apart) and through torch.compile.
    The pool starts as NaN, so a K/V that neither op stored shows in the tokens."""
    torch._dynamo.reset()
    eager, _ = run(llm.new_engine(), workload())
    monkeypatch.setattr(llm.model, "kv_write_in_rotary", True)
    engine = with_runner(llm, compile_backend="aot_eager" if compiled else None)
    for t in (engine.pool.k, engine.pool.v):
        t.fill_(float("nan"))
    with contextlib.nullcontext([]) if compiled else OpLog() as log:
        got, _ = run(engine, workload())
    assert got == eager
    assert engine.stats.mixed_steps > 0
    if not compiled:  # every layer of a decode step: rotary took the pool, the decode op stored nothing
        calls = [(str(f).split(".")[1], a) for f, a, _ in log.calls if str(f).startswith("chunkgen.")]
        rotary = [a for name, a in calls if name == "rotary"]
        attention = [a for name, a in calls if name == "decode_attention"]
        assert attention and all(a[-1] is False for a in attention)
        assert sum(len(a) > 11 and a[11] is not None for a in rotary) == len(attention)  # the pool, given


def prepared_runner(llm, **runner_args) -> ModelRunner:
    """A runner with a live batch of 6 whose step is prepared (as the engine does before forward)."""
    engine = with_runner(llm, **runner_args)
    engine.add(workload(6))
    while engine.num_waiting:
        engine.step()
    engine.step()  # one decode step through the engine
    return engine


def test_decode_forward_does_no_host_work(llm):
    engine = prepared_runner(llm)
    runner = engine.runner
    with OpLog() as log:
        logits = runner.forward()
    assert logits.shape == (6, llm.model.vocab_size)  # an eager step: its 6 rows, none padded
    names = [str(f) for f, _, _ in log.calls]
    assert any("chunkgen.decode_attention" in n for n in names)
    syncs = [n for n in names if any(op in n for op in HOST_READS)]
    from_python = [n for n in names if "lift_fresh" in n or "scalar_tensor" in n]
    moves = [
        n
        for f, a, k in log.calls
        for n in [str(f)]
        if ("_to_copy" in n and "device" in k) or "_pin_memory" in n or n.startswith("aten.to.device")
    ]
    assert syncs == [] and from_python == [] and moves == [], (syncs, from_python, moves)


def test_one_host_to_device_copy_per_step(llm):
    engine = prepared_runner(llm, mirror=True)
    ctx = engine.runner.ctx
    assert ctx.dev.data_ptr() != ctx.host.data_ptr()
    dev_storage = ctx.dev.untyped_storage().data_ptr()
    for _ in range(5):
        with OpLog() as log:
            engine.step()
        into_dev = [
            f
            for f, a, _ in log.calls
            if "copy" in str(f)
            and a
            and isinstance(a[0], torch.Tensor)
            and a[0].untyped_storage().data_ptr() == dev_storage
        ]
        assert len(into_dev) == 1, [str(f) for f in into_dev]
    assert ctx.uploads == engine.stats.decode_steps


def test_decode_forward_runs_its_elementwise_work_as_fused_ops(llm):
    """Per layer: two add_rms_norm (each residual add fused into the norm after it), one rotary,
    one silu_mul, the attention op, four linear layers and a few views; no unfused elementwise math
    (the ops the fused ones replaced), so the step's op count stays a small multiple of its layers."""
    engine = prepared_runner(llm)
    layers = len(llm.model.layers)
    with OpLog() as log:
        engine.runner.forward()
    names = [str(f) for f, _, _ in log.calls]
    count = lambda op: sum(1 for n in names if n.startswith(f"chunkgen.{op}"))  # noqa: E731
    assert count("add_rms_norm") == 2 * layers + 1  # the final norm too
    assert count("rotary") == layers and count("silu_mul") == layers and count("decode_attention") == layers
    unfused = [
        n
        for n in names
        if n.split(".")[1]
        in {"mul", "add", "cat", "neg", "pow", "rsqrt", "mean", "silu", "rms_norm", "index", "sum", "div"}
    ]
    assert unfused == [], unfused
    assert len(names) <= 20 * layers, names


def test_host_floor_dispatches_attention_without_its_work(llm):
    """`bench step`'s host floor calls the attention op in every layer of a decode step, over no
    rows (no arithmetic, no K/V write); its CPU-kernel variant calls it over the batch. The model's
    own attention call is back afterwards."""
    from chunkgen.bench import step as bench
    from chunkgen.kernels import decode_step_attention
    from chunkgen.model import llama

    op = torch.ops.chunkgen.decode_attention.default
    for attention in (False, True):
        engine = llm.new_engine()
        with OpLog() as log:
            bench.host_floor_ms(engine, batch=4, steps=2, prompt=4, attention=attention)
        rows = [args[0].shape[0] for func, args, _ in log.calls if func == op]
        timed = rows.count(0)  # the warm-up step before the timed ones runs the kernel either way
        assert timed == (0 if attention else 2 * llm.model.num_layers)
        assert len(rows) - timed >= llm.model.num_layers
        assert llama.decode_step_attention is decode_step_attention


def test_step_profile_counts_the_work_done(llm):
    """`bench step`'s split counts the work it sets time against: the linear layers' FLOPs are
    every weight times every row; the decode kernel's phases count each row's keys (the shared
    chunks in chunk-first, the rest in sequence-first); prefill attention counts each new token's
    keys up to its own position, the shared prompt's tokens once."""
    from chunkgen.bench import step as bench

    m = llm.model
    shared = [5] * (2 * CHUNK)  # two full chunks all rows read
    prompts = [shared + [20 + i] * (3 + i) for i in range(4)]
    steps = 3
    r = bench.profile_steps(llm, prompts, steps)
    assert r["steps"] == steps and r["batch"] == len(prompts)
    linears = [w for layer in m.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [m.lm_head]
    assert r["linear_gflop"] * 1e9 == pytest.approx(
        2 * len(prompts) * sum(w.out_features * w.in_features for w in linears)
    )
    per_key = 4 * m.head_dim * m.q_heads * m.num_layers
    # Decode step j: row i holds its prompt, the token prefill sampled and j more, and the new one.
    keys = sum(len(p) + 1 + j for p in prompts for j in range(steps)) / steps
    shared_keys = len(prompts) * len(shared) if llm.new_engine().runner.chunk_first else 0
    assert r["chunk_first_gflop"] * 1e9 == pytest.approx(per_key * shared_keys)
    assert r["seq_first_gflop"] * 1e9 == pytest.approx(per_key * (keys - shared_keys))
    for part in ("chunk_first_ms", "seq_first_ms", "merge_ms", "kernel_plan_ms"):
        assert 0 <= r[part] <= r["attention_ms"]
    prefill_keys = sum(t + 1 for t in range(len(shared))) + sum(
        t + 1 for p in prompts for t in range(len(shared), len(p))
    )
    assert r["prefill_attention_gflop"] * 1e9 == pytest.approx(per_key * prefill_keys)
    assert 0 < r["prefill_attention_s"] + r["prefill_linear_s"] <= r["prefill_s"]


def test_largest_capture_replays_the_biggest_buckets_step(llm):
    """After a run whose batch passed through several buckets, the capture kept for counting a
    step's kernels is the largest bucket's, and replaying it recomputes a full step of that bucket."""
    engine = with_runner(llm, enforce_eager=False)
    assert engine.runner.largest_capture() is None
    _, rows = run(engine, workload(10))
    largest = max(set(rows))
    logits = engine.runner.largest_capture()()
    assert logits.shape == (largest[0], llm.model.vocab_size) and torch.isfinite(logits).all()


# -- a CPU wave in pieces ----------------------------------------------------------------------
def _item(tokens: int, start: int, scored: bool = False) -> PrefillItem:
    slots = list(range(-(-tokens // CHUNK)))
    return PrefillItem(
        list(range(tokens)), start, start, slots, True, 2 if scored else None, start + 1 if scored else None
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 9 * CHUNK), st.integers(0, 4 * CHUNK), st.booleans()), min_size=1, max_size=6),
    st.integers(1, 5),
)
def test_wave_pieces_cover_every_position_once_at_chunk_cuts(shapes, budget_chunks):
    """Each item's positions [start, len) run once, in order, in parts cut at chunk boundaries;
    a piece holds at most the budget unless a scored item (never cut) fills it; only an item's
    last part wants logits and scores, and each part reads the path up to its end."""
    items = [_item(n, min(s, n - 1), scored) for n, s, scored in shapes]
    budget = budget_chunks * CHUNK
    pieces = wave_pieces(items, budget, CHUNK)
    assert all(pieces)
    seen: dict[int, list[PrefillItem]] = {}
    for piece in pieces:
        new = sum(len(p.tokens) - p.start for _, p in piece)
        assert new <= budget or any(items[i].score_width is not None for i, _ in piece)
        for index, part in piece:
            seen.setdefault(index, []).append(part)
    assert sorted(seen) == list(range(len(items)))
    for index, parts in seen.items():
        it = items[index]
        assert parts[0].start == it.start and parts[-1] == replace(
            it, start=parts[-1].start, write_from=parts[-1].write_from
        )
        for before, after in zip(parts, parts[1:]):
            assert after.start == len(before.tokens) and after.start % CHUNK == 0
            assert not before.want_logits and before.score_width is None
        for part in parts:
            assert part.tokens == it.tokens[: len(part.tokens)] and part.start < len(part.tokens)
            assert len(part.path_slots) >= -(-len(part.tokens) // CHUNK) and part.write_from == max(
                it.write_from, part.start
            )
        if it.score_width is not None:
            assert len(parts) == 1


def _pieced(llm, budget: int):
    """An engine whose CPU waves run in pieces of `budget` new tokens (0: whole), and the number of
    forwards its waves took."""
    engine = llm.new_engine()
    engine.runner.wave_piece_tokens = budget
    calls = [0]
    whole = engine.runner._prefill_piece

    def counted(items):
        calls[0] += 1
        return whole(items)

    engine.runner._prefill_piece = counted
    return engine, calls


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_wave_in_pieces_gives_the_bits_of_the_whole_wave(tiny_model, dtype):
    """Long prompts (one alone in the first wave, then several sharing it, one scored) cut into
    pieces of two chunks: the same tokens and bit-identical logprobs, prompt logprobs included,
    as the waves run whole (batch-invariant numerics, the default)."""
    llm = LLM(
        model=str(tiny_model),
        dtype=dtype,
        device="cpu",
        chunk_size=CHUNK,
        kv_memory="64MiB",
        max_batch=8,
        mixed_prefill_tokens=0,  # every wave a prefill of its own
    )
    shared = [5 + i % 37 for i in range(7 * CHUNK + 3)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2)
    requests = lambda: [  # noqa: E731
        Request(
            i,
            shared + [40 + i] * (i * 9 % (3 * CHUNK) + 1),
            params if i != 2 else SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1),
        )
        for i in range(6)
    ]
    got = {}
    for budget in (0, 2 * CHUNK):
        engine, calls = _pieced(llm, budget)
        results = {}
        engine.add(requests())
        while engine.has_work:
            for r in engine.step():
                results[r.id] = r
        got[budget] = (results, calls[0])
    (whole, whole_calls), (pieced, pieced_calls) = got[0], got[2 * CHUNK]
    assert whole_calls == 2 and pieced_calls > 6  # the waves did run in pieces
    for i, r in whole.items():
        a, b = r.completions[0], pieced[i].completions[0]
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs and a.logprobs
    assert whole[2].prompt_logprobs == pieced[2].prompt_logprobs


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["batch-invariant", "fast"])
def test_a_wave_as_variable_length_products_gives_the_same_tokens(llm, batch_invariant):
    """The GPU's prefill data flow run on the CPU (kernels/varlen.py): a wave's lone sequences
    (every one with batch-invariant numerics) in one variable-length causal product a layer over
    their whole paths, its groups in two (prefix and own parts, merged), instead of the CPU's
    in-place kernels: the same greedy tokens, over waves mixed into decode steps."""
    from unittest import mock

    from chunkgen.kernels import varlen

    want, _ = run(with_runner(llm, batch_invariant=batch_invariant), workload())
    engine = with_runner(llm, batch_invariant=batch_invariant)
    engine.runner.prefill_varlen = True
    products = mock.Mock(wraps=varlen.varlen_attention)
    with mock.patch.object(varlen, "varlen_attention", products):
        got, _ = run(engine, workload())
    assert got == want
    assert engine.stats.mixed_steps > 0
    causal = [c.args[3].causal for c in products.call_args_list]
    prefixes = causal.count(False)  # the groups' prefix products: none where every sequence is lone
    assert causal.count(True) > 0
    assert (prefixes == 0) if batch_invariant else (prefixes > 0)


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.integers(1, 3 * CHUNK), st.integers(0, 3 * CHUNK), st.integers(0, 3 * CHUNK)),
        min_size=1,
        max_size=5,
    )
)
def test_a_waves_inputs_are_its_items_token_by_token(llm, shapes):
    """prepare_prefill lays a wave's inputs out by numpy: held to its items read a token at a time
    (the new tokens, their positions, where the written ones go and which rows they are)."""
    runner = llm.new_engine().runner
    C = runner.pool.chunk_size
    items, ids, positions, slots, offsets, rows = [], [], [], [], [], []
    row = 0
    for i, (n, start, write_from) in enumerate(shapes):
        start = min(start, n - 1)
        write_from = min(max(write_from, start), n)  # recomputed tokens before write_from are not stored
        path = [(7 * i + j) % runner.pool.max_slots for j in range(-(-n // C))]
        items.append(PrefillItem([100 + i + p for p in range(n)], start, write_from, path))
        for p in range(start, n):
            ids.append(100 + i + p)
            positions.append(p)
            if p >= write_from:
                slots.append(path[p // C])
                offsets.append(p % C)
                rows.append(row)
            row += 1
    step = runner.prepare_prefill(items)
    assert step.tokens.tolist() == ids and step.positions.tolist() == positions
    assert step.write_at.slots.tolist() == slots and step.write_at.offsets.tolist() == offsets
    assert step.writes == bool(rows)
    assert (step.write_rows is None) == (rows == list(range(row)))
    if step.write_rows is not None:
        assert step.write_rows.tolist() == rows
    assert step.tokens.dtype == step.positions.dtype == torch.long
