"""Where a decode step's and a prefill wave's time goes: attention (the decode kernel's parts:
chunk-first, sequence-first, merge, and the op around them), linear layers, the model's other
torch ops, and the engine around the model (tree, kernel context, sampling, Python); with the
FLOP rates of the products, to set against the machine's FMA peak (`bench machine`)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from chunkgen._native import native, native_cpu_available
from chunkgen.engine import Request, SamplingParams
from chunkgen.kernels import decode_step_attention as real_attention
from chunkgen.llm import LLM
from chunkgen.model import llama, quant


@dataclass
class _Split:
    """Seconds and FLOPs gathered while a phase runs."""

    seconds: dict[str, float] = field(default_factory=lambda: {"attention": 0.0, "linear": 0.0, "model": 0.0})
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # the calling thread's CPU time
    linear_flop: float = 0.0
    attention_flop: float = 0.0


def _timed(owner, name: str, split: _Split, key: str, flop=None):
    """Wrap owner.name to add its wall time to split.seconds[key] (and flop(*args, **kwargs) of
    each call to split's FLOP counts)."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            split.seconds[key] += time.perf_counter() - t0
            split.cpu_seconds[key] = split.cpu_seconds.get(key, 0.0) + time.thread_time() - c0
            if flop is not None:
                flop(split, *args, **kwargs)

    return owner, name, original, wrapper


@contextlib.contextmanager
def _patched(*patches):
    for owner, name, _, wrapper in patches:
        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        for owner, name, original, _ in patches:
            setattr(owner, name, original)


def _linear_flop(split: _Split, linear: llama.Linear, x: torch.Tensor) -> None:
    split.linear_flop += 2.0 * x.shape[0] * linear.out_features * linear.in_features


def _quant_flop(split: _Split, linear: quant.QuantLinear, x: torch.Tensor) -> None:
    split.linear_flop += 2.0 * x.shape[0] * linear.out_features * linear.weights[0].k


def _prefill_attention_flop(split: _Split, groups, layer, q, *args, window: int = 0, **kwargs) -> None:
    # Every new token attends to each key up to its own position (inside its window, if any):
    # 4 x head_dim FLOPs a key and query head (q.k and p.v).
    seen = lambda g: (g.positions + 1).clamp(max=window) if window else g.positions + 1  # noqa: E731
    keys = sum(float(seen(g).sum()) for g in groups)
    split.attention_flop += 4.0 * q.shape[-1] * q.shape[1] * keys


def _decode_clock(reset: bool = False) -> dict | None:
    return native().decode_clock(reset) if native_cpu_available() else None


def _kernel_parts(clock: dict | None, steps: int) -> dict:
    """The CPU decode kernel's parts, ms a step, and its phases' FLOPs a step."""
    if not clock or not clock["calls"]:
        return {}
    ms = lambda s: 1e3 * s / steps  # noqa: E731
    return {
        "kernel_plan_ms": ms(clock["plan_s"]),
        "chunk_first_ms": ms(clock["chunk_first_s"]),
        "seq_first_ms": ms(clock["seq_first_s"]),
        "merge_ms": ms(clock["merge_s"]),
        "chunk_first_gflop": clock["chunk_first_flop"] / steps / 1e9,
        "seq_first_gflop": clock["seq_first_flop"] / steps / 1e9,
    }


def profile_steps(llm: LLM, prompts: list[list[int]], steps: int = 30) -> dict:
    """The split of the prefill of `prompts` (every wave until all are admitted; `prefill_*`, in
    seconds) and of the decode steps after it (ms a step, the mean of `steps`)."""
    engine = llm.new_engine(max_batch=len(prompts), mixed_prefill_tokens=0)  # waves apart, then whole-batch steps
    params = SamplingParams(max_new_tokens=steps + 2, ignore_eos=True)
    engine.add([Request(i, p, params) for i, p in enumerate(prompts)])
    model = type(llm.model)
    prefill = _Split()
    with _patched(
        _timed(llama, "prefill_attention", prefill, "attention", _prefill_attention_flop),
        _timed(llama.Linear, "__call__", prefill, "linear", _linear_flop),
        _timed(quant.QuantLinear, "__call__", prefill, "linear", _quant_flop),
        _timed(model, "prefill", prefill, "model"),
    ):
        t0 = time.perf_counter()
        waves = 0
        while engine.num_waiting:  # admission and prefill waves
            engine.step()
            waves += 1
        prefill_wall = time.perf_counter() - t0
    decode = _Split()
    _decode_clock(reset=True)
    with _patched(
        _timed(llama, "decode_step_attention", decode, "attention"),
        _timed(llama.Linear, "__call__", decode, "linear", _linear_flop),
        _timed(quant.QuantLinear, "__call__", decode, "linear", _quant_flop),
        _timed(model, "decode", decode, "model"),
    ):
        t0, c0 = time.perf_counter(), time.thread_time()
        done, threads = 0, set()
        while engine.has_work and done < steps:
            engine.step()
            threads.add(torch.get_num_threads())  # the step's, as the thread governor set it first
            done += 1
        total, total_cpu = time.perf_counter() - t0, time.thread_time() - c0
    ms = lambda s: 1e3 * s / done  # noqa: E731
    sec = decode.seconds
    pre = prefill.seconds
    kernel = _kernel_parts(_decode_clock(), done)
    if kernel:  # the sequence-first phase streams each row's own K/V: its bytes a step
        m = llm.model
        keys = kernel["seq_first_gflop"] * 1e9 / (4 * m.head_dim * m.q_heads)
        kernel["seq_first_gb"] = keys * 2 * m.kv_heads * m.head_dim * engine.pool.k.element_size() / 1e9
    return {
        "batch": len(prompts),
        "steps": done,
        "threads": sorted(threads),
        "step_ms": ms(total),
        "attention_ms": ms(sec["attention"]),
        "linear_ms": ms(sec["linear"]),
        "other_model_ms": ms(sec["model"] - sec["attention"] - sec["linear"]),
        "engine_ms": ms(total - sec["model"]),
        # The engine's own CPU time (its thread's, the model's calls left out): on a GPU the wall
        # time above also holds the waits for the device (the sampled tokens' read); this is the
        # host work alone, what a step adds to its kernels' time.
        "engine_cpu_ms": ms(total_cpu - decode.cpu_seconds.get("model", 0.0)),
        "linear_gflop": decode.linear_flop / done / 1e9,
        **kernel,
        "prefill_steps": waves,
        "prefill_s": prefill_wall,
        "prefill_attention_s": pre["attention"],
        "prefill_linear_s": pre["linear"],
        "prefill_other_model_s": pre["model"] - pre["attention"] - pre["linear"],
        "prefill_engine_s": prefill_wall - pre["model"],
        "prefill_attention_gflop": prefill.attention_flop / 1e9,
        "prefill_linear_gflop": prefill.linear_flop / 1e9,
    }


# -- the host's share of a decode step: what a GPU would wait for ------------------------------
def _decode_ready(engine, prompts: list[list[int]], steps: int) -> None:
    """Admit and prefill every prompt, then run one decode step (warm-up)."""
    params = SamplingParams(max_new_tokens=steps + 4, ignore_eos=True)
    engine.add([Request(i, p, params) for i, p in enumerate(prompts)])
    while engine.num_waiting:
        engine.step()
    engine.step()


def ops_per_step(llm: LLM, prompts: list[list[int]]) -> int:
    """Dispatcher ops (every op the profiler records, nested ones included) in one decode step."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.new_engine(max_batch=len(prompts), mixed_prefill_tokens=0)  # waves apart, then whole-batch steps
    _decode_ready(engine, prompts, 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    return sum(1 for e in prof.events() if "::" in e.name)


def host_floor_engine(tokenizer, layers: int = 30, hidden: int = 64, vocab: int = 2048, max_batch: int = 256):
    """An engine over a random model whose arithmetic is negligible (hidden 64, vocab 2,048): its
    step time is the host's work per step (Python, dispatch, bookkeeping), which a GPU cannot hide."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from chunkgen.config import Config
    from chunkgen.engine.engine import Engine
    from chunkgen.model.llama import LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    model = LlamaModel(LlamaForCausalLM(cfg).eval())
    return Engine(
        model, tokenizer, Config(chunk_size=64, kv_memory=1 << 30, max_batch=max_batch, mixed_prefill_tokens=0)
    )


class _AttentionDispatchOnly:
    """Stands in for the model's attention call: the op is still dispatched, with every argument
    check the binding makes, but over no rows, so none of its arithmetic (nor its K/V write) runs.
    That arithmetic is the device's on a GPU; on the CPU, at batch 256 with 16-wide heads, its
    memory traffic would outweigh all the host work the figure is about."""

    def __init__(self) -> None:
        self._cached: tuple = (None, None)

    def __call__(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        layer,
        arrays,
        workspace,
        out,
        scale,
        chunk_first,
        window: int = 0,
        softcap: float = 0.0,
        store_kv: bool = True,
    ) -> None:
        if self._cached[0] is not arrays:  # one step's layers share the arrays: slice them once
            none = arrays.write_slot[:0]
            self._cached = (
                arrays,
                arrays._replace(
                    write_slot=none,
                    write_offset=none,
                    seq_shared_ptr=arrays.seq_shared_ptr[:1],
                    priv_slot=arrays.priv_slot[:0],
                    priv_count=none,
                    priv_last_len=none,
                ),
            )
        real_attention(
            q[:0],
            k[:0],
            v[:0],
            k_cache,
            v_cache,
            layer,
            self._cached[1],
            workspace,
            out[:0],
            scale,
            chunk_first,
            window=window,
            softcap=softcap,
            store_kv=store_kv,
        )


def host_floor_ms(engine, batch: int, steps: int = 20, prompt: int = 8, attention: bool = False) -> float:
    """Median CPU time (one thread, so the figure is work, not waiting) of the decode forward at
    `batch`: the model runner's step (fill the buffers, upload, forward), without the engine's
    scheduling and sampling around it. attention=False dispatches the attention op over no rows
    (see _AttentionDispatchOnly); True runs the CPU kernel too."""
    from chunkgen.engine.runner import ModelRunner

    # Short prompts: the attention arithmetic stays negligible too, as the other arithmetic does.
    vocab = engine.runner.model.vocab_size
    prompts = [[(5 + t) % vocab for t in range(prompt)] + [(1500 + i % 500) % vocab, 7] for i in range(batch)]
    times: list[float] = []
    original = ModelRunner.decode

    def timed(self, *args, **kwargs):
        t0 = time.thread_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            times.append(time.thread_time() - t0)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _decode_ready(engine, prompts, steps)
        ModelRunner.decode = timed
        if not attention:
            llama.decode_step_attention = _AttentionDispatchOnly()
        for _ in range(steps):
            engine.step()
    finally:
        ModelRunner.decode = original
        llama.decode_step_attention = real_attention
        torch.set_num_threads(threads)
    while engine.has_work:  # let the batch finish so the engine can be reused
        engine.step()
    return 1e3 * sorted(times)[len(times) // 2]


def graph_breaks(llm: LLM, prompts: list[list[int]]) -> int:
    """Graph breaks torch.compile meets in the decode forward (torch._dynamo.explain, CPU)."""
    engine = llm.new_engine(max_batch=len(prompts), mixed_prefill_tokens=0)  # waves apart, then whole-batch steps
    _decode_ready(engine, prompts, 2)
    r = engine.runner
    explained = torch._dynamo.explain(llm.model.decode)(
        r.ctx.arrays(), r.pool.k, r.pool.v, r.workspace(), r.chunk_first
    )
    return explained.graph_break_count
