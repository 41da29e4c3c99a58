"""The Scheduler on a real prefix tree with bookkeeping only: no model, every decision visible."""

from __future__ import annotations

import pytest
import torch

from chunkgen.cache import ChunkPool, PoolExhausted, PrefixTree
from chunkgen.engine.params import SamplingParams
from chunkgen.engine.scheduler import Batch, Scheduler
from chunkgen.engine.sequence import Request, Sequence

C = 16


def setup(
    slots: int, max_batch: int = 8, max_prefill_tokens: int = 8192, mixed_prefill_tokens: int = 0
) -> tuple[PrefixTree, Scheduler]:
    pool = ChunkPool(1, 1, 16, C, torch.float32, budget_bytes=slots * 2 * 16 * C * 4, storage=False)
    tree = PrefixTree(pool)
    sched = Scheduler(
        tree, max_batch, max_prefill_tokens, group_prefix_tokens=4 * C, mixed_prefill_tokens=mixed_prefill_tokens
    )
    return tree, sched


def seqs(prompts: list[list[int]], max_new_tokens: int = 1000) -> list[Sequence]:
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return [Sequence(Request(i, p, params), 0, None) for i, p in enumerate(prompts)]


def run(tree: PrefixTree, sched: Scheduler, batch: Batch) -> list[Sequence]:
    """What the engine does with a batch, minus the model: K/V are written, a token is sampled
    (token 5) where the engine would sample one, and sequences at max_new_tokens finish."""
    done = list(batch.ended)
    for seq, _, _ in batch.prefill:
        tree.mark_ready(seq.seq_id)
        if not seq.preempted:
            seq.tokens.append(5)
    for seq in batch.decode:
        seq.tokens.append(5)
    for seq in [a.seq for a in batch.prefill] + batch.decode:
        if len(seq.output) >= seq.params.max_new_tokens:
            seq.finish_reason = "length"
            sched.finish(seq)
            done.append(seq)
    return done


def test_a_shared_prefix_is_prefilled_once_then_the_rest_join():
    tree, sched = setup(slots=64)
    system = list(range(100, 100 + 3 * C))
    sched.add(seqs([system + [i] for i in range(4)]))
    first = sched.schedule()
    assert [a.seq.request.id for a in first.prefill] == [0]  # the others wait for its chunks
    run(tree, sched, first)
    second = sched.schedule()
    assert [a.seq.request.id for a in second.prefill] == [1, 2, 3]
    assert all(a.cached == 3 * C for a in second.prefill)
    assert sched.num_waiting == 0 and sched.num_running == 4


def test_one_wave_per_schedule_and_prefill_before_decode():
    tree, sched = setup(slots=256, max_batch=64, max_prefill_tokens=3 * C)
    sched.add(seqs([[i] * C for i in range(10)], max_new_tokens=1))
    waves = []
    while sched.has_work:
        batch = sched.schedule()
        assert batch.prefill and not batch.decode  # everything finishes at prefill: no decode step
        waves.append(len(batch.prefill))
        done = run(tree, sched, batch)
        assert len(done) == waves[-1] and sched.num_running == 0
    assert waves == [3, 3, 3, 1]


