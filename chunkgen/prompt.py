"""A prompt to token ids without trusting what it holds: a row's values never become control tokens,
a row's size is bounded before it is tokenized, and a chat template is run under a time limit and
probed once to show it keeps each message's content.

Control strings are judged on the rendered text, not value by value: the template is rendered with
the values, and again with a marker in place of each (markers built from characters no value and
no template text holds, so none can be spelt by a value). Where the markers fall gives each value's
span in the rendered text; when no control string there overlaps a value, the text is tokenized
whole, exactly as transformers would; otherwise the template's pieces are tokenized as usual and
every value as plain text, so no cut across values or placeholders can make a control token.
"""

from __future__ import annotations

import re
import signal
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

Prompt = str | list[dict[str, str]] | list[int]
# Per message: its content's pieces, literal text (str) or the index of a value in `data` (int).
Layout = Sequence[Sequence[str | int]]

RENDER_SECONDS = 10.0  # a chat template renders a prompt in well under a millisecond
PREFIXES_KEPT = 64  # shared prompt beginnings remembered per tokenizer (see SharedPrefixes)
PROBE = {"system": "chunkgen probe: system text 7d1e", "user": "chunkgen probe: user text 3b9a"}


class RenderTimeout(Exception):
    """A chat template ran past its time limit (a loop too long to finish)."""


class PromptTooLong(ValueError):
    """A row longer than the model's context could hold at any tokenization."""


@contextmanager
def time_limit(seconds: float | None, what: str) -> Iterator[None]:
    """Raises RenderTimeout in the block after `seconds` (again every 0.1 s, should anything
    swallow it). Only the main thread can take the alarm: elsewhere the block runs unlimited."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise RenderTimeout(f"{what} did not finish in {seconds:g} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.1)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def render(tokenizer, messages: list[dict[str, str]], seconds: float | None = RENDER_SECONDS) -> str | None:
    """The chat template's text for `messages` (None when the tokenizer has no template)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    with time_limit(seconds, "the model's chat template"):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def check_chat_template(tokenizer, where: str, seconds: float | None = RENDER_SECONDS) -> None:
    """Fails before any work when the model's chat template cannot render a system and a user
    message, takes longer than `seconds`, or leaves out a message's content (a template that reads
    a field messages do not have renders every row the same)."""
    if not getattr(tokenizer, "chat_template", None):
        return
    pair = [{"role": "system", "content": PROBE["system"]}, {"role": "user", "content": PROBE["user"]}]
    try:
        try:
            text, probed = render(tokenizer, pair, seconds), pair
        except RenderTimeout:
            raise
        except Exception:  # templates without a system role refuse one; a user turn must still work
            text, probed = render(tokenizer, pair[1:], seconds), pair[1:]
    except Exception as exc:
        raise ValueError(f"{where}: the model's chat template cannot be used ({type(exc).__name__}: {exc})") from None
    lost = [m["role"] for m in probed if m["content"] not in (text or "")]
    if lost:
        raise ValueError(
            f"{where}: the model's chat template leaves out the {' and '.join(lost)} message's content "
            "(every row would get the same prompt); fix the template, or pass --no-chat-template"
        )


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _facts(tokenizer) -> tuple[re.Pattern | None, int, frozenset[int]]:
    """(a pattern finding every control string, longest first at each place; the longest token's
    length in characters; the control tokens' ids), worked out once per tokenizer."""
    try:
        return _cache[tokenizer]
    except (KeyError, TypeError):
        pass
    controls = control_strings(tokenizer)
    pattern = (
        re.compile("(?=(" + "|".join(map(re.escape, sorted(controls, key=len, reverse=True))) + "))")
        if controls
        else None
    )
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    longest = max((len(t) for t in vocab), default=16)
    ids = (
        frozenset(i for i in tokenizer.convert_tokens_to_ids(list(controls)) if isinstance(i, int))
        if controls
        else frozenset()
    )
    facts = (pattern, max(longest, 1), ids)
    try:
        _cache[tokenizer] = facts
    except TypeError:
        pass
    return facts


def control_strings(tokenizer) -> tuple[str, ...]:
    """Texts the tokenizer turns into control tokens (<|im_start|>, </s>, ...)."""
    found = set(getattr(tokenizer, "all_special_tokens", ()))
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            found.add(tok.content)
    return tuple(sorted(s for s in found if s))


def max_characters(tokenizer, max_tokens: int) -> int:
    """Characters beyond which no text fits in `max_tokens` tokens, however it is tokenized."""
    return max_tokens * _facts(tokenizer)[1]


