"""What an LLM decides once for all its engines: the device it resolves `auto` to, and the one KV
reservation its engines take turns on."""

from __future__ import annotations

import pytest

from chunkgen.cache import ChunkPool
from chunkgen.device import Accelerator
from chunkgen.engine import Request, SamplingParams
from chunkgen.llm import LLM
from tests.helpers import template_prompts

NO_GPU = Accelerator(cuda=False, cuda_kernels=False)
GPU_NO_KERNELS = Accelerator(cuda=True, cuda_kernels=False)


def test_the_llm_resolves_auto_with_what_the_machine_has(tiny_model, monkeypatch):
    monkeypatch.setattr("chunkgen.config.detect", lambda: GPU_NO_KERNELS)
    llm = LLM(model=str(tiny_model), dtype="fp32", chunk_size=16, kv_memory="16MiB")  # device: auto
    assert llm.device == "cpu" and "without its CUDA kernels" in llm.config.why["device"]
    monkeypatch.setattr("chunkgen.config.detect", lambda: NO_GPU)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        LLM(model=str(tiny_model), device="cuda:0", kv_memory="16MiB")


# -- one KV reservation per LLM -----------------------------------------------------------------
def _count_reservations(monkeypatch) -> list[int]:
    """Counts ChunkPools that reserve K/V storage of their own (not over another pool's)."""
    made: list[int] = []
    original = ChunkPool.__init__

    def counting(self, *args, **kwargs):
        if kwargs.get("tensors") is None and kwargs.get("storage", True):
            made.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(ChunkPool, "__init__", counting)
    return made


def _answers(engine, prompts: list[list[int]], new: int = 8) -> list[list[int]]:
    out: dict[int, list[int]] = {}
    for r in engine.stream([Request(i, p, SamplingParams(max_new_tokens=new)) for i, p in enumerate(prompts)]):
        out[r.id] = r.token_ids
    return [out[i] for i in range(len(prompts))]


def test_engines_of_one_llm_take_turns_on_one_reservation(tiny_model, monkeypatch):
    made = _count_reservations(monkeypatch)
    llm = LLM(model=str(tiny_model), dtype="fp32", chunk_size=16, kv_memory="64MiB", max_batch=8)
    assert len(made) == 1
    a, b = llm.new_engine(), llm.new_engine(kv_memory=16 << 20)  # smaller: fits the reservation
    assert len(made) == 1
    assert a.pool.k.data_ptr() == b.pool.k.data_ptr() == llm.engine.pool.k.data_ptr()
    assert b.pool.max_slots < a.pool.max_slots and b.pool.scratch_slot == b.pool.max_slots
    prompts = [llm.encode(p) for p in template_prompts("tool_dispatcher", 6)]
    first = _answers(a, prompts)
    # b overwrites the storage a's cached prefixes were in; a, given requests again, starts afresh
    # (reading its old cache would give other answers)
    _answers(b, [llm.encode(p) for p in template_prompts("document_qa", 6)])
    assert a.tree.cached_chunks > 0 and b.tree.cached_chunks > 0
    assert _answers(a, prompts) == first
    assert a.stats.prompt_tokens == 2 * sum(map(len, prompts))
    assert len(made) == 1
    # A larger budget than the reservation's gets a pool of its own.
    big = llm.new_engine(kv_memory=128 << 20)
    assert len(made) == 2 and big.pool.k.data_ptr() != a.pool.k.data_ptr()


def test_an_engine_with_requests_keeps_the_reservation(tiny_llm):
    a, b = tiny_llm.new_engine(), tiny_llm.new_engine()
    prompt = tiny_llm.encode("Hello there")
    a.add([Request(0, prompt, SamplingParams(max_new_tokens=4))])
    with pytest.raises(RuntimeError, match="still has requests"):
        b.add([Request(1, prompt, SamplingParams(max_new_tokens=4))])
    assert len(list(a.stream())) == 1
    b.add([Request(1, prompt, SamplingParams(max_new_tokens=4))])  # a is done: b takes over
    assert [r.id for r in b.stream()] == [1]
