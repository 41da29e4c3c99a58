"""The model's forward (model/llama.py) under choices that must not change a row's numbers."""

from __future__ import annotations

import pytest

from chunkgen.engine import SamplingParams
from chunkgen.llm import LLM
from chunkgen.model import llama


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_waves_mlp_in_row_slices_gives_the_same_bits(tiny_model, monkeypatch, dtype):
    """A large CPU prefill wave runs its MLP a slice of rows at a time (memory): the prompt's
    logprobs and the answers are bit-identical to the wave's MLP run whole."""
    try:
        llm = LLM(model=str(tiny_model), dtype=dtype, chunk_size=16, kv_memory="64MiB")
    except Exception as e:  # bf16 needs a CPU with a bf16 path
        pytest.skip(str(e))
    prompts = [" ".join(f"item {i} of {n}" for i in range(n)) for n in (30, 45, 12)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)

    def answers():
        out = llm.generate(prompts, params, progress=False)
        return [(r.completions[0].token_ids, r.completions[0].logprobs, r.prompt_logprobs) for r in out]

    whole = answers()
    monkeypatch.setattr(llama, "_MLP_SLICE_ROWS", 7)  # slices of 7 rows, and a last one shorter
    llm.engine = llm.new_engine()
    assert answers() == whole