def layout_of(prompt: list[dict[str, str]], data: Sequence[str]) -> list[list[str | int]]:
    """A layout found by searching the contents for the values (callers that give values without
    saying where they are): every occurrence of a value is taken as that value."""
    values = [v for v in data if v]
    if not values:
        return [[m["content"]] for m in prompt]
    index = {v: i for i, v in enumerate(data) if v}
    pattern = re.compile("|".join(map(re.escape, sorted(set(values), key=len, reverse=True))))
    out: list[list[str | int]] = []
    for m in prompt:
        parts: list[str | int] = []
        at = 0
        for found in pattern.finditer(m["content"]):
            parts += [m["content"][at : found.start()], index[found.group()]]
            at = found.end()
        parts.append(m["content"][at:])
        out.append([p for p in parts if p != ""])
    return out


def _markers(texts: Sequence[str]) -> tuple[str, str]:
    """Two characters none of `texts` holds (private-use code points, tried in turn)."""
    chosen: list[str] = []
    for code in range(0xE000, 0xF8FF):
        ch = chr(code)
        if not any(ch in t for t in texts):
            chosen.append(ch)
            if len(chosen) == 2:
                return chosen[0], chosen[1]
    raise ValueError("the row holds every private-use character; it cannot be laid out safely")


def encode_prompt(
    tokenizer,
    prompt: Prompt,
    data: Sequence[str] = (),
    layout: Layout | None = None,
    max_tokens: int | None = None,
    seconds: float | None = RENDER_SECONDS,
) -> list[int]:
    """Token ids of a prompt: chat messages go through the model's chat template when it has one.

    `data` are the user-supplied strings inside the messages (template values, batch-file
    contents), and `layout` where each message's content holds them (found by search when not
    given). No control token comes from them, however they are cut (see the module). With
    `max_tokens` (the context), a prompt is refused (PromptTooLong) at once when its characters
    could not fit, and tokenized no further than max_tokens + 1."""
    limit = None if max_tokens is None else max_tokens + 1
    if isinstance(prompt, str):
        _check_size(tokenizer, len(prompt), max_tokens)
        return _tokens(tokenizer, prompt, limit, add_special_tokens=True)
    if not prompt or not isinstance(prompt[0], dict):
        return list(prompt)
    _check_size(tokenizer, sum(len(m["content"]) for m in prompt), max_tokens)
    rendered = render(tokenizer, prompt, seconds)
    plain = rendered is None
    if plain:
        rendered = "\n\n".join(m["content"] for m in prompt)
    last = prompt[-1]["content"]
    cut = rendered.rfind(last) if last else -1  # where the last message's own text starts
    if not any(data):
        return _tokens(tokenizer, rendered, limit, add_special_tokens=plain, cut=cut)
    layout = layout if layout is not None else layout_of(prompt, data)
    start, end = _markers([*(m["content"] for m in prompt), *data, str(getattr(tokenizer, "chat_template", ""))])
    masked = [
        {**m, "content": "".join(p if isinstance(p, str) else f"{start}{p}{end}" for p in parts)}
        for m, parts in zip(prompt, layout)
    ]
    text = render(tokenizer, masked, seconds)
    if text is None:
        text = "\n\n".join(m["content"] for m in masked)
    pieces: list[str | int] = [
        int(p[1:-1]) if p.startswith(start) else p
        for p in re.split(f"({re.escape(start)}\\d+{re.escape(end)})", text)
        if p
    ]
    spans, at = [], 0
    for p in pieces:
        n = len(p) if isinstance(p, str) else len(data[p])
        if not isinstance(p, str) and n:
            spans.append((at, at + n))
        at += n
    same = "".join(p if isinstance(p, str) else data[p] for p in pieces) == rendered
    if same and not _overlaps(tokenizer, rendered, spans):
        return _tokens(tokenizer, rendered, limit, add_special_tokens=plain, cut=cut)
    # A control string reaches into a value (or the template changed the values as it rendered
    # them): the template's pieces as usual, each value as text.
    ids: list[int] = list(tokenizer("", add_special_tokens=True)["input_ids"]) if plain else []
    for p in pieces:
        if isinstance(p, str):
            ids += tokenizer(p, add_special_tokens=False)["input_ids"]
        else:
            ids += _text_ids(tokenizer, data[p])
        if limit is not None and len(ids) > limit:
            return ids[:limit]
    return ids