def test_a_mixed_step_decodes_the_running_rows_and_admits_others_within_its_budget():
    tree, sched = setup(slots=256, max_batch=64, mixed_prefill_tokens=2 * C)
    sched.add(seqs([[i] * C for i in range(2)]))
    first = sched.schedule()  # nothing runs yet: a wave alone, at the wave's own budget
    assert len(first.prefill) == 2 and not first.decode
    run(tree, sched, first)
    sched.add(seqs([[50 + i] * (C // 2) for i in range(7)]))
    sizes = []
    while sched.num_waiting:
        batch = sched.schedule()
        assert [s.request.id for s in batch.decode] == [0, 1] + [s.request.id for s in batch.decode[2:]]
        assert set(batch.slots) == {s.seq_id for s in batch.decode}  # the wave's rows decode from the next step
        assert not {a.seq.seq_id for a in batch.prefill} & set(batch.slots)
        sizes.append(sum(len(a.kv_tokens) - a.cached for a in batch.prefill))
        run(tree, sched, batch)
    assert sizes == [2 * C, 3 * C // 2]  # up to the budget, in queue order


def test_a_mixed_step_whose_decode_lacks_a_chunk_puts_its_wave_back(monkeypatch):
    """The running rows keep their places: a wave admitted in the same step goes back to the head of
    the queue, in its order, its chunks freed, before any running row is preempted."""
    tree, sched = setup(slots=256, max_batch=64, mixed_prefill_tokens=4 * C)
    sched.add(seqs([[1] * C, [2] * C]))
    run(tree, sched, sched.schedule())
    sched.add(seqs([[60 + i] * C for i in range(3)]))
    free = tree.pool.free_slots
    append, calls = tree.append, []

    def short_once(seq, token):
        calls.append(seq)
        if len(calls) == 1:
            raise PoolExhausted("no chunk for the decode step")
        return append(seq, token)

    monkeypatch.setattr(tree, "append", short_once)
    batch = sched.schedule()
    assert batch.prefill == [] and len(batch.decode) == 2 and batch.preempted == 0
    assert [s.request.id for s in sched.waiting] == [0, 1, 2]
    assert tree.pool.free_slots == free - 2  # the running rows' next chunks: the wave's are freed
    assert set(tree.paths) == {s.seq_id for s in batch.decode}


def test_admission_keeps_a_free_chunk_per_running_sequence():
    tree, sched = setup(slots=12)
    sched.add(seqs([[i] * (2 * C - 1) for i in range(8)]))  # two chunks each, the second one not full
    batch = sched.schedule()
    # After n admissions: 12 - 2n chunks left for n running sequences' next appends.
    assert len(batch.prefill) == 4
    assert tree.pool.free_slots + tree.evictable_chunks >= sched.num_running
    run(tree, sched, batch)
    assert sched.schedule().decode  # the waiting ones stay out until chunks free up


def test_a_refused_admission_leaves_the_cache_as_it_was():
    tree, sched = setup(slots=10)
    system = list(range(200, 200 + 6 * C))
    sched.add(seqs([system + [1]], max_new_tokens=1))
    run(tree, sched, sched.schedule())
    assert tree.cached_chunks == 7 and tree.match_len(system + [2]) == 6 * C
    # Two long runners fill most of the pool (evicting the cached tail), then a prompt that would
    # reuse the 6 cached chunks arrives but the runners' headroom is short.
    sched.add(seqs([[9] * (C - 1), [8] * (C - 1)]))
    run(tree, sched, sched.schedule())
    sched.add(seqs([system + [3, 4]]))
    cached, match = tree.cached_chunks, tree.match_len(system + [2])
    assert match == 6 * C and tree.pool.free_slots + tree.evictable_chunks < 2 + 1 + 1
    batch = sched.schedule()
    assert not batch.prefill and len(batch.decode) == 2  # refused: the runners decode
    assert sched.num_waiting == 1
    assert tree.cached_chunks == cached and tree.match_len(system + [2]) == match
    tree.check()


def test_preemption_takes_the_youngest_and_the_oldest_always_progresses():
    tree, sched = setup(slots=6)
    a, b, c = seqs([[1] * (C - 1), [2] * (C - 1), [3] * (C - 1)])
    sched.add([a, b, c])
    run(tree, sched, sched.schedule())
    assert sched.running == [a, b, c]
    preempted = []
    lengths = []
    for _ in range(4 * C):
        batch = sched.schedule()
        if batch.preempted:
            preempted.extend(s for s in (a, b, c) if s in sched.waiting and s not in preempted)
        lengths.append(len(a.tokens))
        run(tree, sched, batch)
        tree.check()
    assert preempted[:2] == [c, b]  # youngest first
    assert a in sched.running
    # a, the oldest, gains a token on every decode step: only a prefill step can pause it.
    assert lengths[-1] - lengths[0] >= len(lengths) // 2


def test_a_sequence_that_outgrows_the_whole_budget_ends_with_length():
    tree, sched = setup(slots=3)
    (s,) = seqs([[4] * C])
    sched.add([s])
    run(tree, sched, sched.schedule())
    ended = []
    for _ in range(10 * C):  # no livelock: it ends well within this
        if not sched.has_work:
            break
        batch = sched.schedule()
        ended += batch.ended
        run(tree, sched, batch)
    assert ended == [s] and s.finish_reason == "length"
    assert len(s.tokens) == 3 * C + 1  # it filled all three chunks; its last sampled token had no room
    assert sched.preemptions == 0 and not sched.has_work
    tree.check()


def test_a_readmitted_sequence_that_cannot_fit_ends_with_length():
    tree, sched = setup(slots=6)
    old, young = seqs([[1] * (C + 4), [2] * (C + 4)])
    sched.add([old, young])
    run(tree, sched, sched.schedule())
    assert sched.running == [old, young]  # both admitted, with a free chunk each
    finished = []
    for _ in range(20 * C):
        if not sched.has_work:
            break
        batch = sched.schedule()
        finished += run(tree, sched, batch)
    assert not sched.has_work, "livelock"
    assert finished[0] is old and old.finish_reason == "length"  # it outgrew the budget first
    assert young in finished and young.finish_reason == "length" and sched.preemptions >= 1
    assert len(young.output) > 1  # it kept its text through the preemption
    tree.check()


def test_a_prompt_larger_than_the_budget_is_an_error_not_an_exception():
    tree, sched = setup(slots=3)
    big, small = seqs([[1] * (4 * C), [2] * 5], max_new_tokens=2)
    sched.add([big, small])
    batch = sched.schedule()
    assert batch.ended == [big] and big.finish_reason == "error"
    assert "needs 4 KV chunks of 16 tokens" in big.error and "holds 3" in big.error
    assert [a.seq for a in batch.prefill] == [small]


def test_add_between_steps_and_counts():
    tree, sched = setup(slots=64, max_batch=2)
    sched.add(seqs([[1] * 5, [2] * 5, [3] * 5], max_new_tokens=3))
    assert (sched.num_waiting, sched.num_running) == (3, 0)
    run(tree, sched, sched.schedule())
    assert (sched.num_waiting, sched.num_running) == (1, 2)
    sched.add(seqs([[4] * 5]))
    assert sched.num_waiting == 2
    while sched.has_work:
        run(tree, sched, sched.schedule())
    assert tree.pool.used == tree.cached_chunks  # everything left is cache


def test_a_large_cap_lets_the_kv_budget_set_the_batch():
    """max_batch auto is a cap of 256: with room for a few sequences only, the budget decides how
    many run, the wave says sequences were held back, and the rest join as the first ones finish."""
    from chunkgen.device import AUTO_MAX_BATCH

    tree, sched = setup(slots=12, max_batch=AUTO_MAX_BATCH)
    sched.add(seqs([[i] * (2 * C - 1) for i in range(20)], max_new_tokens=3))
    first = sched.schedule()
    assert len(first.prefill) == 4 and first.held_back  # the 12 chunks' worth, far below the cap
    finished, peak, batch = len(run(tree, sched, first)), 4, None
    while sched.has_work:
        batch = sched.schedule()
        peak = max(peak, sched.num_running)
        finished += len(run(tree, sched, batch))
        tree.check()
    assert finished == 20 and peak <= 6  # two chunks a sequence: never more than the budget holds
    unbounded_tree, unbounded = setup(slots=1000, max_batch=AUTO_MAX_BATCH)
    unbounded.add(seqs([[i] * (2 * C - 1) for i in range(20)]))
    wide = unbounded.schedule()
    assert len(wide.prefill) == 20 and not wide.held_back  # room for all: every row at once


def _job_trace(
    n: int, max_batch: int, answer_tokens, answers_throughout: bool = True, expected_rows: int = 0, prompt_work: int = 1
) -> list[tuple[int, int, int]]:
    """(work so far, rows finished so far, rows in flight) after each step of a job of n rows
    sharing a 3-chunk prompt, row i's answer answer_tokens(i) tokens long; a step's work is its
    decode rows, prompt_work per prompt prefilled, plus 8 (a step's fixed cost, in decode rows, on
    a CPU: about 8 ms beside 0.7 ms a row on the default model)."""
    tree, sched = setup(slots=4096, max_batch=max_batch)
    sched.answers_throughout = answers_throughout
    sched.expected_rows = expected_rows
    shared = list(range(100, 100 + 3 * C))
    sched.add(
        [
            Sequence(Request(i, [*shared, 1000 + i], SamplingParams(answer_tokens(i), ignore_eos=True)), 0, None)
            for i in range(n)
        ]
    )
    work, finished, trace = 0, 0, []
    while sched.has_work:
        batch = sched.schedule()
        work += 8 + prompt_work * len(batch.prefill) + len(batch.decode)
        finished += len(run(tree, sched, batch))
        trace.append((work, finished, sched.num_running))
    return trace


def _varied(i: int) -> int:
    return 30 + i * 7 % 21


def _equal(i: int) -> int:
    return 64


def test_answers_finish_throughout_a_job_of_many_batches():
    """A job of four batches' rows finishes them throughout: at a quarter, half and three quarters
    of its work at least 10%, 35% and 60% of its rows are done, answers of one length (the worst
    case) included, where a batch filled at once had none done at a quarter."""
    for answer_tokens in (_varied, _equal):
        trace = _job_trace(1000, 256, answer_tokens)
        total = trace[-1][0]
        for share, rows in ((0.25, 0.10), (0.5, 0.35), (0.75, 0.6)):
            done = max(f for w, f, _ in trace if w <= share * total)
            assert done >= rows * 1000, (answer_tokens.__name__, share, done)
    off = _job_trace(1000, 256, _equal, answers_throughout=False)
    assert max(f for w, f, _ in off if w <= off[-1][0] / 4) == 0


def test_the_ramp_costs_no_work():
    """The ramp's steps below the batch replace steps of the last round's tail, which runs below
    the batch too: at most 1.5% more work than the batch filled at once (each prompt's prefill
    weighed as 20 decode rows, about 30 tokens of the default model's)."""
    for n in (300, 1000):
        for answer_tokens in (_varied, _equal):
            on = _job_trace(n, 256, answer_tokens, prompt_work=20)[-1][0]
            off = _job_trace(n, 256, answer_tokens, answers_throughout=False, prompt_work=20)[-1][0]
            assert on <= 1.015 * off, (n, answer_tokens.__name__, on / off)


@pytest.mark.parametrize("answer_tokens", [_varied, _equal])
def test_a_job_of_one_batch_runs_at_once(answer_tokens):
    """Rounds would multiply the steps of a job that fits one batch (answers of one length: the
    whole job in one answer's steps): it runs as the batch filled at once does, step for step."""
    for n in (33, 200, 256):
        assert _job_trace(n, 256, answer_tokens) == _job_trace(n, 256, answer_tokens, answers_throughout=False)


def test_rows_announced_but_not_queued_yet_count_toward_the_rounds():
    """A job fed a window at a time: its queue holds one batch's rows or fewer at first, but the
    rows it announces (expected_rows) make it a job of rounds from the first step."""
    from chunkgen.engine.scheduler import RAMP_STAGES

    tree, sched = setup(slots=4096, max_batch=256)
    sched.expected_rows = 300
    sched.add(seqs([[1000 + i] * 3 for i in range(200)], max_new_tokens=40))
    assert len(sched.schedule().prefill) == 256 // RAMP_STAGES  # the ramp's first part
    tree, sched = setup(slots=4096, max_batch=256)
    sched.add(seqs([[1000 + i] * 3 for i in range(200)], max_new_tokens=40))
    assert len(sched.schedule().prefill) == 200  # 200 rows and no more announced: one batch


def test_dropping_the_queue_leaves_the_running_rows_to_finish():
    tree, sched = setup(slots=4096, max_batch=4)
    sched.later_rows = "prefix"
    sched.add(seqs([[1000 + i] * 3 for i in range(10)], max_new_tokens=3))
    run(tree, sched, sched.schedule())
    dropped = sched.drop_waiting()
    assert [s.request.id for s in dropped] == list(range(4, 10)) and sched.num_waiting == 0
    finished = 0
    while sched.has_work:
        finished += len(run(tree, sched, sched.schedule()))
        tree.check()
    assert finished == 4 and len(sched.pending) == 1  # what stands for the rows after the last one queued


def test_the_first_answers_come_early_even_when_all_are_of_one_length():
    """Answers of one length, the worst case: in a job of more than one batch the first row
    finishes within 70% of the work it would take with the batch filled at once (the ramp's first
    part runs alone, in small cheap steps)."""
    for n, answer_tokens in ((300, _equal), (300, lambda i: 128), (1000, _equal), (300, _varied)):
        on, off = _job_trace(n, 256, answer_tokens), _job_trace(n, 256, answer_tokens, answers_throughout=False)
        first_on = next(work for work, finished, _ in on if finished) / on[-1][0]
        first_off = next(work for work, finished, _ in off if finished) / off[-1][0]
        assert first_on < 0.7 * first_off, (n, first_on, first_off)


def test_the_ramp_admits_the_batch_in_parts_a_stage_of_an_answer_apart():
    from chunkgen.engine.scheduler import RAMP_STAGES

    tree, sched = setup(slots=4096, max_batch=256)
    sched.add(seqs([[1000 + i] * 3 for i in range(300)], max_new_tokens=40))
    running = []
    for _ in range(40):
        run(tree, sched, sched.schedule())
        running.append(sched.num_running)
    parts = [256 * k // RAMP_STAGES for k in range(1, RAMP_STAGES + 1)]  # 300 rows: more than a batch
    assert running[0] == parts[0] and sorted(set(running)) == parts
    assert running.index(parts[1]) > running.index(parts[0]) + 40 // RAMP_STAGES - 2  # a stage of the answer apart


def test_a_job_within_the_smallest_batch_runs_at_once():
    tree, sched = setup(slots=4096, max_batch=256)
    sched.add(seqs([[1000 + i] * 3 for i in range(32)], max_new_tokens=40))
    assert len(sched.schedule().prefill) == 32


@pytest.mark.parametrize("rows", [1, 20, 32, 33, 300, 5000])
@pytest.mark.parametrize("max_batch", [8, 64, 256])
def test_the_first_wave_is_at_most_what_the_pool_backs_ahead(rows, max_batch):
    """The KV pool backs the slots of first_wave_rows rows before the first wave: under --max-batch
    auto the first wave of a job of rounds never admits more (a number as the batch: that many).
    A job of one batch runs at once: its first wave takes every row (the pages past the backed
    ones are backed as they are written)."""
    from chunkgen.engine.scheduler import first_wave_rows

    for auto in (True, False):
        tree, sched = setup(slots=1 << 14, max_batch=max_batch, max_prefill_tokens=1 << 20)
        sched.answers_throughout = auto
        sched.add(seqs([[1000 + i] * 3 for i in range(rows)], max_new_tokens=40))
        first = len(sched.schedule().prefill)
        assert first == rows if rows <= max_batch else first <= first_wave_rows(max_batch, auto)
    assert first_wave_rows(256, True) < 256  # the ramp's first part, not the whole batch


def _cached_after_each_step(later_rows: str, prompts: list[list[int]], max_batch: int = 8) -> list[int]:
    """Chunks cached (in the pool, read by no running row) after each step of a 1-token job."""
    tree, sched = setup(slots=4096, max_batch=max_batch)
    sched.later_rows = later_rows
    sched.add(seqs(prompts, max_new_tokens=1))
    cached = []
    while sched.has_work:
        run(tree, sched, sched.schedule())
        sched.release_cache()
        tree.check()
        cached.append(tree.pool.used - tree.live_chunks)
    return cached


def test_rows_that_share_nothing_leave_nothing_cached_when_no_row_to_come_can_share():
    prompts = [[1000 + i] * (3 * C) for i in range(40)]  # 3 chunks each, no two alike
    assert max(_cached_after_each_step("none", prompts)) == 0
    # In prefix order the last row queued stands for the rows after it: its chunks stay.
    assert max(_cached_after_each_step("prefix", prompts)) == 3
    # Not knowing what comes, the cache keeps every finished row's chunks (until the pool is full).
    assert _cached_after_each_step("unknown", prompts)[-1] == 3 * 40


def test_chunks_rows_to_come_share_stay_cached_until_the_last_of_them():
    system = list(range(100, 100 + 2 * C + 5))
    prompts = [system + [2000 + i, 7] for i in range(20)] + [[3000 + i] * C for i in range(5)]
    cached = _cached_after_each_step("none", prompts)
    # While rows of the system prompt are to come, its two full chunks stay, with one copy source
    # of its last 5 tokens; after the last of them nothing is kept.
    assert max(cached) <= 3 and cached[-1] == 0
    tree, sched = setup(slots=4096, max_batch=8)
    sched.later_rows = "prefix"
    sched.add(seqs(prompts[:12], max_new_tokens=1))
    while sched.num_waiting:
        run(tree, sched, sched.schedule())
        sched.release_cache()
    # The window ran dry, but its last row stands for the rows after it: the next window's rows
    # find the system prompt (its two full chunks, and the last row's tail to copy its end from).
    assert tree.pool.used - tree.live_chunks == 3
    sched.add(seqs(prompts[12:20], max_new_tokens=1))
    wave = sched.schedule().prefill
    assert wave and all(a.cached == len(system) for a in wave)


def test_later_rows_is_checked_and_builds_what_the_queue_holds():
    tree, sched = setup(slots=64, max_batch=1)
    sched.add(seqs([[1] * C, [2] * C]))
    assert sched.pending is None  # unknown: nothing kept
    sched.later_rows = "prefix"
    assert len(sched.pending) == 3  # the two, and the last of them for the rows after it
    run(tree, sched, sched.schedule())
    assert len(sched.pending) == 2  # the first row was admitted
    sched.later_rows = "none"
    assert len(sched.pending) == 1
    sched.later_rows = "unknown"
    assert sched.pending is None
    with pytest.raises(ValueError, match="later_rows"):
        sched.later_rows = "sometimes"
