"""Constrained decoding with llguidance: a JSON schema, a regex or a Lark grammar decides which
tokens may come next; the engine masks every other token's logit before sampling.

Grammars are compiled once per distinct spec (the spec string is the cache key); each sequence
(each of a request's n samples) walks its own LLMatcher. The llguidance tokenizer costs about a
second to build, so an engine builds it only when its first constrained request arrives, or on a
thread from the moment a job knows its rows are constrained (`prepare`)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from chunkgen.engine.params import ParamError, compile_spec, llguidance_module, spec_of
from chunkgen.engine.sampler import host_buffer


@dataclass
class Bitmask:
    """llguidance's packed token masks (bit t of row j: token t allowed) for some batch rows."""

    rows: list[int]  # the batch rows they mask
    bits: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32


FRESH_MATCHERS = 64  # specs whose starting matcher an engine keeps to copy


class Constraints:
    """One engine's constrained-decoding state: its llguidance tokenizer, the worker thread that
    fills masks and the lookup tables that apply them."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: set[int], device: torch.device | None = None) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.device = device or torch.device("cpu")  # where the logits are: masks are pinned for CUDA
        self.vocab_size = vocab_size  # logits' width; may exceed the tokenizer's (padded embeddings)
        self.eos_ids = sorted(eos_ids)
        self._tokenizer = None
        self._building: Future | None = None  # the tokenizer being built on a thread (prepare)
        self._executor = None
        # A matcher at the start of each spec seen lately: building one costs milliseconds (the
        # grammar's lexer against this vocabulary), a copy of it about a microsecond.
        self._fresh: dict[tuple[str, str], Any] = {}
        self._worker: ThreadPoolExecutor | None = None
        self._tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        # Two host buffers taken in turn: the next step's masks fill one while the device still
        # copies from the other (pinned for CUDA, so that copy is asynchronous).
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self._index: tuple[tuple[int, ...], torch.Tensor] | None = None  # the last rows' index on the device

    def prepare(self) -> None:
        """Start building the llguidance tokenizer on a thread, for a job that knows before its
        first row that rows are constrained: the build releases the GIL for most of its time, so
        it overlaps the job's start and the first wave's prefill instead of preceding them."""
        if self._tokenizer is None and self._building is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llguidance-tokenizer")
            self._building = pool.submit(self._build_tokenizer)
            pool.shutdown(wait=False)

    def _build_tokenizer(self):
        # every EOS the engine stops on is the grammar's end-of-text token too (the tokenizer's own
        # where the engine knows none, as from_tokenizer does)
        eos = self.eos_ids or self.hf_tokenizer.eos_token_id
        backend = getattr(self.hf_tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.padding is None and backend.truncation is None:
            # llguidance.hf.from_tokenizer's own steps but its copy of the tokenizer (a third of
            # the build), which only turns padding and truncation off: they are off
            return llguidance_module().LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
        from llguidance.hf import from_tokenizer

        return from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos)

    def _ll_tokenizer(self):
        if self._tokenizer is None:
            building, self._building = self._building, None
            self._tokenizer = building.result() if building is not None else self._build_tokenizer()
            self._executor = llguidance_module().LLExecutor()
        return self._tokenizer

    def matcher(self, params):
        """A fresh matcher for one sequence, or None for an unconstrained one."""
        spec = spec_of(params)
        if spec is None:
            return None
        fresh = self._fresh.get(spec)
        if fresh is None:
            fresh = llguidance_module().LLMatcher(self._ll_tokenizer(), compile_spec(*spec), log_level=0)
            if fresh.is_error():  # compiled without a tokenizer, yet refused with this one
                raise ParamError(spec[0], f"does not compile: {fresh.get_error()}")
            if len(self._fresh) >= FRESH_MATCHERS:
                self._fresh.pop(next(iter(self._fresh)))  # the oldest spec
            self._fresh[spec] = fresh
        return fresh.deep_copy()

    def fill_async(self, matchers: list) -> Future:
        """`fill` on a worker thread: llguidance computes masks without the GIL, so the engine
        starts a decode step's masks before the model's forward and collects them after it."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="chunkgen-mask")
        return self._worker.submit(self.fill, matchers)

    def fill(self, matchers: list) -> Bitmask | None:
        """The packed masks of the rows whose matcher is not None (None when there are none), in
        the host buffer not filled last time: a step's masks may be copied to the device while
        the next step's are computed."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        words = (self.vocab_size + 31) // 32
        self._turn ^= 1
        buf = self._buffers[self._turn]
        if buf is None or buf.shape[0] < len(rows):
            buf = self._buffers[self._turn] = host_buffer(
                (max(len(rows), 2 * (0 if buf is None else buf.shape[0])), words), torch.int32, self.device
            )
        bitmask = buf[: len(rows)]  # contiguous int32 rows of `words` words, on the host
        # What llguidance.torch.fill_next_token_bitmask_par does, without importing that module:
        # its import runs torch.compile on a function of its own, which imports torch._dynamo
        # (about 2 s holding the GIL, on this worker while the first wave's forward runs).
        pairs = [(matchers[i], j) for j, i in enumerate(rows)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(rows))
        return Bitmask(rows, bitmask)

    @torch.inference_mode()  # the model's logits are inference tensors: in-place only in this mode
    def apply_(self, logits: torch.Tensor, mask: Bitmask | None) -> None:
        """Adds -inf, in place, to the logits of the tokens `mask` forbids, and 0 to the others:
        allowed logits keep their values, so a constraint that admits the unconstrained choice
        does not change it."""
        if mask is None:
            return
        rows, bitmask = mask.rows, mask.bits
        words = bitmask.shape[1]
        # Unpacked here rather than with llguidance.torch.apply_token_bitmask_inplace, which is
        # torch.compile'd: its first call costs seconds and a C compiler on the CPU. Each byte of
        # the mask looks up its 8 additive terms (0 allowed, -inf forbidden): one gather and one
        # add, ~9x faster on CPU than shifting the bits out (0.8 against 6.7 ms at 32 x 49,152).
        dev = logits.device
        table = self._table(dev, logits.dtype)
        bytes_ = bitmask.to(dev, non_blocking=True).view(torch.uint8).view(-1).int()
        terms = table.index_select(0, bytes_).view(len(rows), words * 32)[:, : logits.shape[1]]
        if len(rows) == logits.shape[0]:
            logits.add_(terms)
        else:
            logits.index_add_(0, self._rows_index(tuple(rows), dev), terms)

    def _rows_index(self, rows: tuple[int, ...], dev: torch.device) -> torch.Tensor:
        """The constrained rows as a device index, kept while they stay the same rows."""
        if self._index is None or self._index[0] != rows or self._index[1].device != dev:
            self._index = (rows, torch.tensor(rows, device=dev))
        return self._index[1]

    def _table(self, dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[256, 8]: for each byte value, 0 for its set bits and -inf for the others, low bit first
        (llguidance's bit order, on a little-endian machine)."""
        table = self._tables.get((dev, dtype))
        if table is None:
            bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
            table = torch.where(bits == 1, 0.0, float("-inf")).to(device=dev, dtype=dtype)
            self._tables[(dev, dtype)] = table
        return table
