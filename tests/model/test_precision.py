"""--dtype auto: bf16 only where the CPU has native bf16 arithmetic, the model's own dtype on a GPU."""

from __future__ import annotations

import pytest
import torch

from chunkgen.model import precision
from chunkgen.model.precision import choose_dtype

AVX2_ONLY = {"avx2": True, "fma3": True, "avx512_f": False, "avx512_bf16": False, "amx_bf16": False, "amx_tile": False}


def with_capabilities(monkeypatch, caps: dict) -> None:
    monkeypatch.setattr(precision.torch.cpu, "get_capabilities", lambda: caps)


def test_auto_is_fp32_on_a_cpu_without_native_bf16(monkeypatch):
    with_capabilities(monkeypatch, AVX2_ONLY)
    choice = choose_dtype("auto", "cpu")
    assert choice.dtype == torch.float32 and "no native bf16" in choice.reason


@pytest.mark.parametrize("flag, name", [("avx512_bf16", "AVX512_BF16"), ("amx_bf16", "AMX")])
def test_auto_is_bf16_where_the_cpu_computes_in_it(monkeypatch, flag, name):
    with_capabilities(monkeypatch, {**AVX2_ONLY, "avx512_f": True, flag: True})
    choice = choose_dtype("AUTO", "cpu")
    assert choice.dtype == torch.bfloat16 and name in choice.reason


def test_auto_keeps_the_models_dtype_on_a_gpu_and_names_are_taken_as_given(monkeypatch):
    with_capabilities(monkeypatch, AVX2_ONLY)
    assert choose_dtype("auto", "cuda:0").dtype is None
    assert choose_dtype("bf16", "cpu").dtype == torch.bfloat16  # asked for: no second guessing
    assert choose_dtype(torch.float16, "cuda").dtype == torch.float16
    with pytest.raises(ValueError, match="fp8"):
        choose_dtype("fp8", "cpu")


def test_the_llm_says_what_it_chose(tiny_model):
    from chunkgen.llm import LLM

    llm = LLM(model=str(tiny_model), dtype="auto", device="cpu", chunk_size=16, kv_memory="16MiB")
    assert llm.model.dtype == choose_dtype("auto", "cpu").dtype
    assert llm.config.why["dtype"].startswith("auto: ")
