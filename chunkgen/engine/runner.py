"""ModelRunner: turns what the scheduler decided (a prefill wave, a decode batch, or both) into the
step's inputs on the model's device and runs the model over them; the engine samples from the logits.

A prefill wave is prepared into a `PrefillStep`: each sequence's uncached tokens as rows of one
batch, their positions, the pool slots their K/V are stored in, and the attention plan that groups
sequences reading the same cached chunks (kernels/prefill.py), made once per wave, not per layer.
On the CPU a large wave runs in pieces (`wave_pieces`), one after another through every layer.

Everything a decode step reads lives in fixed-capacity buffers owned by the kernel context
(cache/context.py): the step's tokens, positions and K/V write rows, and the tree's index arrays.
The runner fills them in place on the host and moves them with one host->device copy; the model's
decode is a plain forward over those buffers. Batches are padded to a few bucket sizes, so each
bucket has one shape: on the GPU each is captured once as a CUDA graph and replayed every step. The
replay logic is the same on the CPU (the captured callable is called over the same static buffers),
so the buffer refresh a replay depends on is exercised everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from chunkgen._native import native
from chunkgen.cache import ChunkPool, KernelContext, PrefixTree
from chunkgen.engine.prompt_scores import Entry, ScoreSpan, score_spans
from chunkgen.kernels import invariant, workspace_for
from chunkgen.kernels.prefill import Group, PrefillSpan, PrefillStep, lone_spans, plan_groups
from chunkgen.kernels.varlen import VarlenWave, flash_takes, plan_wave
from chunkgen.model.llama import LlamaModel


@dataclass
class PrefillItem:
    """One sequence's share of a prefill wave: K/V of [0, start) are already in the pool along
    path_slots; positions [start, len(tokens)) are computed and those >= write_from are stored."""

    tokens: list[int]
    start: int
    write_from: int
    path_slots: list[int]
    want_logits: bool = True
    # Alternatives kept per scored token (prompt_scores.stored_width), or None: the logprobs of
    # tokens [score_first, len(tokens)) are computed too (score_first > start; default start + 1).
    score_width: int | None = None
    score_first: int | None = None
    # Token ids whose logprobs are wanted at the position before score_first as well.
    alternatives: tuple[int, ...] = ()


# A CPU wave of more than twice this many elements of hidden state (rows x hidden size) runs in
# pieces of at most this many, each through every layer before the next, a sequence cut between
# pieces at a chunk boundary: the next piece reads the K/V the earlier ones wrote as a cached
# prefix. The wave's working set (its hidden states, q/k/v, attention output, the products' int8
# rows; malloc's heap grows by about twice that) is then a piece's: a 7B model's 2,080-token wave
# held 0.3 GiB of it, over the 1.2x the weight file a GGUF run is held to (pieces of 512 rows left
# it at 1.19-1.21x, of 256 rows at 1.17x). 2^20 is 256 rows of a 7-8B model (as fast a product as
# 2,048 rows), 512 of a 1B one; the default model's 2,080-token shared prompt (1.2M elements)
# stays whole, where pieces cost its prefill 0.1 s of 1.2. With batch-invariant numerics a row's
# bits are the same in any piece (a cached prefix gives the bits of one computed now); the GPU,
# whose memory is not the bound, runs a wave whole.
WAVE_PIECE_ELEMENTS = 1 << 20


def wave_piece_tokens(hidden_size: int, chunk_size: int) -> int:
    """New tokens a CPU wave's piece holds: WAVE_PIECE_ELEMENTS of hidden state, whole chunks."""
    return max(chunk_size, WAVE_PIECE_ELEMENTS // hidden_size // chunk_size * chunk_size)


def wave_pieces(items: list[PrefillItem], budget: int, chunk_size: int) -> list[list[tuple[int, PrefillItem]]]:
    """A wave's items in pieces of at most `budget` new tokens, in order, each entry (the item's
    index, its part). An item longer than what is left of a piece is cut at chunk boundaries; only
    its last part wants logits or scores. A scored item goes whole (its logprobs are read off one
    forward's hidden states), as does every item of a wave within the budget."""
    budget = max(budget, chunk_size)  # an empty piece always takes a chunk, so every item ends
    pieces: list[list[tuple[int, PrefillItem]]] = []
    piece: list[tuple[int, PrefillItem]] = []
    room = budget
    for index, it in enumerate(items):
        start, end = it.start, len(it.tokens)
        while end - start > room and it.score_width is None:
            cut = (start + room) // chunk_size * chunk_size  # > start in an empty piece: budget >= a chunk
            if cut > start:
                part = PrefillItem(
                    it.tokens[:cut], start, max(it.write_from, start), it.path_slots[: -(-cut // chunk_size)], False
                )
                piece.append((index, part))
                start = cut
            pieces.append(piece)
            piece, room = [], budget
        piece.append(
            (index, it if start == it.start else replace(it, start=start, write_from=max(it.write_from, start)))
        )
        room -= end - start
        if room <= 0:
            pieces.append(piece)
            piece, room = [], budget
    if piece:
        pieces.append(piece)
    return pieces


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every multiple of 8 up to max_batch (as vLLM's graphs)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


# Only the capturing thread is held to what a capture forbids: the constraint worker fills the next
# step's masks (and may allocate a pinned buffer for them) while a new bucket is captured, which
# under "global" invalidated the capture and failed the run.
CAPTURE_ERROR_MODE = "thread_local"


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        pool: ChunkPool,
        tree: PrefixTree,
        max_batch: int,
        chunk_first: bool = True,
        enforce_eager: bool | None = None,
        mirror: bool | None = None,
        compile_backend: str | None = None,
        batch_invariant: bool = True,
    ) -> None:
        """enforce_eager: run the forward directly each step (default on the CPU, and always for a
        model whose step is not graph_safe); otherwise one captured graph per bucket is replayed
        (a CUDA graph on the GPU; on the CPU the same callable over the same buffers, for tests).
        mirror: see KernelContext. compile_backend: run the decode forward through
        torch.compile(fullgraph=True) with that backend. batch_invariant: the numerics every step
        runs with (kernels/invariant.py)."""
        native()  # the decode op lives in the compiled extension: a missing build fails here, with the fix
        self.model = model
        self.pool = pool
        self.chunk_first = chunk_first
        self.batch_invariant = batch_invariant
        self.device = torch.device(model.device)
        # new tokens of a wave's piece (wave_pieces); 0: waves run whole
        self.wave_piece_tokens = (
            wave_piece_tokens(model.hidden_size, pool.chunk_size) if self.device.type == "cpu" else 0
        )
        # A wave's attention as variable-length products (kernels/varlen.py): off the CPU, whose
        # in-place kernels read a wave's sequences in one call already; True runs the GPU's way on
        # the CPU. CHUNKGEN_PREFILL_VARLEN=0: a sequence or group at a time (what it replaced, to time).
        self.prefill_varlen = self.device.type != "cpu" and os.environ.get("CHUNKGEN_PREFILL_VARLEN", "1") != "0"
        asked = self.device.type == "cpu" if enforce_eager is None else enforce_eager
        self.enforce_eager = asked or not model.graph_safe
        self.ctx = KernelContext(
            tree,
            chunk_first=chunk_first,
            # Padded batches give a captured or compiled step its one shape; a step run as it
            # comes takes its rows as they are (no padded row's work, nor its K/V written to the
            # scratch slot, whose pages a CPU pool would back in every layer).
            buckets=None if self.enforce_eager and compile_backend is None else batch_buckets(max_batch),
            device=self.device,
            scratch_slot=pool.scratch_slot,
            mirror=mirror,
        )
        self._graphs: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self._workspace: tuple[int, torch.Tensor] | None = None
        self._graph_pool = None  # one CUDA memory pool shared by every bucket's graph
        self._compiled = None
        if compile_backend is not None:  # one graph per bucket: shapes are static within one
            self._compiled = torch.compile(model.decode, fullgraph=True, dynamic=False, backend=compile_backend)

    @property
    def captures(self) -> int:
        return len(self._graphs)

    def workspace(self) -> torch.Tensor:
        """Allocated once per context layout (capacities only grow), never per step."""
        if self._workspace is None or self._workspace[0] != self.ctx.layouts:
            ws = workspace_for(self.ctx, self.model.q_heads, self.model.head_dim, self.device, self.batch_invariant)
            self._workspace = (self.ctx.layouts, ws)
        return self._workspace[1]

    def prepare(self, tokens: list[int], positions: list[int], write_rows: list[tuple[int, int]]) -> None:
        """Fill the step buffers for rows in `ctx.order` and copy them to the device (one copy)."""
        self.ctx.set_step(tokens, positions, write_rows)
        self.ctx.upload()

    def forward(self) -> torch.Tensor:
        """Logits [rows, vocab] of the prepared step (rows: the batch padded to its bucket)."""
        if self.enforce_eager:
            return self._run()
        key = (self.ctx.rows, self.ctx.layouts)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture()
        return graph()

    def largest_capture(self) -> Callable[[], torch.Tensor] | None:
        """The replay of the largest bucket's captured step, None before any capture. Replaying it
        recomputes the last step prepared for that bucket (its K/V written again to the same
        slots): for counting what a step launches once a run is over, not for decoding."""
        return self._graphs[max(self._graphs)] if self._graphs else None

    def _decode(self, *args) -> torch.Tensor:
        return (self._compiled or self.model.decode)(*args)

    def _run(self) -> torch.Tensor:
        return self._decode(self.ctx.arrays(), self.pool.k, self.pool.v, self.workspace(), self.chunk_first)

    def _capture(self) -> Callable[[], torch.Tensor]:
        """A callable that recomputes the prepared step over the buffers bound now. Valid while the
        context keeps its rows and layout (the key it is stored under)."""
        arrays, ws = self.ctx.arrays(), self.workspace()
        run = lambda: self._decode(arrays, self.pool.k, self.pool.v, ws, self.chunk_first)  # noqa: E731
        if self.device.type != "cuda":
            return run
        # The capture writes K/V of the prepared step, as the eager step would: replaying it once
        # afterwards is the step itself. Warm-up on a side stream first, as torch recommends.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode=CAPTURE_ERROR_MODE):
            logits = run()
        self._graph_pool = graph.pool()

        def replay() -> torch.Tensor:
            # The graph reads and writes the buffers bound at capture: held here, so that after a
            # layout change (new buffers, this key never stepped again) largest_capture's replay
            # still reads its own, not memory the allocator has handed to something else.
            _ = arrays, ws
            graph.replay()
            return logits

        return replay

    def decode(self, tokens: list[int], positions: list[int], write_rows: list[tuple[int, int]]) -> torch.Tensor:
        """One step for the sequences in `ctx.order` (the caller refreshed the context): logits
        [batch, vocab] on the model's device."""
        invariant.set_enabled(self.batch_invariant)
        self.prepare(tokens, positions, write_rows)
        return self.forward()[: len(tokens)]

    # -- prefill ------------------------------------------------------------------------------
    def prefill(self, items: list[PrefillItem]) -> list[torch.Tensor | None]:
        """Run a wave: last-position logits [vocab] for the items that want them, None for the others."""
        return self.prefill_scored(items)[0]

    def prefill_scored(
        self, items: list[PrefillItem]
    ) -> tuple[list[torch.Tensor | None], list[tuple[list[Entry], list[float]] | None]]:
        """As prefill, and per item with a score_width the entries of its tokens [score_first, len)
        and the logprobs of its alternatives (prompt_scores.score_spans)."""
        invariant.set_enabled(self.batch_invariant)
        budget = self.wave_piece_tokens
        if not budget or sum(len(it.tokens) - it.start for it in items) <= 2 * budget:
            return self._prefill_piece(items)
        logits: list[torch.Tensor | None] = [None] * len(items)
        scores: list[tuple[list[Entry], list[float]] | None] = [None] * len(items)
        for piece in wave_pieces(items, budget, self.pool.chunk_size):
            got_logits, got_scores = self._prefill_piece([part for _, part in piece])
            for (index, _), got, score in zip(piece, got_logits, got_scores):
                logits[index] = got if got is not None else logits[index]
                scores[index] = score if score is not None else scores[index]
        return logits, scores

    def _prefill_piece(
        self, items: list[PrefillItem]
    ) -> tuple[list[torch.Tensor | None], list[tuple[list[Entry], list[float]] | None]]:
        step = self.prepare_prefill(items)
        spans = _score_spans(items)
        if not spans:
            return _per_item(items, self.model.prefill(step, self.pool)), [None] * len(items)
        hidden = self.model.prefill_hidden(step, self.pool)
        logits = self.model._logits(hidden[step.logit_rows]) if step.logit_rows else None
        return _per_item(items, logits), _scores(self.model, items, hidden, spans)

    def mixed(
        self,
        tokens: list[int],
        positions: list[int],
        write_rows: list[tuple[int, int]],
        items: list[PrefillItem],
    ) -> tuple[torch.Tensor, list[torch.Tensor | None], list[tuple[list[Entry], list[float]] | None]]:
        """A decode step for the sequences in `ctx.order` (as decode) and a prefill wave (as
        prefill_scored) in one forward: the step's logits [batch, vocab], then the wave's per item."""
        invariant.set_enabled(self.batch_invariant)
        self.prepare(tokens, positions, write_rows)
        wave = self.prepare_prefill(items)
        hidden = self.model.mixed_hidden(
            self.ctx.arrays(), self.pool.k, self.pool.v, self.workspace(), self.chunk_first, wave, self.pool
        )
        d_rows, b = self.ctx.rows, len(tokens)
        wanted = list(range(b)) + [d_rows + r for r in wave.logit_rows]
        logits = self.model._logits(hidden[wanted])
        spans = _score_spans(items)
        scores = _scores(self.model, items, hidden[d_rows:], spans) if spans else [None] * len(items)
        return logits[:b], _per_item(items, logits[b:] if wave.logit_rows else None), scores

    def prepare_prefill(self, items: list[PrefillItem]) -> PrefillStep:
        C = self.pool.chunk_size
        spans, ids, positions, w_slots, w_offs, w_rows = [], [], [], [], [], []
        row = 0
        # numpy per item, not Python per token: a wave of 64 fresh 2,112-token prompts is 135k rows
        for it in items:
            n = len(it.tokens)
            new = np.arange(it.start, n)
            ids.append(np.asarray(it.tokens[it.start :], dtype=np.int64))
            positions.append(new)
            written = new[max(it.write_from, it.start) - it.start :]
            w_slots.append(np.asarray(it.path_slots, dtype=np.int32)[written // C])
            w_offs.append(written % C)
            w_rows.append(written + (row - it.start))
            spans.append(PrefillSpan(it.start, it.path_slots, row, n - it.start))
            row += n - it.start
        written_rows = sum(len(w) for w in w_rows)
        dev = self.device
        # Usually every new row is written: then K/V go to the pool without a gather first.
        every_row = written_rows == row
        groups = plan_groups(spans, C, self.model.dtype, dev, alone=self.batch_invariant)
        return PrefillStep(
            tokens=_column(ids, np.int64).to(dev),
            positions=_column(positions, np.int64).to(dev),
            write_at=self.pool.write_indices(_column(w_slots, np.int32), _column(w_offs, np.int32)),
            write_rows=None if every_row else _column(w_rows, np.int64).to(dev),
            writes=written_rows > 0,
            groups=groups,
            logit_rows=[sp.row + sp.count - 1 for sp, it in zip(spans, items) if it.want_logits],
            lone=None if self.prefill_varlen else lone_spans(groups),
            varlen=self._varlen_wave(groups) if self.prefill_varlen else None,
        )

    def _varlen_wave(self, groups: list[Group]) -> VarlenWave | None:
        """The wave's lone sequences as one product, and its groups as two more where the flash
        kernel takes them (their parts merge by a log-sum-exp, read from the flash kernel only:
        fp32 groups take the per-group path)."""
        dev, m = self.device, self.model
        with_groups = dev.type != "cuda" or flash_takes(m.dtype, m.head_dim, dev)
        return plan_wave(groups, self.pool.chunk_size, dev, with_groups)


def _column(parts: list[np.ndarray], dtype: type) -> torch.Tensor:
    """One host tensor of the items' parts, end to end."""
    return torch.from_numpy(np.concatenate([*parts, np.zeros(0, dtype)]).astype(dtype, copy=False))


def _score_spans(items: list[PrefillItem]) -> list[ScoreSpan]:
    """The scored items' spans over the wave's rows."""
    spans, row = [], 0
    for it in items:
        if it.score_width is not None:
            first = it.start + 1 if it.score_first is None else it.score_first
            spans.append(ScoreSpan(row + first - 1 - it.start, it.tokens[first:], it.score_width, it.alternatives))
        row += len(it.tokens) - it.start
    return spans


def _scores(
    model: LlamaModel, items: list[PrefillItem], hidden: torch.Tensor, spans: list[ScoreSpan]
) -> list[tuple[list[Entry], list[float]] | None]:
    """Per item, its scored entries (items without a score_width: None), read off the wave's hidden states."""
    got = iter(score_spans(model, hidden, spans))
    return [next(got) if it.score_width is not None else None for it in items]


def _per_item(items: list[PrefillItem], logits: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The wave's logits rows (one per item that wants them, in order) given to their items."""
    picked = iter(logits if logits is not None else ())
    return [next(picked) if it.want_logits else None for it in items]
