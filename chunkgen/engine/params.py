"""What a request asks for, checked: SamplingParams and its limits, and the constraint specs
(a JSON schema, a regex or a Lark grammar) compiled once per distinct spec with llguidance, so a bad
one is refused before any model loads. Turning logits into tokens is sampler.py's; masking them
by a constraint is constraint.py's."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from numbers import Integral, Real
from typing import Any

MAX_N = 128
MAX_STOP = 16
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # alternatives per token, as the Chat Completions API allows
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2], as OpenAI and vLLM take them
GREEDY_BELOW = 1e-5  # as vLLM: smaller temperatures overflow the scaled logits, so take the argmax


class ParamError(ValueError):
    """A bad SamplingParams value; `field` names the parameter so callers can point at it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field
        self.message = message


def _integer(name: str, v: Any, lo: int, hi: int | None = None, hi_text: str | None = None) -> int:
    bound = f">= {lo}" if hi is None else f"in [{lo}, {hi_text or hi}]"
    if isinstance(v, bool) or not isinstance(v, Integral) or v < lo or (hi is not None and v > hi):
        raise ParamError(name, f"must be an integer {bound}, got {v!r}")
    return int(v)


def _number(name: str, v: Any, rule: str, ok: Callable[[float], bool]) -> float:
    if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v) or not ok(v):
        raise ParamError(name, f"must be a number {rule}, got {v!r}")
    return float(v)


