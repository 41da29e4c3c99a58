"""Scoring fixed continuations on the prefix tree (lm-evaluation-harness's `loglikelihood`): a
context and its candidate continuations, each continuation's total logprob, token count and
whether it is the greedy one, and the likeliest; and the rolling loglikelihood of a long text.

Every continuation is a prompt `context + continuation` scored from the context's end
(`Request.score_from`) with nothing generated. The context is prefilled once: a job's first
continuation goes first and brings the context into the tree; its other continuations are queued
when it is back, so each of them copies the context's last, partly filled chunk instead of
computing it (two prompts in one wave cannot share a chunk still being written). Each of them
computes its own tokens and the context's last position again (the position that predicts its
first token); the context's earlier tokens are never computed twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from chunkgen.engine import Request, SamplingParams
from chunkgen.engine.engine import Engine


@dataclass
class ChoiceJob:
    """A context and the continuations to score after it, as token ids (the context non-empty:
    begin it with BOS, or EOS where the model has none, as lm-evaluation-harness does for an empty one)."""

    id: Any
    context: list[int]
    continuations: list[list[int]]


@dataclass
class ContinuationScore:
    logprob: float  # the sum of its tokens' logprobs given the context
    num_tokens: int
    greedy: bool  # every token is the likeliest one at its position
    token_logprobs: list[float] = field(default_factory=list)


@dataclass
class ChoiceResult:
    id: Any
    choices: list[ContinuationScore]  # in the job's order; empty when error is set
    error: str | None = None

    @property
    def best(self) -> int:
        """Index of the likeliest continuation (the first of equals); -1 on error."""
        if not self.choices:
            return -1
        return max(range(len(self.choices)), key=lambda i: (self.choices[i].logprob, -i))


_SCORE_ONLY = SamplingParams(max_new_tokens=0, prompt_logprobs=1)  # one alternative: is it greedy


def _continuation(res, start: int, tokens: list[int]) -> ContinuationScore:
    entries = res.prompt_logprobs[start:]
    lps = [e.logprob for e in entries]
    greedy = all(e.top and e.top[0].token_id == t for e, t in zip(entries, tokens))
    return ContinuationScore(sum(lps), len(tokens), greedy, lps)


def score_stream(engine: Engine, jobs: Iterable[ChoiceJob], max_jobs: int = 1024) -> Iterator[ChoiceResult]:
    """Results as each job's continuations are all scored (completion order); at most `max_jobs`
    jobs are held at once, so a file of any length runs in bounded memory."""
    source = iter(jobs)
    live: dict[int, tuple[ChoiceJob, list[ContinuationScore | None]]] = {}
    key = 0
    exhausted = False
    while True:
        new = []
        while not exhausted and len(live) < max_jobs:
            job = next(source, None)
            if job is None:
                exhausted = True
                break
            if not job.context or not job.continuations or not all(job.continuations):
                yield ChoiceResult(job.id, [], error="a context and non-empty continuations are needed")
                continue
            live[key] = (job, [None] * len(job.continuations))
            new.append(Request((key, 0), job.context + job.continuations[0], _SCORE_ONLY, len(job.context)))
            key += 1
        if new:
            engine.add(new)
        if not engine.has_work:
            if exhausted:
                return
            continue
        for res in engine.step():
            k, i = res.id
            job, scores = live[k]
            if res.error:
                del live[k]
                yield ChoiceResult(job.id, [], error=res.error)
                continue
            scores[i] = _continuation(res, len(job.context), job.continuations[i])
            if i == 0 and len(scores) > 1:  # the context is in the tree now: the other continuations
                engine.add(
                    Request((k, j), job.context + c, _SCORE_ONLY, len(job.context))
                    for j, c in enumerate(job.continuations[1:], 1)
                )
            if all(s is not None for s in scores):
                del live[k]
                yield ChoiceResult(job.id, scores)  # type: ignore[arg-type]


def rolling_windows(tokens: list[int], prefix_token: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs that score every token of `tokens` once, each with up to
    max_length tokens of input: the first window's context is `prefix_token`, each later window
    is conditioned on the tokens just before it. The windows of lm-evaluation-harness's
    `loglikelihood_rolling` (get_rolling_token_windows with context_len 1, made disjoint)."""
    if not tokens:
        return []
    out = []
    first = min(max_length, len(tokens))
    out.append(([prefix_token], tokens[:first]))
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, max_length)
        end = done + n
        window = tokens[max(0, end - max_length - 1) : end - 1]
        out.append((window[: len(window) - (n - 1)], tokens[done:end]))
        done = end
    return out
