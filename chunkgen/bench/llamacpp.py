"""llama.cpp as a `bench e2e` system and a reference for quantized weights: the GGUF file chunkgen
runs, through llama-cpp-python's C API (the optional extra `llamacpp`), fed the very token ids
chunkgen's rows are made of, greedy, a fixed number of new tokens per row.

How it shares a prompt is llama.cpp's own way of decoding many continuations of one prompt (its
`batched` example, the server's parallel slots): one unified KV cache in which the rows' common
prefix is decoded once, as cells every row's sequence id is attached to; then every row's own
tokens, and each decode step is one batch of one token per row. llama.cpp's attention takes each
row on its own, masking the cells of other rows, so each row reads the shared prompt's K/V at every
step, where chunkgen's chunk-first phase reads it once for all rows."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INSTALL = "pip install 'chunkgen[llamacpp]' (llama-cpp-python; it compiles llama.cpp for several minutes)"
MAX_ROWS = 256  # llama.cpp's LLAMA_MAX_SEQ: the most sequences one context holds
KV_BYTES = 2  # llama.cpp's default K/V cache type, f16


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp cannot run this comparison; the message says why and what to do."""


def gguf_file(model: str | None, dummy_weights: str | None = None) -> Path:
    """The GGUF file a run of `--model` reads (the embedded default model's when None), which
    llama.cpp runs as it is. A model folder converted from a GGUF names its file."""
    import json

    from chunkgen.model.loading import SOURCE_FILE, ModelNotFound, default_gguf

    if dummy_weights is not None:
        raise LlamaCppUnavailable("llama_cpp runs a GGUF file, not --dummy-weights; give --model FILE.gguf")
    spec = model or os.environ.get("CHUNKGEN_MODEL") or None
    if spec is None:
        try:
            return default_gguf()
        except ModelNotFound as exc:
            raise LlamaCppUnavailable(f"llama_cpp: {exc}") from None
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / SOURCE_FILE).is_file():
        try:
            source = Path(json.loads((path / SOURCE_FILE).read_text())["gguf"])
        except (OSError, ValueError, KeyError, TypeError):
            source = None
        if source is not None and source.is_file():
            return source
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    raise LlamaCppUnavailable(f"llama_cpp runs a GGUF file; {spec} is not one (give --model FILE.gguf)")


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version, or LlamaCppUnavailable saying how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise LlamaCppUnavailable(f"llama_cpp: llama-cpp-python is not installed ({exc}); {INSTALL}") from None
    return llama_cpp.__version__


