"""The Python API (the CLI uses it too): LLM(...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from chunkgen.cache import ChunkPool, KVReservation, kv_shape
from chunkgen.cache.pages import keep_freed_pages, release_freed_pages
from chunkgen.config import Config
from chunkgen.device import device_guard, free_bytes
from chunkgen.engine import Engine, Request, Result, SamplingParams
from chunkgen.model import LlamaModel, load_hf, resolve_model
from chunkgen.model.llama import float_linears
from chunkgen.model.quant import describe, is_direct, quantized_linears, weight_source
from chunkgen.prompt import Layout, Prompt, check_chat_template, encode_prompt
from chunkgen.scoring import ChoiceJob, ChoiceResult, ContinuationScore, rolling_windows, score_stream

__all__ = ["LLM", "Prompt", "check_chat_template", "encode_prompt"]


class LLM:
    """A model on the prefix-tree engine. Sharing between prompts is found automatically.

    Options are those of `Config.resolve` (or a resolved `config`): device "auto" is the GPU when
    torch sees one and chunkgen's CUDA kernels are built, else the CPU; dtype "auto" is bf16 on a CPU
    with native bf16 arithmetic, fp32 on other CPUs, the model's own on a GPU; kv_memory "auto" is 85%
    of the GPU memory left free by the weights, or 4 GiB on the CPU; max_batch "auto" runs as many
    sequences together as the KV budget holds, at most 256. `config` holds what was chosen and
    `config.why` why. chat_template=False joins chat messages with blank lines as plain text instead
    of using the model's chat template.

    dummy_weights: a shipped config name (smollm2-135m, llama-3.2-1b, llama-2-7b, llama-3.1-8b,
    qwen3-0.6b, qwen3-4b, gemma-3-1b, phi-3-mini) or the path of a Hugging Face config.json, instead of `model`: random weights
    drawn from `seed` (benchmarks). tokenizer: the model's tokenizer, already loaded from its folder
    (load_tokenizer), to use instead of loading it again."""

    def __init__(
        self, model: str | None = None, *, config: Config | None = None, tokenizer: Any = None, **options: Any
    ) -> None:
        if config is None:
            config = Config.resolve(model, **options)  # every bad value fails here, before the weights load
        elif model is not None or options:
            raise TypeError("give a resolved config or options, not both")
        dev = config.device
        self._kv: KVReservation | None = None
        with device_guard(dev):
            # Weights held once (model/skeleton.py): a quantized source's products are never made in
            # floats, and each float product keeps only the layouts its forward reads.
            floats = float_linears(held_once=True, invariant=config.batch_invariant)
            if config.dummy_weights is None:
                path = resolve_model(config.model)
                self._reserve_early(config, path)
                source = self._source(config, path)
                hf_model, self.tokenizer, self.model_path = load_hf(
                    path,
                    config.dtype or "auto",
                    dev,
                    skeleton_of=source if is_direct(source) else None,
                    tokenizer=tokenizer,
                )
                if not config.chat_template:  # messages as plain text, joined by blank lines (encode_prompt)
                    self.tokenizer.chat_template = None
                check_chat_template(self.tokenizer, str(self.model_path))
                own_dtype = "auto: the model's own dtype on a GPU"
            else:
                hf_model, self.tokenizer, source = self._random_weights(config, dev)
                self.model_path = None
                own_dtype = "auto: the config's dtype on a GPU"
            make = None if source is None else quantized_linears(hf_model, source, floats)
            self.model = LlamaModel(hf_model, make or floats)
            self.quantized = describe(make)  # what runs on quantized weights, for the load line
            del hf_model  # the weights LlamaModel did not take (fused q/k/v, gate/up) are freed here
            if dev == "cpu":
                keep_freed_pages()  # after the load: its temporaries go back to the OS
                # and those malloc kept from it, scattered in its heap (about 0.1 GiB of a 7B
                # model's repacking), before the first wave's activations would settle on them
                release_freed_pages()
            free = free_bytes(dev) if dev.startswith("cuda") else None
            self.config = config.loaded(
                self.model.dtype, free, dtype_reason=own_dtype if config.dtype is None else None
            )
        kv = self._kv
        if kv is not None and (
            kv.shape != (self.model.num_layers, self.model.kv_heads, self.model.head_dim)
            or not kv.fits(self.config.chunk_size, self.config.kv_dtype, self.config.kv_memory)
        ):
            self._kv = None  # reserved before the weights for a shape or K/V dtype the model did not keep
        self.engine = self.new_engine()

    def _reserve_early(self, config: Config, path) -> None:
        """On the CPU, reserve the K/V memory before the weights load, so that the pool's first
        pages are backed in the background while they do (ChunkPool: a fresh process's first wave
        would otherwise pay for each page it writes). Everything the pool needs is known by then
        but the model's K/V shape, which its config gives."""
        if config.device != "cpu" or config.kv_dtype is None or config.kv_memory is None:
            return
        try:
            from chunkgen.model.loading import model_config

            shape = kv_shape(model_config(path))
        except Exception:  # load_hf says what is wrong with the model, in its words
            return
        self._kv = KVReservation(ChunkPool.for_run(shape, config))

    @staticmethod
    def _source(config: Config, path):
        """Where --quantize takes the linear weights from (quant.weight_source), or None."""
        if config.quantize == "none" or config.device != "cpu":
            return None
        from chunkgen.model.loading import model_config

        return weight_source(config.quantize, config.device, path, model_config(path), config.seed)

    @staticmethod
    def _random_weights(cfg: Config, device: str):
        """(transformers model, tokenizer, quantized source or None) of --dummy-weights: a quantized
        type's products drawn as blocks, never in floats (model/skeleton.py)."""
        from chunkgen.model import dummy, skeleton

        config = dummy.load_config(cfg.dummy_weights)
        dtype = cfg.dtype or dummy.config_dtype(config)
        source = weight_source(cfg.quantize, device, None, config, cfg.seed)
        direct = is_direct(source)
        dummy.check_fits(config, dtype, device, free_bytes(device), quantized=direct, invariant=cfg.batch_invariant)
        if direct:
            model = skeleton.random(config, dtype, source, cfg.seed)
        else:
            model = dummy.random_model(config, dtype, device, cfg.seed)
        return model, dummy.tokenizer_for(config), source

    @property
    def device(self) -> str:
        return self.config.device

    def new_engine(self, **options: Any) -> Engine:
        """A fresh engine (empty cache) on the same weights; options asked anew as in
        `Config.replace` (max_batch="auto", kv_memory="2GiB", ...).

        The engines of one LLM take turns on one KV reservation (its budget is reserved once):
        an engine given requests takes the memory over from the one that used it last, which
        must have finished its requests and loses its cached prefixes. An engine asking for a
        larger budget, another chunk size or K/V dtype gets a pool of its own."""
        cfg = self.config.replace(**options)
        if self._kv is None:
            with device_guard(self.device):
                self._kv = KVReservation(
                    ChunkPool.for_run(
                        (self.model.num_layers, self.model.kv_heads, self.model.head_dim),
                        self.config,
                        self.model.device,
                    )
                )
        shared = self._kv if self._kv.fits(cfg.chunk_size, cfg.kv_dtype, cfg.kv_memory) else None
        return Engine(self.model, self.tokenizer, cfg, kv=shared)

    def encode(self, prompt: Prompt, data: Sequence[str] = (), layout: Layout | None = None) -> list[int]:
        """Token ids of a prompt (see prompt.encode_prompt), no further than the context + 1."""
        return encode_prompt(self.tokenizer, prompt, data, layout, max_tokens=self.model.max_context)

    def stream(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Results in completion order, as soon as each finishes."""
        return self.engine.stream(requests)

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool | None = None,
    ) -> list[Result]:
        """Results in input order. `progress`: a bar on stderr (rows, prefill until the first
        answers, recent tok/s, time left); None shows it when stderr is a terminal, False never."""
        from chunkgen.progress import GenerateBar, Snapshot

        params = params or SamplingParams()
        per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        requests = [Request(i, self.encode(p), sp) for i, (p, sp) in enumerate(zip(prompts, per))]
        results: list[Result | None] = [None] * len(requests)
        engine = self.engine
        bar = GenerateBar(len(requests), enabled=progress)
        done = 0
        try:
            engine.add(requests)
            while engine.has_work:
                for res in engine.step():
                    results[res.id] = res
                    done += 1
                s = engine.stats
                bar.update(
                    Snapshot(
                        done,
                        len(requests),
                        s.generated_tokens,
                        s.prompt_tokens,
                        s.queued_prompt_tokens,
                        engine.num_running,
                    )
                )
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    # -- scoring (chunkgen/scoring.py) ----------------------------------------------------------
    def score(
        self, contexts: Sequence[str | list[int]], continuations: Sequence[Sequence[str | list[int]]]
    ) -> list[ChoiceResult]:
        """Each context's continuations scored (lm-evaluation-harness's loglikelihood), in input
        order: per continuation its total logprob, token count and whether it is greedy; `best`
        is the likeliest. A context is prefilled once for all its continuations. Text is split as
        lm-evaluation-harness splits it: the context encoded alone (with BOS where the tokenizer
        adds one), the continuation as the tokens that encoding context + continuation adds."""
        jobs = []
        for i, (ctx, conts) in enumerate(zip(contexts, continuations, strict=True)):
            pairs = [encode_pair(self.tokenizer, ctx, c) for c in conts]
            context = pairs[0][0] if pairs else []
            if any(p[0] != context for p in pairs):  # a trailing space moved: each pair on its own
                jobs += [ChoiceJob((i, j), p[0], [p[1]]) for j, p in enumerate(pairs)]
            else:
                jobs.append(ChoiceJob(i, context, [p[1] for p in pairs]))
        return [_joined(i, p) for i, p in enumerate(_gathered(score_stream(self.engine, jobs), len(contexts)))]

    def score_rolling(self, texts: Sequence[str | list[int]], max_length: int | None = None) -> list[ChoiceResult]:
        """The loglikelihood of each whole text (perplexity: exp(-logprob / num_tokens)), scored
        in windows of at most max_length tokens (default: the model's context), each conditioned
        on the text just before it: one ChoiceResult per text with one ContinuationScore."""
        max_length = max_length or self.model.max_context
        prefix = prefix_token(self.tokenizer)
        jobs = []
        for i, text in enumerate(texts):
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if isinstance(text, str) else list(text)
            windows = rolling_windows(ids, prefix, max_length)
            jobs += [ChoiceJob((i, j), ctx, [cont]) for j, (ctx, cont) in enumerate(windows)]
        return [_summed(i, p) for i, p in enumerate(_gathered(score_stream(self.engine, jobs), len(texts)))]


def prefix_token(tokenizer) -> int:
    """What stands before a text scored from its first token: BOS, else EOS (as lm-evaluation-harness's hf backend)."""
    for t in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if t is not None:
            return t
    raise ValueError("the tokenizer has neither an EOS nor a BOS token to score a text's first token after")


def encode_pair(tokenizer, context: str | list[int], continuation: str | list[int]) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids), split as lm-evaluation-harness's HF backend splits them:
    trailing spaces of the context go with the continuation; the continuation's ids are what
    encoding context + continuation adds after the context's own encoding; an empty context is
    the prefix token (BOS, else EOS)."""
    if isinstance(context, str) and not context:
        cont = (
            tokenizer(continuation, add_special_tokens=False)["input_ids"]
            if isinstance(continuation, str)
            else list(continuation)
        )
        return [prefix_token(tokenizer)], cont
    if not isinstance(context, str) or not isinstance(continuation, str):
        ctx = tokenizer(context)["input_ids"] if isinstance(context, str) else list(context)
        cont = (
            tokenizer(continuation, add_special_tokens=False)["input_ids"]
            if isinstance(continuation, str)
            else list(continuation)
        )
        return ctx, cont
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tokenizer(context + continuation)["input_ids"]
    ctx = tokenizer(context)["input_ids"]
    return ctx, whole[len(ctx) :]


def _gathered(results: Iterable[ChoiceResult], n: int) -> list[list[ChoiceResult]]:
    """Results of jobs keyed i or (i, j), gathered per input i in j order."""
    parts: list[list[tuple[int, ChoiceResult]]] = [[] for _ in range(n)]
    for r in results:
        i, j = r.id if isinstance(r.id, tuple) else (r.id, 0)
        parts[i].append((j, r))
    return [[r for _, r in sorted(got, key=lambda t: t[0])] for got in parts]


def _joined(i: int, parts: list[ChoiceResult]) -> ChoiceResult:
    failed = next((r for r in parts if r.error), None)
    if failed is not None:
        return ChoiceResult(i, [], error=failed.error)
    return ChoiceResult(i, [c for r in parts for c in r.choices])


def _summed(i: int, parts: list[ChoiceResult]) -> ChoiceResult:
    """The windows of one text as one score."""
    joined = _joined(i, parts)
    if joined.error or not joined.choices:
        return joined
    lps = [lp for c in joined.choices for lp in c.token_logprobs]
    return ChoiceResult(i, [ContinuationScore(sum(lps), len(lps), all(c.greedy for c in joined.choices), lps)])
