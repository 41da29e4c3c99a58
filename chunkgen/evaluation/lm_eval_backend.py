"""The `chunkgen` model of lm-evaluation-harness (`pip install chunkgen[eval]`): loglikelihood,
loglikelihood_rolling and generate_until on one engine, so every request of a run shares one
prefix tree. Requests with the same context become one choice job (the context prefilled once,
its continuations branching from it); jobs are sent sorted by their tokens, so those sharing a
few-shot prefix run next to each other. Text is split into tokens as lm-eval's `hf` backend
splits it (TemplateLM's pairs, the same prefix token, left truncation to max_length).

model_args: pretrained (a model folder or hub name in the local cache; default: the embedded
default model), dtype, device, kv_memory, chunk_size, max_batch (as `chunkgen run`), max_length.
"""

from __future__ import annotations

from typing import Any

import lm_eval.models  # noqa: F401  # lm-eval's own models first: it loads them only into an empty registry
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from chunkgen.engine import Request, SamplingParams
from chunkgen.llm import LLM
from chunkgen.scoring import ChoiceJob, score_stream

_OPTIONS = ("dtype", "device", "kv_memory", "chunk_size", "max_batch")


@register_model("chunkgen")
class ChunkgenLM(TemplateLM):
    def __init__(
        self, pretrained: str | None = None, max_length: int | None = None, batch_size: Any = None, **options: Any
    ) -> None:
        super().__init__()
        unknown = sorted(set(options) - set(_OPTIONS) - {"trust_remote_code", "device_map", "max_batch_size"})
        if unknown:
            raise ValueError(
                f"chunkgen model_args: unknown {', '.join(unknown)}; known: pretrained, max_length, {', '.join(_OPTIONS)}"
            )
        chosen = {k: v for k, v in options.items() if k in _OPTIONS and v is not None}
        if chosen.get("dtype") in ("float32", "bfloat16", "float16"):  # lm_eval's spelling of the dtypes
            chosen["dtype"] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[chosen["dtype"]]
        if chosen.get("device") == "cuda":
            chosen["device"] = "cuda:0"
        self.llm = LLM(pretrained, **chosen)
        self.tokenizer = self.llm.tokenizer
        self._max_length = int(max_length) if max_length else self.llm.model.max_context

    # -- what TemplateLM needs ----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None and self.tokenizer.bos_token and string.startswith(self.tokenizer.bos_token):
            add_special_tokens = False  # as the hf backend: a string that holds its BOS gets no second
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **extra)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(logprob, is_greedy) per (key, context ids, continuation ids), in request order."""
        groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
        for i, (_, context, continuation) in enumerate(requests):
            whole = (context + continuation)[-(self.max_length + 1) :]  # the hf backend's left truncation
            cut = len(whole) - len(continuation)
            groups.setdefault(tuple(whole[:cut]), []).append((i, whole[cut:]))
        jobs = [ChoiceJob(members, list(ctx), [cont for _, cont in members]) for ctx, members in sorted(groups.items())]
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for res in score_stream(self.llm.engine, jobs):
            if res.error:
                raise RuntimeError(f"chunkgen could not score a request: {res.error}")
            for (i, _), score in zip(res.id, res.choices):
                out[i] = (score.logprob, score.greedy)
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, 1),
            ):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, as gen_kwargs ask) answers cut at the first `until` string."""
        batch = []
        for i, req in enumerate(requests):
            context, gen = req.args
            gen = dict(gen or {})
            until = gen.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
            if eos and eos not in until:
                until.append(eos)
            max_new = int(gen.pop("max_gen_toks", 256))
            temperature = float(gen.pop("temperature", 0.0)) if gen.pop("do_sample", False) else 0.0
            ids = self.tok_encode(context)[-(self.max_length - max_new) :]  # the hf backend's left truncation
            params = SamplingParams(max_new_tokens=max_new, temperature=temperature, stop=tuple(s for s in until if s))
            batch.append(Request(i, ids, params))
        batch.sort(key=lambda r: r.prompt_tokens)  # shared prefixes next to each other
        out = [""] * len(requests)
        for res in self.llm.stream(batch):
            if res.error:
                raise RuntimeError(f"chunkgen could not answer a request: {res.error}")
            text = res.text
            for stop in requests[res.id].args[1].get("until") or []:
                if stop and stop in text:
                    text = text.split(stop)[0]
            out[res.id] = text
        return out
