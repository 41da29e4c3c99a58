"""The Python API (the CLI uses it too): LLM(...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Sequence

import torch

from chunkgen.engine import Engine, EngineConfig, Request, Result, SamplingParams
from chunkgen.model import LlamaModel, load_hf, parse_dtype

Prompt = str | list[dict[str, str]] | list[int]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'4GiB', '512MB', '1e9' or an int, in bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (examples: 4GiB, 512MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: chat messages go through the model's chat template when it has one."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    if prompt and isinstance(prompt[0], dict):
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer("\n\n".join(m["content"] for m in prompt))["input_ids"]
    return list(prompt)


class LLM:
    """A model on the prefix-tree engine. Sharing between prompts is found automatically."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str | torch.dtype = "fp32",
        chunk_size: int = 64,
        kv_memory: str | int = "4GiB",
        max_batch: int = 32,
        share_prefix: bool = True,
        chunk_first: bool = True,
        kv_dtype: str | torch.dtype | None = None,
        device: str = "cpu",
    ) -> None:
        if device.startswith("cuda"):
            from chunkgen._native import native_cuda_available

            if not torch.cuda.is_available() or not native_cuda_available():
                raise ValueError("--device cuda needs a CUDA GPU, a CUDA build of torch and chunkgen "
                                 "built with its CUDA kernels (CHUNKGEN_CUDA=1 at install)")
        hf_model, self.tokenizer, self.model_path = load_hf(model, parse_dtype(dtype), device)
        self.model = LlamaModel(hf_model)
        self.config = EngineConfig(
            chunk_size=chunk_size, kv_memory=parse_bytes(kv_memory), max_batch=max_batch,
            kv_dtype=parse_dtype(kv_dtype) if kv_dtype else None,
            share_prefix=share_prefix, chunk_first=chunk_first,
        )
        self.engine = self.new_engine()

    def new_engine(self, **overrides: Any) -> Engine:
        """A fresh engine (empty cache) on the same weights; overrides change EngineConfig fields."""
        cfg = EngineConfig(**{**self.config.__dict__, **overrides})
        return Engine(self.model, self.tokenizer, cfg)

    def encode(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def stream(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Results in completion order, as soon as each finishes."""
        return self.engine.stream(requests)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Result]:
        """Results in input order."""
        params = params or SamplingParams()
        per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        requests = [Request(i, self.encode(p), sp) for i, (p, sp) in enumerate(zip(prompts, per))]
        results: list[Result | None] = [None] * len(requests)
        for res in self.stream(requests):
            results[res.id] = res
        return results  # type: ignore[return-value]
