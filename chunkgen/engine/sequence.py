"""What the engine is asked (Request), what it tracks (Sequence) and what it returns (Result)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from chunkgen.engine.detokenize import IncrementalDetokenizer
from chunkgen.engine.logits import TokenLogprob
from chunkgen.engine.params import SamplingParams


@dataclass
class Request:
    id: Any
    prompt_tokens: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # With params.prompt_logprobs: the first prompt position scored (1: every token but the first,
    # as vLLM; a continuation scored after its context starts at the context's length).
    score_from: int = 1
    # With params.prompt_logprobs: token ids whose logprobs at position score_from - 1 are wanted too
    # (the first tokens of a context's other continuations): Result.alternative_logprobs.
    score_alternatives: tuple[int, ...] = ()


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked for
    matched: bool | None = None  # constrained requests: the whole text satisfies the constraint


@dataclass
class Result:
    id: Any
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose K/V were already in the cache when it was admitted
    completions: list[Completion]  # empty when error is set
    error: str | None = None  # why the request could not run (prompt too long for the model or the KV budget)
    error_field: str | None = None  # "constraint" when its constraint could not be compiled, else the prompt
    # With params.prompt_logprobs: one entry per prompt token, None before the request's score_from.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_texts: list[str] | None = None  # each prompt token decoded alone, with prompt_logprobs
    # With score_alternatives: their logprobs, in order; None when that position's entry came from
    # the tree instead of being computed (the alternatives are then not known).
    alternative_logprobs: list[float] | None = None

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    @property
    def text(self) -> str:
        return self.completions[0].text if self.completions else ""

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids if self.completions else []

    @property
    def finish_reason(self) -> str:
        return self.completions[0].finish_reason if self.completions else "error"

    @property
    def constrained(self) -> int:
        """Completions made under a constraint (a JSON schema, regex or grammar)."""
        return sum(c.matched is not None for c in self.completions)

    @property
    def matched(self) -> int:
        """Completions that satisfy their constraint (the others were cut short by max_new_tokens
        or a stop string)."""
        return sum(bool(c.matched) for c in self.completions)


class Sequence:
    """One sample of one request as it moves through the engine."""

    _next_id = 0

    def __init__(self, request: Request, index: int, generator: torch.Generator | None) -> None:
        self.seq_id = Sequence._next_id
        Sequence._next_id += 1
        self.request = request
        self.index = index
        self.generator = generator
        self.tokens: list[int] = list(request.prompt_tokens)  # prompt + generated so far
        self.num_prompt = len(request.prompt_tokens)
        self.cached_tokens: int | None = None  # set at first admission
        self.preempted = False  # re-admitted sequences recompute K/V and sample nothing at prefill
        self.finish_reason: str | None = None  # "error" when it could not run at all (see error)
        self.error: str | None = None
        self.error_field: str | None = None  # as Result.error_field
        self.text = ""
        self.detok: IncrementalDetokenizer | None = None  # only with stop strings: finds them as text grows
        self.matcher: Any = None  # an llguidance LLMatcher for constrained requests (engine/constraint.py)
        self.matched: bool | None = None  # set when a constrained sequence finishes
        self.logprobs: list[TokenLogprob] | None = [] if request.params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # set at its first prefill when asked
        self.prompt_token_texts: list[str] | None = None
        self.alternative_logprobs: list[float] | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    def completion(self) -> Completion:
        return Completion(self.text, self.output, self.finish_reason or "length", self.logprobs, self.matched)
