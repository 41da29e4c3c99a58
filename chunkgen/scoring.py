"""Scoring fixed continuations on the prefix tree (lm-evaluation-harness's `loglikelihood`): a
context and its candidate continuations, each continuation's total logprob, token count and
whether it is the greedy one, and the likeliest; and the rolling loglikelihood of a long text.

Every continuation is a prompt `context + continuation` scored from the context's end
(`Request.score_from`) with nothing generated. The context is prefilled once: a job's first
continuation goes first and brings the context into the tree, and the context's last position,
which predicts every continuation's first token, scores the others' first tokens too
(`Request.score_alternatives`). A one-token continuation (an MMLU letter) is then done: a question
with four one-letter choices is one prompt, and questions run together in one wave. A longer one
is queued when the first is back and computes only its own tokens after the first (its prompt
copies the context's last, partly filled chunk: two prompts in one wave cannot share a chunk still
being written). The context's tokens are never computed twice. Where the context's last entry came
from the tree (the same context and first continuation scored before), the alternatives are not
known and each continuation computes its own first token's position again, as a prompt scored
from the context's end.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from chunkgen.engine import Request, Result
from chunkgen.engine.engine import Engine
from chunkgen.engine.params import SCORE_ONLY


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
        return best_index(self.choices)


def best_index(scores: list[ContinuationScore]) -> int:
    """Index of the likeliest continuation (the first of equals); -1 for none."""
    if not scores:
        return -1
    return max(range(len(scores)), key=lambda i: (scores[i].logprob, -i))


def _continuation(res, start: int, tokens: list[int]) -> ContinuationScore:
    entries = res.prompt_logprobs[start:]
    lps = [e.logprob for e in entries]
    greedy = all(e.top and e.top[0].token_id == t for e, t in zip(entries, tokens))
    return ContinuationScore(sum(lps), len(tokens), greedy, lps)


class ChoiceScorer:
    """Choice jobs through an engine beside any other requests: `start` gives a job's first
    continuation; each result handed to `finished` gives the requests to add next and, once the
    job's continuations are all scored, its scores. Engine request ids are (CHOICE, key, index)."""

    def __init__(self) -> None:
        self.live: dict[Any, tuple[list[int], list[list[int]], list[ContinuationScore | None]]] = {}
        # (key, index) -> the first token's (logprob, greedy) of a continuation queued for its rest
        self.heads: dict[tuple[Any, int], tuple[float, bool]] = {}

    @staticmethod
    def owns(request_id: Any) -> bool:
        return isinstance(request_id, tuple) and len(request_id) == 3 and request_id[0] is CHOICE

    def start(self, key: Any, context: list[int], continuations: list[list[int]]) -> Request:
        self.live[key] = (context, continuations, [None] * len(continuations))
        others = tuple(c[0] for c in continuations[1:])
        return Request((CHOICE, key, 0), context + continuations[0], SCORE_ONLY, len(context), others)

    def finished(self, res: Result) -> tuple[list[Request], Any, list[ContinuationScore] | str | None]:
        """(requests to add, the job's key, its scores when all are in, or its error, else None)."""
        _, key, i = res.id
        head = self.heads.pop((key, i), None)
        if key not in self.live:  # a continuation of a job that failed already
            return [], key, None
        context, continuations, scores = self.live[key]
        if res.error:
            self._drop(key)  # its other continuations, if queued, are dropped as they come back
            return [], key, res.error
        if head is None:
            scores[i] = _continuation(res, len(context), continuations[i])
        else:  # scored after its first token, whose logprob came with the first continuation
            rest = _continuation(res, len(context) + 1, continuations[i][1:])
            lps = [head[0], *rest.token_logprobs]
            scores[i] = ContinuationScore(sum(lps), len(lps), head[1] and rest.greedy, lps)
        follow = []
        if i == 0 and len(scores) > 1:
            follow = self._others(key, context, continuations, scores, res)
        if all(s is not None for s in scores):
            del self.live[key]
            return follow, key, scores  # type: ignore[return-value]
        return follow, key, None

    def _others(self, key, context, continuations, scores, res: Result) -> list[Request]:
        """The context is in the tree now: the continuations after the first, done at once where one
        token long and their first token scored already, else as prompts of their own."""
        first = res.prompt_logprobs[len(context)] if res.prompt_logprobs else None
        alts = res.alternative_logprobs
        follow = []
        for j, c in enumerate(continuations[1:], 1):
            if alts is None or first is None:
                follow.append(Request((CHOICE, key, j), context + c, SCORE_ONLY, len(context)))
                continue
            lp, greedy = alts[j - 1], bool(first.top) and first.top[0].token_id == c[0]
            if len(c) == 1:
                scores[j] = ContinuationScore(lp, 1, greedy, [lp])
            else:
                self.heads[(key, j)] = (lp, greedy)
                follow.append(Request((CHOICE, key, j), context + c, SCORE_ONLY, len(context) + 1))
        return follow

    def _drop(self, key: Any) -> None:
        del self.live[key]
        for k in [k for k in self.heads if k[0] == key]:
            del self.heads[k]


CHOICE = object()  # marks a choice job's requests among others in one engine


def score_stream(engine: Engine, jobs: Iterable[ChoiceJob], max_jobs: int = 1024) -> Iterator[ChoiceResult]:
    """Results as each job's continuations are all scored (completion order); at most `max_jobs`
    jobs are held at once, so a file of any length runs in bounded memory."""
    source = iter(jobs)
    scorer = ChoiceScorer()
    ids: dict[int, Any] = {}
    key = 0
    exhausted = False
    while True:
        new = []
        while not exhausted and len(scorer.live) < max_jobs:
            job = next(source, None)
            if job is None:
                exhausted = True
                break
            if error := invalid(job.context, job.continuations):
                yield ChoiceResult(job.id, [], error=error)
                continue
            ids[key] = job.id
            new.append(scorer.start(key, job.context, job.continuations))
            key += 1
        if new:
            engine.add(new)
        if not engine.has_work:
            if exhausted:
                return
            continue
        for res in engine.step():
            follow, k, done = scorer.finished(res)
            if follow:
                engine.add(follow)
            if isinstance(done, str):
                yield ChoiceResult(ids.pop(k), [], error=done)
            elif done is not None:
                yield ChoiceResult(ids.pop(k), done)


def invalid(context: list[int], continuations: list[list[int]]) -> str | None:
    if not context or not continuations or not all(continuations):
        return "a context and non-empty continuations are needed"
    return None


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
