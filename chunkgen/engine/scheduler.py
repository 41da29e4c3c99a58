"""Iteration-level batching: who waits, who joins the next prefill wave, who decodes, who is
preempted, and who can never fit. Decisions only: the cache is changed through PrefixTree calls
(insert, append, remove) and no tensor is touched; the engine runs what schedule() returns."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from chunkgen.cache import ChunkPool, PoolExhausted, PrefixTree
from chunkgen.cache.pending import PendingPrefixes
from chunkgen.engine.sequence import Sequence


class Admission(NamedTuple):
    """One sequence of a prefill wave: K/V of kv_tokens[cached:] are to be computed."""

    seq: Sequence
    kv_tokens: list[int]
    cached: int


@dataclass
class Batch:
    """One step of work: a prefill wave, a decode step, or both in one forward (mixed steps)."""

    prefill: list[Admission] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)  # each has a position reserved for its last token
    slots: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq_id -> (slot, offset) of that position
    ended: list[Sequence] = field(default_factory=list)  # finished here: no memory will ever hold them
    preempted: int = 0
    held_back: bool = False  # sequences waited below max_batch because the KV pool was full


# Rows that start together finish together: a batch filled at once with every row a job has writes
# no answer until nearly its end. A stop lets the rows in flight finish (jobs/stop.py), so an
# interrupt keeps them all the same; what is left is when answers reach the disk. A job of at most
# one batch runs all at once: any staggering adds steps, each with its fixed cost. A job of more
# rows than one batch (the rows the engine knows: queued, running, finished since it was last idle,
# or announced: expected_rows) takes two rounds of the batch at least, and its batch opens in
# RAMP_STAGES equal parts, one each RAMP_STAGES-th of an answer's length in decode steps
# (max_new_tokens until a row finishes, then the steps that first answer took). The first rows run
# in a small, cheap batch and finish early, and the parts admitted a stage apart finish a stage
# apart, so rows leave (and others take their places) in parts of the batch from then on, not all
# at once. This costs about 3% of a 300-row job's time on the default model (2-core Zen 5,
# benchmarks/results/2026-11-28-stop-grace.md): a few more steps, each with a fixed part of about
# 8 ms beside 0.7 ms a row and 0.5 ms a prompt token, and smaller batches until the first answer.
# Rounds (a share of the job's rows at once) cost more: rounds of a third took 113 steps where the
# ramp takes 91 and every row at once 80, and rounds of a fifth cost a 256-row job whose answers
# all have 64 tokens 18-20%. No part is smaller than
# MIN_RUNNING / RAMP_STAGES rows, below which a step's fixed cost is most of it. The rule holds only
# where the batch is the engine's choice (`--max-batch auto`): a batch asked for by number runs
# that wide from the start.
MIN_RUNNING = 32
RAMP_STAGES = 4


def first_wave_rows(max_batch: int, batch_is_auto: bool) -> int:
    """The rows whose KV slots the pool backs ahead of use: max_batch when the batch is asked by
    number; under `--max-batch auto` the ramp's first part (a job of one batch takes the rest of
    its pages as it writes them)."""
    if not batch_is_auto:
        return max_batch
    return min(max_batch, max(MIN_RUNNING, -(-max_batch // RAMP_STAGES)))


# What the engine knows of the rows it has not been given yet (Scheduler.later_rows):
# unknown: anything may come (a caller adding requests as it goes): finished rows' chunks stay
#   cached until the pool needs their slots, least recently used first;
# prefix: they come in prefix order after the queued ones, so they share nothing the last row
#   queued does not (the rows sharing a prefix are consecutive): a cached chunk that neither a
#   queued row nor the last one queued can share is released at once;
# none: no more rows come: the same, exactly.
LATER_ROWS = ("unknown", "prefix", "none")
_LAST_QUEUED = object()  # the pending entry that stands for the rows to come in prefix order


def kv_budget_error(n_tokens: int, pool: ChunkPool) -> str | None:
    """Why a prompt of n_tokens can never be held by the whole KV budget, or None if it can."""
    need = pool.chunks_for(n_tokens)
    if need <= pool.max_slots:
        return None
    mib = pool.bytes_per_slot / 2**20
    return (
        f"prompt needs {need} KV chunks of {pool.chunk_size} tokens ({need * mib:.1f} MiB) but the "
        f"whole KV budget holds {pool.max_slots} ({pool.max_slots * mib:.1f} MiB); raise --kv-memory"
    )


class Scheduler:
    def __init__(
        self,
        tree: PrefixTree,
        max_batch: int,
        max_prefill_tokens: int,
        group_prefix_tokens: int,
        answers_throughout: bool = True,
        mixed_prefill_tokens: int = 0,
    ) -> None:
        """answers_throughout: in a job of more rows than max_batch, open the batch in parts over the
        first answer (see above); off, max_batch rows start at once. mixed_prefill_tokens: while
        sequences decode, a wave joins their decode step as one forward, admitting sequences until
        its new tokens reach this many (at least one sequence); 0: a wave runs alone and the
        running sequences wait for it."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.tree = tree
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.group_prefix_tokens = group_prefix_tokens
        self.answers_throughout = answers_throughout
        self.mixed_prefill_tokens = mixed_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first; includes the wave being prefilled
        self.preemptions = 0
        self.finished_since_idle = 0  # sequences finished since the engine last had no work
        self.decode_steps_since_idle = 0
        self.answer_steps: int | None = None  # decode steps of the first answer since idle (the ramp's length)
        self.expected_rows = 0  # rows the caller says the job has in all (0: unknown); see running_cap
        self.pending: PendingPrefixes | None = None  # the queued prompts, kept while later_rows is not unknown
        self._later_rows = "unknown"

    @property
    def later_rows(self) -> str:
        """What comes after the queued rows (LATER_ROWS): decides whether cached chunks that no
        queued row can share are released at once (release_cache)."""
        return self._later_rows

    @later_rows.setter
    def later_rows(self, value: str) -> None:
        if value not in LATER_ROWS:
            raise ValueError(f"later_rows must be one of {', '.join(LATER_ROWS)}, not {value!r}")
        self._later_rows = value
        if value == "unknown":
            self.pending = None
        else:
            if self.pending is None:
                self.pending = PendingPrefixes(self.tree.chunk_size)
                for seq in self.waiting:
                    self.pending.add(seq.seq_id, self._kv_tokens(seq))
                if value == "prefix" and self.waiting:
                    self.pending.add(_LAST_QUEUED, self._kv_tokens(self.waiting[-1]))
            if value == "none":
                self.pending.discard(_LAST_QUEUED)

    @staticmethod
    def _kv_tokens(seq: Sequence) -> list[int]:
        """The tokens whose K/V a queued sequence needs: a preempted one's last token was sampled
        but never written (decode writes it)."""
        return seq.tokens[:-1] if seq.preempted else seq.tokens

    def release_cache(self) -> int:
        """Free the cached chunks no queued row can share, when the rows to come cannot share
        them either (later_rows prefix or none); returns how many."""
        return self.tree.release_unshared(self.pending) if self.pending is not None else 0

    def drop_waiting(self) -> list[Sequence]:
        """Forget every queued sequence (a run stopping: only the running ones go on); returns them."""
        dropped = list(self.waiting)
        self.waiting.clear()
        if self.pending is not None:
            for seq in dropped:
                self.pending.discard(seq.seq_id)
        return dropped

    def _dequeue(self) -> Sequence:
        seq = self.waiting.popleft()
        if self.pending is not None:
            self.pending.discard(seq.seq_id)
        return seq

    def add(self, seqs: list[Sequence]) -> None:
        """Queue new sequences. Within one call, sequences with the same leading tokens are queued
        next to each other, so they are admitted together and share chunks while they run."""
        first_seen: dict[tuple[int, ...], int] = {}
        keyed = []
        for i, s in enumerate(seqs):
            key = tuple(s.tokens[: self.group_prefix_tokens])
            keyed.append((first_seen.setdefault(key, i), i, s))
        queued = [s for _, _, s in sorted(keyed, key=lambda t: (t[0], t[1]))]
        self.waiting.extend(queued)
        if self.pending is not None:
            for s in queued:
                self.pending.add(s.seq_id, self._kv_tokens(s))
            if self._later_rows == "prefix" and queued:  # it stands for the rows after it, even once run
                self.pending.discard(_LAST_QUEUED)
                self.pending.add(_LAST_QUEUED, self._kv_tokens(queued[-1]))

    def schedule(self) -> Batch:
        """A wave whenever a waiting sequence can be admitted, and a decode step of the sequences
        running before it: in one step when mixing (its wave kept to mixed_prefill_tokens), else
        the wave first and the decode step when no sequence can be admitted.

        The wave is admitted first, so a prompt matches only K/V already written (a decode step's
        reserved position is written during the step); if the decode step then lacks a chunk, the
        wave goes back to the queue and the running sequences keep their places."""
        batch = Batch()
        decoding = list(self.running)
        mix = self.mixed_prefill_tokens > 0 and bool(decoding)
        batch.prefill = self._form_wave(batch, self.mixed_prefill_tokens if mix else self.max_prefill_tokens)
        if decoding and (mix or not batch.prefill):
            self._reserve_decode(batch, decoding)
            self.decode_steps_since_idle += 1
        return batch

    @property
    def running_cap(self) -> int:
        """Sequences allowed to run at once now: max_batch, opened in RAMP_STAGES parts over the
        first answer when the job has more rows than that."""
        if not self.answers_throughout:
            return self.max_batch
        known = max(self.expected_rows, len(self.waiting) + len(self.running) + self.finished_since_idle)
        if known <= self.max_batch:
            return self.max_batch  # one batch: nothing to stagger
        length = self.answer_steps or self._longest_answer()
        stage = 1 + RAMP_STAGES * self.decode_steps_since_idle // max(1, length)
        if stage >= RAMP_STAGES:
            return self.max_batch
        return min(self.max_batch, max(MIN_RUNNING // RAMP_STAGES, -(-self.max_batch * stage // RAMP_STAGES)))

    def _longest_answer(self) -> int:
        """An answer's length before any has finished: max_new_tokens of the oldest row."""
        seq = self.running[0] if self.running else self.waiting[0] if self.waiting else None
        return seq.params.max_new_tokens if seq is not None else 1

    # -- admission ----------------------------------------------------------------------------
    def _form_wave(self, batch: Batch, budget: int) -> list[Admission]:
        """Admit waiting sequences, in order, for one batched prefill.

        A prompt that would reuse chunks still being prefilled in this wave waits for the next
        wave, so a shared prefix is computed once. While others run, a sequence joins only if every
        running sequence (and it) keeps one free chunk for its next append, or preemption churns;
        insert checks that before touching the tree, so a refusal leaves the cache as it was.
        """
        tree = self.tree
        wave: list[Admission] = []
        cap = self.running_cap
        while self.waiting and len(self.running) < cap:
            seq = self.waiting[0]
            kv_tokens = self._kv_tokens(seq)
            if wave and (budget <= 0 or tree.waits_for_pending(kv_tokens)):
                break
            try:
                cached = tree.insert(seq.seq_id, kv_tokens, reserve=len(self.running) + 1 if self.running else 0)
            except PoolExhausted:
                if self.running:
                    batch.held_back = True
                    break  # wait for running sequences to finish and free chunks
                # Alone, with every cached chunk evictable, and it still does not fit: it never will.
                self._dequeue()
                self._end_unfittable(seq)
                batch.ended.append(seq)
                continue
            self._dequeue()
            self.running.append(seq)
            wave.append(Admission(seq, kv_tokens, cached))
            budget -= len(kv_tokens) - cached
        return wave

    def _end_unfittable(self, seq: Sequence) -> None:
        if seq.output:  # it ran before and outgrew the budget: its text so far is its answer
            seq.finish_reason = "length"
        else:
            seq.error = kv_budget_error(len(seq.tokens), self.tree.pool) or (
                f"prompt of {len(seq.tokens)} tokens does not fit the KV budget; raise --kv-memory"
            )
            seq.finish_reason = "error"

    # -- decode -------------------------------------------------------------------------------
    def _reserve_decode(self, batch: Batch, decoding: list[Sequence]) -> None:
        """A position for the last token of every sequence in `decoding` (the running ones, the
        step's wave aside). When the pool is full (the tree has already evicted all cache), the
        step's wave goes back to the queue first; then the youngest sequence is preempted and will
        recompute; the oldest always progresses, so preemption cannot ping-pong. A sequence that
        is the only one left and still gets no chunk has outgrown the whole budget: it ends with
        "length"."""
        rest = decoding  # oldest first, so victims (youngest) never appended yet
        while rest:
            done = self.tree.append_all([s.seq_id for s in rest], [s.tokens[-1] for s in rest], batch.slots)
            if done == len(rest):
                break
            rest = rest[done:]  # rest[0] found no chunk: tried again unless it leaves
            if batch.prefill:
                self._requeue(batch.prefill)
                batch.prefill = []
            elif len(self.running) == 1:
                self._remove(rest[0])
                rest[0].finish_reason = "length"
                batch.ended.append(rest[0])
                rest = rest[1:]
            else:
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted += 1
                rest = [s for s in rest if s is not victim]
        batch.decode = [s for s in self.running if s.seq_id in batch.slots]

    def _requeue(self, wave: list[Admission]) -> None:
        """A wave that has not run back at the head of the queue, in its order; its chunks,
        never written, are freed."""
        for seq, _, _ in reversed(wave):
            self._remove(seq)
            self.waiting.appendleft(seq)
            if self.pending is not None:
                self.pending.add(seq.seq_id, self._kv_tokens(seq))

    def _preempt(self, seq: Sequence) -> None:
        """Back to the front of the queue; it recomputes its K/V when memory allows (the ready
        ones stay as cache, so often there is little to recompute)."""
        self._remove(seq)
        seq.preempted = True
        self.waiting.appendleft(seq)
        if self.pending is not None:
            self.pending.add(seq.seq_id, self._kv_tokens(seq))
        self.preemptions += 1

    # -- leaving ------------------------------------------------------------------------------
    def finish(self, seq: Sequence) -> None:
        """The engine is done with a running sequence: its chunks become cache."""
        self._remove(seq)
        if self.answer_steps is None:
            self.answer_steps = self.decode_steps_since_idle
        self.finished_since_idle = self.finished_since_idle + 1 if self.has_work else 0
        if not self.has_work:  # idle: the next rows are a new job
            self.decode_steps_since_idle, self.answer_steps = 0, None

    def abort(self, seqs: list[Sequence]) -> None:
        """A prefill failed: drop its sequences (their unwritten chunks are freed, not cached)."""
        for seq in seqs:
            self._remove(seq)

    def _remove(self, seq: Sequence) -> None:
        self.tree.remove(seq.seq_id)
        self.running.remove(seq)

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
