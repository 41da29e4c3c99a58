"""Sampling parameters and the next-token choice for a batch of logits."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def make_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """One generator per sample: its draws depend only on its own seed, never on the batch."""
    if params.greedy:
        return None
    g = torch.Generator()
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed + index)
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Next token per row of `logits` [batch, vocab] (fp32)."""
    out = logits.argmax(dim=-1).tolist()
    if not all(p.greedy for p in params):
        logits = logits.float().cpu()  # per-request CPU generators: draws independent of the device
    for row, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        scores = logits[row] / p.temperature
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = scores.softmax(-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out[row] = int(torch.multinomial(probs, 1, generator=g))
    return out