def _knob(default: Any, help: str, metavar: str = "X", *, shown: str | None = None, file: bool = False, later=False):
    """A SamplingParams field with what the command line says of it: `help` (its `[default: ...]`
    is added from `default`, or `shown`), `metavar`; `file`: the command line takes a file holding
    the value; `later`: added after the first release, so left out of `as_dict` while unset
    (request hashes and records of requests that do not use it stay what they were)."""
    meta = {"help": help, "metavar": metavar, "shown": shown, "file": file, "later": later}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. Each field is reachable, by its own name, from the command line
    (`--max-new-tokens`), a template's [sampling] (constraints: [output]) and a row; OpenAI batch
    rows name a few differently (jobs/requests.py OPENAI_RENAMES). Adding a parameter is adding a
    field here."""

    max_new_tokens: int = _knob(64, "Tokens to generate at most per answer.", "N")
    temperature: float = _knob(0.0, "Sampling temperature; 0 is greedy.")  # below GREEDY_BELOW: greedy
    top_p: float = _knob(
        1.0, "Nucleus sampling: keep the smallest set of tokens whose probability reaches this, in (0, 1]."
    )
    top_k: int = _knob(0, "Sample among the k most likely tokens; 0 is off.", "N")
    seed: int | None = _knob(
        None,
        "Seed for sampling, in [0, 2^63): the same seed gives the same answer in any batch.",
        "N",
        shown="random",
    )
    stop: tuple[str, ...] = _knob((), "Stop string, repeatable: the answer ends before it.", "TEXT", shown="none")
    stop_token_ids: tuple[int, ...] = _knob(
        (), "Token id that ends an answer (kept in it), repeatable.", "ID", shown="none"
    )
    ignore_eos: bool = _knob(False, "Generate past the end-of-sequence token, up to --max-new-tokens.")
    n: int = _knob(1, f"Answers (samples) per row, at most {MAX_N}.", "N")
    # Log-probabilities of the model's own distribution (before penalties, constraints and
    # temperature, as vLLM returns by default): None for none, k for the chosen token's plus the
    # k most likely alternatives at every step.
    logprobs: int | None = _knob(
        None,
        f"Return each generated token's log-probability and its N most likely alternatives, N in [0, {MAX_LOGPROBS}].",
        "N",
        shown="none",
        later=True,
    )
    # Log-probabilities of the prompt's own tokens (vLLM's prompt_logprobs), computed while the
    # prompt is prefilled and kept with its tree chunks (a shared prefix is scored once): None for
    # none, k for each prompt token's plus its k likeliest alternatives; the first token has none.
    prompt_logprobs: int | None = _knob(
        None,
        f"Return each prompt token's log-probability and its N most likely alternatives, N in [0, {MAX_LOGPROBS}].",
        "N",
        shown="none",
        later=True,
    )
    # Subtracted from the logit of every token already generated (prompt tokens do not count):
    # presence once per token seen, frequency once per occurrence, as vLLM and OpenAI apply them.
    presence_penalty: float = _knob(
        0.0, "Subtracted from the logit of every token already generated, in [-2, 2].", later=True
    )
    frequency_penalty: float = _knob(
        0.0, "Subtracted from a token's logit once per time it was generated, in [-2, 2].", later=True
    )
    # Constrained decoding (engine/constraint.py), at most one: a JSON schema (kept as its JSON
    # text so the dataclass stays hashable; a dict is accepted), a regex, a Lark grammar.
    json_schema: str | None = _knob(
        None, "Constrain answers to this JSON schema (a .json file).", "FILE", shown="none", file=True, later=True
    )
    regex: str | None = _knob(None, "Constrain answers to match this regex.", "REGEX", shown="none", later=True)
    grammar: str | None = _knob(
        None, "Constrain answers to this Lark grammar (a file).", "FILE", shown="none", file=True, later=True
    )

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        # 0: the prompt is only scored (prompt_logprobs), nothing is generated.
        put("max_new_tokens", _integer("max_new_tokens", self.max_new_tokens, 0))
        put("temperature", _number("temperature", self.temperature, ">= 0", lambda v: v >= 0))
        put("top_p", _number("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1))
        put("top_k", _integer("top_k", self.top_k, 0))
        if self.seed is not None:
            put("seed", _integer("seed", self.seed, 0, MAX_SEED, "2**63 - 1"))
        put("n", _integer("n", self.n, 1, MAX_N))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                put(name, _integer(name, getattr(self, name), 0, MAX_LOGPROBS))
        for name in ("presence_penalty", "frequency_penalty"):
            put(
                name,
                _number(
                    name,
                    getattr(self, name),
                    f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                    lambda v: -MAX_PENALTY <= v <= MAX_PENALTY,
                ),
            )
        if not isinstance(self.ignore_eos, bool):
            raise ParamError("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop  # one string is one stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ParamError("stop", f"must be a non-empty string or a list of them, got {self.stop!r}")
        if len(stop) > MAX_STOP:
            raise ParamError("stop", f"takes at most {MAX_STOP} strings, got {len(stop)}")
        put("stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or any(
            isinstance(t, bool) or not isinstance(t, Integral) or t < 0 for t in ids
        ):
            raise ParamError("stop_token_ids", f"must be a list of token ids (integers >= 0), got {ids!r}")
        put("stop_token_ids", tuple(int(t) for t in ids))
        self._check_constraint(put)

    def _check_constraint(self, put: Callable[[str, Any], None]) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ParamError(given[1], f"cannot be combined with {given[0]} (give at most one constraint)")
        if not given:
            return
        kind = given[0]
        if kind == "json_schema":
            put(kind, normalize_schema(self.json_schema))
        elif not isinstance(getattr(self, kind), str) or not getattr(self, kind):
            raise ParamError(kind, f"must be a non-empty string, got {getattr(self, kind)!r}")
        compile_spec(kind, getattr(self, kind))  # cached: a spec compiles once per process

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    def as_dict(self) -> dict:
        # Fields added after the first release are left out while unset: request hashes and records
        # of requests that do not use them stay what they were (resume compares those hashes).
        return {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items() if _UNSET.get(k, ...) != v
        }


SAMPLING_FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(SamplingParams)
SAMPLING_NAMES = tuple(f.name for f in SAMPLING_FIELDS)
_UNSET = {f.name: f.default for f in SAMPLING_FIELDS if f.metadata["later"]}  # as_dict leaves these out


KINDS = ("json_schema", "regex", "grammar")  # SamplingParams fields, at most one set
# Scoring fixed continuations: nothing generated, the prompt's tokens scored with one alternative
# each (which says whether a token is the likeliest).
SCORE_ONLY = SamplingParams(max_new_tokens=0, prompt_logprobs=1)
# JSON as people and chat models write it, `{"a": 1, "b": [2, 3]}`: with llguidance's default
# (flexible whitespace) a weak model can pad an answer with blanks until it runs out of tokens.
# A schema's own "x-guidance" options still win over these.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def llguidance_module():
    import llguidance  # imported on first use: unconstrained runs never load it

    return llguidance


@lru_cache(maxsize=256)
def compile_spec(kind: str, spec: str) -> str:
    """The llguidance grammar of a spec; raises ParamError(kind, llguidance's message) when it
    does not compile. Checked without a tokenizer, so before any model is loaded."""
    M = llguidance_module().LLMatcher
    try:
        if kind == "json_schema":
            grammar = M.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
        elif kind == "regex":
            grammar = M.grammar_from_regex(spec)
        elif kind == "grammar":
            grammar = M.grammar_from_lark(spec)
        else:
            raise ValueError(f"unknown constraint kind {kind!r}")
    except ValueError as exc:
        raise ParamError(kind, f"does not compile: {exc}") from None
    error = M.validate_grammar(grammar)
    if error:
        raise ParamError(kind, f"does not compile: {error.strip()}")
    return grammar


def normalize_schema(value: Any) -> str:
    """A JSON schema as the compact JSON string SamplingParams keeps (hashable). Keys keep their
    order, never sorted: llguidance writes an object's properties in the order the schema lists
    them, so sorting would make {"function", "arguments"} come out as {"arguments", "function"}.

    Every row of a template carries the template's schema: the last schema object seen and its
    text are kept, so a file of rows pays for one serialisation, not one per row."""
    if isinstance(value, str):
        return _normalize_schema_text(value)
    last = _last_schema
    if last and last[0] is value:
        return last[1]
    text = _schema_text(value)
    if isinstance(value, dict):
        _last_schema[:] = [value, text]  # the object is held, so its identity cannot be reused
    return text


_last_schema: list = []


@lru_cache(maxsize=64)
def _normalize_schema_text(value: str) -> str:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ParamError("json_schema", f"is not valid JSON: {exc.msg} (column {exc.colno})") from None
    return _schema_text(parsed)


def _schema_text(value: Any) -> str:
    if not isinstance(value, (dict, bool)):  # true / false are schemas too
        raise ParamError("json_schema", f"must be a JSON object (a schema), got {type(value).__name__}")
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def spec_of(params) -> tuple[str, str] | None:
    """(kind, spec) of a SamplingParams' constraint, or None."""
    for kind in KINDS:
        spec = getattr(params, kind)
        if spec is not None:
            return kind, spec
    return None
