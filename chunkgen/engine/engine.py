"""The step loop: each step runs what the scheduler hands over, a prefill wave, a decode step for
every running sequence, or both in one forward, and returns the requests that finished in it."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from chunkgen.cache import ChunkPool, KVReservation, PrefixTree
from chunkgen.cache.pages import release_freed_pages
from chunkgen.cache.stats import unshared_chunks
from chunkgen.config import Config, kv_dtype_for
from chunkgen.device import on_model_device
from chunkgen.engine.constraint import Constraints
from chunkgen.engine.detokenize import IncrementalDetokenizer
from chunkgen.engine.logits import Penalties, PenaltyRows, StepLogprobs, TokenLogprob, token_texts
from chunkgen.engine.params import ParamError, spec_of
from chunkgen.engine.prompt_scores import first_missing, read_stored, store, stored_width
from chunkgen.engine.runner import ModelRunner, PrefillItem
from chunkgen.engine.sampler import SamplingBatch, StepReader, draw, make_generator, redo_short_rows
from chunkgen.engine.scheduler import Admission, Batch, Scheduler, kv_budget_error
from chunkgen.engine.sequence import Request, Result, Sequence
from chunkgen.engine.threads import steer_threads
from chunkgen.model.llama import LlamaModel

# New tokens of a CPU prefill wave whose freed activations are handed back to the OS before the next
# decode step (cache/pages.py: release_freed_pages); smaller waves' pages stay for the steps after.
# Mixed steps' (at most --mixed-prefill-tokens each), before the first decode step without prefill
# after _MIXED_TOKENS_RELEASED of them: at most one release for so many tokens prefilled.
_LARGE_WAVE_TOKENS = 1024
_MIXED_TOKENS_RELEASED = 512


def _new_tokens(wave: list[Admission]) -> int:
    return sum(len(a.kv_tokens) - a.cached for a in wave)


@dataclass
class EngineStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    mask_s: float = 0.0  # of prefill_s + decode_s: steps waiting for constraint masks and applying them
    decode_steps: int = 0  # mixed steps included
    # Decode steps that ran a prefill wave in the same forward; their time is split between
    # prefill_s and decode_s by the rows each part ran.
    mixed_steps: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens actually computed (the rest came from the cache)
    prefill_rows: int = 0  # positions run through the model at prefill: prefilled_tokens plus those computed again
    generated_tokens: int = 0
    queued_prompt_tokens: int = 0  # prompt tokens of every sequence given to the engine (prompt_tokens: admitted)
    preemptions: int = 0
    held_back_steps: int = 0  # steps in which sequences waited below max_batch for KV memory
    finished: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    kv_peak_bytes: int = 0  # chunks live sequences read at the worst moment (cached ones not counted)
    kv_released_chunks: int = 0  # cached chunks freed at once because no row to come could share them
    kv_given_back_bytes: int = 0  # pool pages handed back to the OS (free slots the recent steps did not need)
    kv_unshared_peak_bytes: int = 0  # what the live sequences would have needed without sharing


class Engine:
    def __init__(
        self, model: LlamaModel, tokenizer, config: Config | None = None, kv: KVReservation | None = None
    ) -> None:
        """kv: K/V memory shared with other engines of the same model, which take turns on it (the
        LLM's); without it the engine reserves its own pool."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or Config()
        self.kv = kv
        self._later_rows = "unknown"
        self._fresh_cache()
        self.stats = EngineStats()
        self.eos_ids = self._eos_ids()
        self._token_text = token_texts(tokenizer)
        self._constraints: Constraints | None = None  # built with the first constrained request
        self._num_constrained = 0  # live sequences with a matcher: none, no mask work at all
        self._pending: dict[int, list[Sequence]] = {}  # request key -> its samples, until all finish
        self._refused: list[Result] = []  # error results of requests refused by add(), for the next step
        self._plan: tuple | None = None  # (seq ids, SamplingBatch, penalized rows) of the last sampled batch
        self._penalties: Penalties | None = None  # generated-token counts, built with the first penalized batch
        self._reader = StepReader()  # the step's one device-to-host read
        self._wave_pages_kept = False  # a large wave's freed activations are still with malloc
        self._mixed_tokens = 0  # new tokens of mixed steps since malloc last handed freed pages back

    @on_model_device
    def _fresh_cache(self) -> None:
        """An empty pool, prefix tree, runner and scheduler, the pool leased from `kv` when shared."""
        cfg, model = self.config, self.model
        if self.kv is not None:
            self.pool = self.kv.lease(self, cfg.kv_memory)
        else:
            self.pool = ChunkPool.for_run(
                (model.num_layers, model.kv_heads, model.head_dim),
                cfg,
                model.device,
                kv_dtype=kv_dtype_for(model.device, model.dtype),
            )
        self.tree = PrefixTree(self.pool, share=cfg.share_prefix)
        self.runner = ModelRunner(
            model,
            self.pool,
            self.tree,
            cfg.max_batch,
            chunk_first=cfg.chunk_first,
            enforce_eager=cfg.enforce_eager,
            batch_invariant=cfg.batch_invariant,
        )
        self.scheduler = Scheduler(
            self.tree,
            cfg.max_batch,
            cfg.max_prefill_tokens,
            group_prefix_tokens=4 * cfg.chunk_size,
            answers_throughout="max_batch" in cfg.auto,
            mixed_prefill_tokens=cfg.mixed_prefill_tokens if self._mixes(cfg) else 0,
        )
        self.scheduler.later_rows = self._later_rows

    def _mixes(self, cfg: Config) -> bool:
        """Whether a wave may share a forward with a decode step: on the CPU, whose steps run
        eagerly (a GPU replays each decode bucket as one captured graph, and the mixed forward has
        not been measured there), where the model's forward can take both (LlamaModel.mixes)."""
        return (
            cfg.mixed_prefill_tokens > 0
            and torch.device(self.model.device).type == "cpu"
            and self.runner.enforce_eager
            and self.model.mixes(self.pool.k)
        )

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for source in (getattr(self.tokenizer, "eos_token_id", None), getattr(gen, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        return ids

    # -- public -------------------------------------------------------------------------------
    def add(self, requests: Iterable[Request]) -> None:
        """Queue requests; cheap, and allowed between any two steps. A request that can never run
        comes back from the next step as a Result with `error` set and no completions."""
        if self.kv is not None and self.kv.holder is not self:  # another engine used the memory since
            self._fresh_cache()
        seqs = []
        for req in requests:
            error = self._refusal(req)
            if error:
                self._refused.append(Result(req.id, len(req.prompt_tokens), 0, [], error=error))
                continue
            samples = [Sequence(req, i, make_generator(req.params, i)) for i in range(req.params.n)]
            if spec_of(req.params) is not None:
                try:  # each sample walks the grammar on its own
                    for s in samples:
                        s.matcher = self.constraints.matcher(req.params)
                except ParamError as exc:
                    self._refused.append(
                        Result(req.id, len(req.prompt_tokens), 0, [], error=str(exc), error_field="constraint")
                    )
                    continue
                self._num_constrained += len(samples)
            self._pending[id(req)] = samples
            self.stats.queued_prompt_tokens += len(req.prompt_tokens) * len(samples)
            seqs.extend(samples)
        self.scheduler.add(seqs)

    def drop_waiting(self) -> None:
        """Forget the requests not started yet: a stop lets the running ones finish and leaves these
        to a resume. A request with a sample already running is forgotten whole (it would never
        complete); its running samples finish to no result."""
        for seq in self.scheduler.drop_waiting():
            self._release(seq)
            self._pending.pop(id(seq.request), None)

    @property
    def constraints(self) -> Constraints:
        if self._constraints is None:
            self._constraints = Constraints(self.tokenizer, self.model.vocab_size, self.eos_ids, self.model.device)
        return self._constraints

    def _sample(
        self, seqs: list[Sequence], logits: torch.Tensor, early_mask: Future | None = None
    ) -> list[tuple[int, TokenLogprob | None]]:
        """Next token of each of `seqs` from its logits row, with its logprobs entry when asked.
        Logprobs are read off the raw logits; penalties, then constraint masks change them before
        the draw. `early_mask`: the rows' masks, started before the forward that made `logits`.
        Everything runs on the logits' device; the step's one read brings back the tokens with
        their logprobs (and which rows need their cut redone exactly, a rare extra sync)."""
        batch, penalized = self._sampling_plan(seqs, logits.device)
        if penalized is not None or self._num_constrained or batch.sampled:
            logits = logits.float()  # penalties, masks and draws in fp32; greedy argmax needs none
        logprobs = StepLogprobs(logits, batch)
        if penalized is not None:
            self.penalties.apply_(logits, penalized)
        if self._num_constrained:
            t0 = time.perf_counter()  # only what the step waits for: a mask computed early is free
            mask = early_mask.result() if early_mask else self.constraints.fill([s.matcher for s in seqs])
            self.constraints.apply_(logits, mask)
            self.stats.mask_s += time.perf_counter() - t0
        tokens_dev, short = draw(logits, batch)
        parts = [tokens_dev, logprobs.columns(tokens_dev)] + ([short] if short is not None else [])
        read = self._reader.read(*parts)
        tokens = [int(t) for t in read[0]]
        redrawn: list[int] = []
        if short is not None and any(read[2]):
            new = redo_short_rows(logits, batch, tokens, [bool(f) for f in read[2]])
            redrawn = [i for i, (a, b) in enumerate(zip(tokens, new)) if a != b]
            if redrawn:
                tokens_dev = torch.tensor(new, device=logits.device)
            tokens = new
        if penalized is not None:
            self.penalties.count_(penalized, tokens_dev)
        return list(zip(tokens, logprobs.entries(read[1], tokens, self._token_text, redrawn)))

    def _sampling_plan(self, seqs: list[Sequence], device: torch.device) -> tuple[SamplingBatch, PenaltyRows | None]:
        """The batch's sampling parameters and penalized rows on the device, rebuilt only when
        the sequences sampled (or their order) change: most decode steps reuse the last plan."""
        key = tuple(s.seq_id for s in seqs)
        if self._plan is None or self._plan[0] != key:
            batch = SamplingBatch([s.params for s in seqs], [s.generator for s in seqs], device)
            self._plan = (key, batch, self.penalties.plan(seqs))
        return self._plan[1], self._plan[2]

    @property
    def penalties(self) -> Penalties:
        if self._penalties is None:
            self._penalties = Penalties(self.model.vocab_size, self.model.device)
        return self._penalties

    def _refusal(self, req: Request) -> str | None:
        n = len(req.prompt_tokens)
        if n == 0:
            return "empty prompt"
        if n > self.model.max_context or (n == self.model.max_context and req.params.max_new_tokens):
            # room for at least one generated token, unless the prompt is only scored
            return f"prompt of {n} tokens does not fit the model's context of {self.model.max_context}"
        return kv_budget_error(n, self.pool)

    @property
    def has_work(self) -> bool:
        return bool(self._refused) or self.scheduler.has_work

    @property
    def later_rows(self) -> str:
        """What the caller will add after the rows queued now (scheduler.LATER_ROWS): "unknown"
        (the default) keeps finished rows' chunks cached until the pool needs their slots;
        "prefix" (rows to come follow in prefix order) and "none" (no more rows) release at once
        the cached chunks no queued row can share."""
        return self._later_rows

    @later_rows.setter
    def later_rows(self, value: str) -> None:
        self.scheduler.later_rows = value  # checks it
        self._later_rows = value

    @property
    def expected_rows(self) -> int:
        """How many rows the caller's job has in all, when it knows (0: unknown): a job of more
        than one batch opens its batch in parts (Scheduler.running_cap)."""
        return self.scheduler.expected_rows

    @expected_rows.setter
    def expected_rows(self, value: int) -> None:
        self.scheduler.expected_rows = value

    @property
    def num_waiting(self) -> int:
        """Sequences (one per sample) queued and not running, preempted ones included."""
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        """Sequences holding KV chunks: decoding, or in the prefill wave of this step."""
        return self.scheduler.num_running

    def stream(self, requests: Iterable[Request] = ()) -> Iterator[Result]:
        """Results as they finish (completion order)."""
        self.add(requests)
        while self.has_work:
            yield from self.step()

    @on_model_device
    def step(self) -> list[Result]:
        """A prefill wave, a decode step or both (the scheduler decides), then the requests whose
        samples have all finished: at prefill (e.g. max_new_tokens=1), decoding, or refused."""
        results, self._refused = self._refused, []
        if not self.scheduler.has_work:
            return results
        if self.pool.device.type == "cpu":
            steer_threads()
        batch = self.scheduler.schedule()
        self.stats.preemptions += batch.preempted
        self.stats.held_back_steps += batch.held_back
        done: list[Sequence] = []
        for seq in batch.ended:  # out of memory for good: already out of the cache
            self._release(seq)
            if seq.finish_reason == "length":
                seq.text = self.tokenizer.decode(seq.output, skip_special_tokens=True)
            self.stats.finished += 1
            done.append(seq)
        if batch.decode and (
            self._wave_pages_kept or not batch.prefill and self._mixed_tokens >= _MIXED_TOKENS_RELEASED
        ):
            release_freed_pages()  # prefill over: what decode writes (K/V) would go on top
            self._wave_pages_kept, self._mixed_tokens = False, 0
        if batch.prefill and batch.decode:
            if self.pool.device.type == "cpu":
                self._mixed_tokens += _new_tokens(batch.prefill)
            self._mixed(batch, done)
        elif batch.prefill:
            self._run_wave(batch.prefill, done)
        elif batch.decode:
            self._decode(batch, done)
        self._end_step()
        return results + self._collect(done)

    def _end_step(self) -> None:
        """Memory after a step: cached chunks no row to come can share released, the pool's free
        pages beyond what recent steps needed handed back to the OS, the live peak noted."""
        self.stats.kv_released_chunks += self.scheduler.release_cache()
        self.stats.kv_given_back_bytes += self.pool.end_step()
        self.stats.kv_peak_bytes = max(self.stats.kv_peak_bytes, self.tree.live_peak * self.pool.bytes_per_slot)

    def _note_unshared(self) -> None:
        """The peak of what the live sequences would hold without sharing, beside the live peak."""
        self.stats.kv_unshared_peak_bytes = max(
            self.stats.kv_unshared_peak_bytes, unshared_chunks(self.tree) * self.pool.bytes_per_slot
        )

    # -- prefill ------------------------------------------------------------------------------
    def _run_wave(self, wave: list[Admission], done: list[Sequence]) -> None:
        t0 = time.perf_counter()
        try:
            self._prefill(wave)
        except BaseException:
            self.scheduler.abort([a.seq for a in wave])  # their unwritten chunks are freed
            raise
        self.stats.prefill_s += time.perf_counter() - t0
        self._wave_pages_kept |= self.pool.device.type == "cpu" and _new_tokens(wave) >= _LARGE_WAVE_TOKENS
        self._note_unshared()  # before rows answered by the wave alone (one new token) leave the tree
        for seq, _, _ in wave:
            if seq.finish_reason:
                self._finish(seq, done)

    def _prefill(self, wave: list[Admission]) -> None:
        items, owners = self._wave_items(wave)
        early = self._early_masks([seq for seq, item in zip(owners, items) if item.want_logits])
        logits, scores = self.runner.prefill_scored(items) if items else ([], [])
        sampled = self._wave_ran(wave, owners, items, logits, scores)
        if sampled:
            picks = self._sample([s for s, _ in sampled], torch.stack([lg for _, lg in sampled]), early)
            for (seq, _), (token, entry) in zip(sampled, picks):
                self._accept(seq, token, entry)

    def _early_masks(self, seqs: list[Sequence]) -> Future | None:
        """The constraint masks of `seqs`, started now, while the forward that needs them runs."""
        return self.constraints.fill_async([s.matcher for s in seqs]) if self._num_constrained and seqs else None

    def _wave_items(self, wave: list[Admission]) -> tuple[list[PrefillItem], list[Sequence]]:
        """What the wave computes: one item per sequence with positions to run, and its owner."""
        items, owners = [], []
        C = self.pool.chunk_size
        for seq, kv_tokens, cached in wave:
            n = len(kv_tokens)
            fresh = not seq.preempted
            if fresh:
                seq.cached_tokens = cached
                self.stats.prompt_tokens += n
            self.stats.prefilled_tokens += n - cached
            want = fresh and seq.params.max_new_tokens > 0
            # A fully cached prompt still needs its last position's logits: recompute that token.
            start = min(cached, n - 1) if want else cached
            width = first = None
            alternatives: tuple[int, ...] = ()
            if fresh and seq.index == 0 and seq.params.prompt_logprobs is not None:
                # Entries of cached tokens come from their chunks; from the first one missing
                # there, the position before it is computed again (its K/V are not rewritten).
                width = stored_width(seq.params.prompt_logprobs)
                lo, hi = min(max(seq.request.score_from, 1), n), min(start + 1, n)
                missing = first_missing(self.tree.paths[seq.seq_id], C, lo, hi, width)
                if missing < hi:
                    start = missing - 1
                if start == n:  # every entry is in the tree: nothing to compute
                    self._keep_prompt_scores(seq, kv_tokens, n, [])
                # Logits only from score_from on: the tokens before it are computed, not scored.
                first = max(start + 1, lo)
                if first == lo:  # the position before score_from is computed: it scores the alternatives
                    alternatives = seq.request.score_alternatives
            if start < n:  # a re-admitted sequence whose K/V are all cached has nothing to compute
                items.append(
                    PrefillItem(kv_tokens, start, cached, self.tree.slots(seq.seq_id), want, width, first, alternatives)
                )
                owners.append(seq)
                self.stats.prefill_rows += n - start
        return items, owners

    def _wave_ran(
        self, wave: list[Admission], owners: list[Sequence], items: list[PrefillItem], logits: list, scores: list
    ) -> list[tuple[Sequence, torch.Tensor]]:
        """After the wave's forward: prompt scores kept, its chunks ready, scored-only sequences
        finished; returns the sequences to sample with their logits (those that wanted them)."""
        for seq, item, scored in zip(owners, items, scores):
            if scored is not None:
                entries, alternative_logprobs = scored
                self._keep_prompt_scores(seq, item.tokens, item.score_first, entries)
                if item.alternatives and entries:
                    seq.alternative_logprobs = alternative_logprobs
        for seq, _, _ in wave:
            self.tree.mark_ready(seq.seq_id)
            if not seq.preempted and seq.params.max_new_tokens == 0:  # scored only
                seq.finish_reason = "length"
        return [(seq, lg) for seq, lg in zip(owners, logits) if lg is not None]  # the wanted ones

    def _keep_prompt_scores(self, seq: Sequence, tokens: list[int], first: int, computed: list) -> None:
        """The prompt's entries from score_from on: those computed now, of positions from `first`
        on (kept with their chunks for the prompts after it), the earlier ones read from the chunks."""
        path, C = self.tree.paths[seq.seq_id], self.pool.chunk_size
        store(path, C, first, computed)
        n = len(tokens)
        lo = min(max(seq.request.score_from, 1), n)
        entries = read_stored(path, C, lo, min(first, n)) + computed[max(0, lo - first) :]
        k, text = seq.params.prompt_logprobs, self._token_text
        out: list[TokenLogprob | None] = [None] * lo
        for p, (lp, alts) in zip(range(lo, n), entries):
            top = [TokenLogprob(i, *text(i), v) for i, v in alts[:k]]
            out.append(TokenLogprob(tokens[p], *text(tokens[p]), lp, top))
        seq.prompt_logprobs = out
        seq.prompt_token_texts = [text(t)[0] for t in tokens]

    # -- decode -------------------------------------------------------------------------------
    def _decode(self, batch: Batch, done: list[Sequence]) -> None:
        """One token for every sequence of the batch; the scheduler reserved their positions."""
        t0 = time.perf_counter()
        self._note_unshared()
        ctx = self.runner.ctx
        ctx.refresh()
        by_id = {s.seq_id: s for s in batch.decode}
        order = [by_id[s] for s in ctx.order]  # the tree holds exactly the running sequences
        early = self.constraints.fill_async([s.matcher for s in order]) if self._num_constrained else None
        logits = self.runner.decode(
            [s.tokens[-1] for s in order], [len(s.tokens) - 1 for s in order], [batch.slots[s.seq_id] for s in order]
        )
        picks = self._sample(order, logits, early)
        for seq, (token, entry) in zip(order, picks):
            self._accept(seq, token, entry)
            if seq.finish_reason:
                self._finish(seq, done)
        self.stats.decode_steps += 1
        self.stats.batch_sizes.append(len(order))
        self.stats.decode_s += time.perf_counter() - t0

    # -- mixed --------------------------------------------------------------------------------
    def _mixed(self, batch: Batch, done: list[Sequence]) -> None:
        """A decode step and a prefill wave in one forward (Scheduler's mixed steps): the linear
        layers read their weights once for both, and the running sequences do not wait for the
        wave. Each row's numbers are those of the separate steps."""
        t0 = time.perf_counter()
        wave = batch.prefill
        ctx = self.runner.ctx
        ctx.refresh(exclude=frozenset(a.seq.seq_id for a in wave))  # the wave's sequences decode from the next step
        by_id = {s.seq_id: s for s in batch.decode}
        order = [by_id[s] for s in ctx.order]
        try:
            items, owners = self._wave_items(wave)
            wanted = [seq for seq, item in zip(owners, items) if item.want_logits]
            early = self._early_masks(order + wanted)
            tokens = [s.tokens[-1] for s in order]
            positions = [len(s.tokens) - 1 for s in order]
            slots = [batch.slots[s.seq_id] for s in order]
            if items:
                logits, wave_logits, scores = self.runner.mixed(tokens, positions, slots, items)
            else:  # the wave's K/V were all cached (re-admitted sequences): nothing of it to compute
                logits, wave_logits, scores = self.runner.decode(tokens, positions, slots), [], []
        except BaseException:
            self.scheduler.abort([a.seq for a in wave])  # their unwritten chunks are freed
            raise
        sampled = self._wave_ran(wave, owners, items, wave_logits, scores)
        self._note_unshared()
        if sampled:
            logits = torch.cat([logits, torch.stack([lg for _, lg in sampled]).to(logits.dtype)])
        rows = order + [s for s, _ in sampled]
        for seq, (token, entry) in zip(rows, self._sample(rows, logits, early)):
            self._accept(seq, token, entry)
        for seq in order + [a.seq for a in wave]:
            if seq.finish_reason:
                self._finish(seq, done)
        elapsed = time.perf_counter() - t0
        wave_rows = sum(len(it.tokens) - it.start for it in items)
        share = wave_rows / (wave_rows + len(order))
        self.stats.prefill_s += elapsed * share
        self.stats.decode_s += elapsed * (1 - share)
        self.stats.decode_steps += 1
        self.stats.mixed_steps += 1
        self.stats.batch_sizes.append(len(order))

    # -- tokens and endings -------------------------------------------------------------------
    def _accept(self, seq: Sequence, token: int, entry: TokenLogprob | None = None) -> None:
        seq.tokens.append(token)
        self.stats.generated_tokens += 1
        if seq.logprobs is not None:
            seq.logprobs.append(entry)
        p = seq.request.params
        m = seq.matcher
        # Consumed here only: a preempted sequence recomputes its K/V, never its tokens.
        if m is not None and not m.consume_token(token):  # the mask allowed it: a bug, not the model's
            seq.finish_reason, seq.error, seq.error_field = "error", f"constraint: {m.get_error()}", "constraint"
            return
        # A finished grammar admits nothing but EOS: the answer is complete, as if EOS came.
        if (
            (m is not None and m.is_stopped())
            or (token in self.eos_ids and not p.ignore_eos)
            or token in p.stop_token_ids
        ):
            seq.finish_reason = "stop"
        elif p.stop:  # decoded a few tokens at a time; only new text is searched
            seq.detok = seq.detok or IncrementalDetokenizer(self.tokenizer, p.stop)
            _, hit = seq.detok.add(token)
            if not hit and (
                len(seq.tokens) - seq.num_prompt >= p.max_new_tokens or len(seq.tokens) >= self.model.max_context
            ):
                _, hit = seq.detok.finish()  # text held back mid-character may end in a stop string
            if hit:  # the text ends before the stop string, token_ids with the last token wholly before it
                seq.finish_reason, seq.text = "stop", seq.detok.text
                cut = len(seq.tokens) - seq.num_prompt - seq.detok.num_tokens
                del seq.tokens[seq.num_prompt + seq.detok.num_tokens :]
                if seq.logprobs is not None:
                    del seq.logprobs[seq.detok.num_tokens :]
                if m is not None and cut:
                    m.rollback(cut)  # so whether the answer satisfies its constraint is judged on what is kept
                return
        n = len(seq.tokens)
        if seq.finish_reason is None and (n - seq.num_prompt >= p.max_new_tokens or n >= self.model.max_context):
            seq.finish_reason = "length"
        if seq.finish_reason:
            seq.text = self.tokenizer.decode(seq.output, skip_special_tokens=True)

    def _release(self, seq: Sequence) -> None:
        if seq.matcher is not None:
            seq.matched = seq.finish_reason != "error" and seq.matcher.is_accepting()
            seq.matcher = None
            self._num_constrained -= 1

    def _finish(self, seq: Sequence, done: list[Sequence]) -> None:
        self._release(seq)
        self.scheduler.finish(seq)
        self.stats.finished += 1
        done.append(seq)

    def _collect(self, done: list[Sequence]) -> list[Result]:
        results = []
        for seq in done:
            samples = self._pending.get(id(seq.request))
            if samples is not None and all(s.finish_reason for s in samples):
                del self._pending[id(seq.request)]
                first = samples[0]
                failed = next((s for s in samples if s.error), None)
                results.append(
                    Result(
                        id=seq.request.id,
                        prompt_tokens=first.num_prompt,
                        cached_tokens=first.cached_tokens or 0,
                        completions=[] if failed else [s.completion() for s in samples],
                        error=failed and failed.error,
                        error_field=failed and failed.error_field,
                        prompt_logprobs=None if failed else first.prompt_logprobs,
                        prompt_token_texts=None if failed else first.prompt_token_texts,
                        alternative_logprobs=None if failed else first.alternative_logprobs,
                    )
                )
        return results