def common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens every prompt starts with, decoded once for all rows; each row keeps at least its last
    token, whose logits give its first new token."""
    n = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for p in prompts[1:]:
        i = 0
        while i < n and p[i] == first[i]:
            i += 1
        n = i
    return max(n, 0)


@dataclass
class Timing:
    prefill_s: float  # until every row has its first new token
    decode_s: float
    common_tokens: int  # decoded once for all rows
    kv_cells: int  # cells the run filled (the common prefix once)


# Errors only: llama.cpp's load and context lines would bury the bench's own output. Held at module
# level: llama.cpp keeps the pointer.
_LOG_CALLBACK = None


def _quiet(lc) -> None:
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:

        @lc.llama_log_callback
        def errors_only(level: int, text: bytes, user_data) -> None:
            if level == 3:  # GGML_LOG_LEVEL_ERROR
                os.write(2, text)

        _LOG_CALLBACK = errors_only
    lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


class LlamaCpp:
    """One model and one context: `n_cells` KV cells shared by at most `max_rows` sequences,
    `threads` threads for prompt and decode batches; llama.cpp's defaults otherwise (flash
    attention where its CPU backend chooses it, f16 K/V)."""

    def __init__(self, path: Path, n_cells: int, max_rows: int, threads: int) -> None:
        llama_cpp_version()
        import llama_cpp as lc

        if max_rows > MAX_ROWS:
            raise LlamaCppUnavailable(f"llama_cpp: {max_rows} rows; llama.cpp decodes at most {MAX_ROWS} together")
        self.lc = lc
        _quiet(lc)
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        model_params.n_gpu_layers = 0  # the CPU, as chunkgen's run it is compared with
        self.model = lc.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise LlamaCppUnavailable(f"llama_cpp: llama.cpp cannot load {path}")
        params = lc.llama_context_default_params()
        params.n_ctx = n_cells
        params.n_seq_max = max_rows
        params.kv_unified = True  # one cache: the common prefix's cells belong to every row
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise LlamaCppUnavailable(f"llama_cpp: cannot make a context of {n_cells} cells for {path}")
        self.path, self.threads, self.max_rows, self.n_batch = path, threads, max_rows, lc.llama_n_batch(self.ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(self.n_batch, 0, max_rows)
        layers, heads = lc.llama_model_n_layer(self.model), lc.llama_model_n_head(self.model)
        head_dim = lc.llama_model_n_embd(self.model) // heads
        self.cell_bytes = 2 * layers * lc.llama_model_n_head_kv(self.model) * head_dim * KV_BYTES

    def close(self) -> None:
        if self.ctx:
            self.lc.llama_batch_free(self.batch)
            self.lc.llama_free(self.ctx)
            self.lc.llama_model_free(self.model)
            self.ctx = None

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        info = self.lc.llama_print_system_info().decode(errors="replace")
        features = [f.split("=")[0].strip() for f in info.split("|") if f.strip().endswith("= 1")]
        return (
            f"llama.cpp (llama-cpp-python {llama_cpp_version()}) on {self.path.name}, {self.threads} threads, "
            f"one unified f16 KV cache, CPU features {','.join(features) or 'none reported'}"
        )

    def _decode(self, tokens: list[tuple[int, int, Sequence[int], bool]]) -> None:
        """One llama_decode of (token, position, sequence ids, wants logits) entries."""
        b = self.batch
        for i, (token, pos, seqs, logits) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, len(seqs), logits
            for j, s in enumerate(seqs):
                b.seq_id[i][j] = s
        b.n_tokens = len(tokens)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc}) on a batch of {len(tokens)} tokens")

    def logits(self, index: int) -> np.ndarray:
        """The logits of entry `index` of the last decode (a view into llama.cpp's buffer)."""
        ptr = self.lc.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def _clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def top_tokens(self, ids: Sequence[int], k: int) -> list[int]:
        """The k likeliest next tokens after `ids`, most likely first, on a cleared cache."""
        self._clear()
        for start in range(0, len(ids), self.n_batch):
            stop = min(len(ids), start + self.n_batch)
            self._decode([(ids[p], p, (0,), p == len(ids) - 1) for p in range(start, stop)])
        logits = self.logits(len(ids) - 1 - start)
        return [int(t) for t in np.argsort(-logits, kind="stable")[:k]]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> tuple[list[list[int]], Timing]:
        """Greedy continuations of exactly max_new_tokens each (end of sequence is not a stop), on
        a cleared cache: the rows' common prefix once, then each row's own tokens, then one batch a
        step of every row's last token."""
        n = len(prompts)
        if n > self.max_rows:
            raise ValueError(f"{n} rows; this context holds {self.max_rows}")
        self._clear()
        shared = common_prefix(prompts)
        everyone = list(range(n))
        gen: list[list[int]] = [[] for _ in prompts]
        t0 = time.perf_counter()
        for start in range(0, shared, self.n_batch):
            stop = min(shared, start + self.n_batch)
            self._decode([(prompts[0][p], p, everyone, False) for p in range(start, stop)])
        own = [
            (p[pos], pos, (row,), pos == len(p) - 1) for row, p in enumerate(prompts) for pos in range(shared, len(p))
        ]
        rows_of = [row for row, p in enumerate(prompts) for _ in range(shared, len(p))]
        for start in range(0, len(own), self.n_batch):
            part = own[start : start + self.n_batch]
            self._decode(part)
            for i, (_, _, _, last) in enumerate(part):
                if last:
                    gen[rows_of[start + i]].append(int(self.logits(i).argmax()))
        prefilled = time.perf_counter()
        for step in range(1, max_new_tokens):
            self._decode([(gen[row][-1], len(p) + step - 1, (row,), True) for row, p in enumerate(prompts)])
            for row in everyone:
                gen[row].append(int(self.logits(row).argmax()))
        done = time.perf_counter()
        cells = shared + sum(len(p) - shared for p in prompts) + n * (max_new_tokens - 1)
        return gen, Timing(prefilled - t0, done - prefilled, shared, cells)


def cells_for(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """KV cells a generate() of these rows fills: the common prefix once, each row's own tokens."""
    shared = common_prefix(prompts)
    return shared + sum(len(p) - shared for p in prompts) + len(prompts) * max_new_tokens


def run_llama_cpp(llm, work) -> tuple[dict, list[list[int]]]:
    """bench e2e's llama_cpp system: (row, outputs) on the GGUF file of the LLM's model,
    with as many threads as chunkgen's own with every core free."""
    from chunkgen.bench.e2e import PeakRSS
    from chunkgen.engine.threads import configured_threads

    path = gguf_file(llm.config.model, llm.config.dummy_weights)
    with PeakRSS() as rss:
        with LlamaCpp(
            path, cells_for(work.prompts, work.max_new_tokens), len(work.prompts), configured_threads()
        ) as engine:
            gen, t = engine.generate(work.prompts, work.max_new_tokens)
            what = engine.describe() + f"; common prefix {t.common_tokens} tokens decoded once"
            cell_bytes = engine.cell_bytes
    wall = t.prefill_s + t.decode_s
    n_gen = sum(len(g) for g in gen)
    row = dict(
        peak_batch=len(work.prompts),
        wall_s=wall,
        prefill_s=t.prefill_s,
        decode_s=t.decode_s,
        gen_tokens_per_s=n_gen / wall,
        decode_tokens_per_s=(n_gen - len(gen)) / max(t.decode_s, 1e-9),
        kv_peak_bytes=t.kv_cells * cell_bytes,
        rss_peak_bytes=rss.peak,
        llama_cpp=what,
    )
    return row, gen