def _text_ids(tokenizer, text: str) -> list[int]:
    """`text` tokenized as text: control strings in it split into plain tokens, also those of
    added tokens that split_special_tokens leaves whole (added, but not marked special)."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    pattern, _, controls = _facts(tokenizer)
    found = pattern.search(text) if pattern is not None and controls.intersection(ids) else None
    if found is None:
        return ids
    cut = found.start() + 1  # inside the control string: neither side can spell it
    return _text_ids(tokenizer, text[:cut]) + _text_ids(tokenizer, text[cut:])


def _overlaps(tokenizer, text: str, spans: list[tuple[int, int]]) -> bool:
    """Whether a control string found in `text` overlaps any of the value spans."""
    pattern = _facts(tokenizer)[0]
    if pattern is None or not spans:
        return False
    for found in pattern.finditer(text):
        a, b = found.start(), found.start() + len(found.group(1))
        if any(a < e and s < b for s, e in spans):
            return True
    return False


def _check_size(tokenizer, characters: int, max_tokens: int | None) -> None:
    if max_tokens is None:
        return
    most = max_characters(tokenizer, max_tokens)
    if characters > most:
        raise PromptTooLong(
            f"prompt of {characters:,} characters cannot fit the model's context of {max_tokens} tokens "
            f"(at most {most:,} characters at this tokenizer's longest token); refused before tokenizing"
        )


def _tokens(tokenizer, text: str, limit: int | None, add_special_tokens: bool, cut: int = -1) -> list[int]:
    """`text`'s ids (the first `limit`); where a cached beginning of it ends at a control token
    before `cut`, only the rest is tokenized (SharedPrefixes)."""
    if cut > 0 and getattr(tokenizer, "is_fast", False) and getattr(tokenizer, "truncation_side", "") == "right":
        ids = SharedPrefixes.of(tokenizer).ids(text, cut, add_special_tokens)
        if ids is not None:
            return ids if limit is None else ids[:limit]
    if limit is None:
        return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    return tokenizer(text, add_special_tokens=add_special_tokens, truncation=True, max_length=limit)["input_ids"]


class SharedPrefixes:
    """The ids of prompt beginnings many rows share (a long system prompt, few-shot turns), so each
    row tokenizes only its own rest: a 2,000-token system prompt costs milliseconds a row to
    tokenize again, more than the row's own share of a decode step.

    A fast tokenizer cuts its input at control tokens and tokenizes the text between them on its
    own, so the ids of a text cut at a control token are the beginning's followed by the rest's,
    the rest taken from the control token on (so its text is not the input's first word, which
    some pre-tokenizers mark). What can still differ sits at the cut alone (a control token that
    strips the blanks after it): so the key is the text up to the first character after the
    control token that is not blank, and a key is trusted only once its first use has matched the
    whole text's ids; a key that does not is never cut again. A key is checked at its second sight,
    so rows that share no beginning cost nothing more."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = weakref.ref(tokenizer)
        # key -> None (seen once), the beginning's ids (checked), or False (cutting it changes ids)
        self._known: OrderedDict[str, list[int] | bool | None] = OrderedDict()
        self._lock = threading.Lock()  # an LLM may tokenize from several threads

    @classmethod
    def of(cls, tokenizer) -> SharedPrefixes:
        try:
            return _prefixes[tokenizer]
        except KeyError:
            _prefixes[tokenizer] = found = cls(tokenizer)
            return found

    def ids(self, text: str, cut: int, add_special_tokens: bool) -> list[int] | None:
        """`text`'s whole ids, or None where no checked beginning applies (the caller tokenizes
        it whole)."""
        found = self._split(text, cut)
        if found is None:
            return None
        at, end = found
        blank = len(text) - len(text[end:].lstrip())
        key = text[: min(len(text), blank + 1)] + ("\x00" if add_special_tokens else "")
        with self._lock:
            known = self._known.get(key, _UNSEEN)
        if known is _UNSEEN:
            self._remember(key, None)
            return None
        if known is False:
            return None
        tokenizer = self._tokenizer()
        rest = tokenizer(text[at:], add_special_tokens=False)["input_ids"]
        if known is None:  # its second sight: checked against the whole text's ids once
            whole = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
            fits = len(whole) > len(rest) and whole[len(whole) - len(rest) :] == rest
            self._remember(key, whole[: len(whole) - len(rest)] if fits else False)
            return whole
        self._remember(key, known)
        return known + rest

    def _split(self, text: str, cut: int) -> tuple[int, int] | None:
        """Where the last control string before `cut` starts and ends, if any."""
        pattern = _facts(self._tokenizer())[0]
        if pattern is None:
            return None
        last = None
        for found in pattern.finditer(text, 0, cut):  # each fits before cut: the lookahead stops there
            last = found
        return None if last is None else (last.start(), last.start() + len(last.group(1)))

    def _remember(self, key: str, value: list[int] | bool | None) -> None:
        with self._lock:
            self._known[key] = value
            self._known.move_to_end(key)
            while len(self._known) > PREFIXES_KEPT:
                self._known.popitem(last=False)


_prefixes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_UNSEEN = object()
