"""Text of a token stream as it grows, and the stop strings found in it."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"  # what decode gives for bytes that do not (yet) form a character


class IncrementalDetokenizer:
    """Decodes a growing list of token ids a few at a time, with the prefix/read offsets of vLLM
    and transformers' TextStreamer: ids[prefix:read] were decoded last time and are decoded again
    as context (leading spaces and byte merging depend on neighbours); what decoding
    ids[prefix:] adds to them is the text of ids[read:].

    Text waits while it would end in U+FFFD or in a byte-fallback token (<0xE6>): a later byte
    can complete a character, and sentencepiece decodes a run of byte tokens as one group, so
    the run's text is final only once a token that is neither a byte nor skipped ends it. Each time `text` grows
    it equals tokenizer.decode(ids, skip_special_tokens=True); finish() takes in the tokens
    still waiting.

    Stop strings are looked for in the new text plus the max(len(stop)) - 1 characters before it
    only. On a hit `text` is cut before the earliest one, and `num_tokens` counts the tokens
    whose text ends at or before the cut: a token that straddles the cut is left out, while its
    text before the cut stays in `text`, so decode(ids[:num_tokens]) is a prefix of `text`. A
    token with no text of its own (a special token) ends where the text stood when it came."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._tail = max((len(s) for s in self.stop), default=1) - 1
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self._skipped = frozenset(i for i, t in added.items() if getattr(t, "special", False))
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self.num_tokens = 0  # tokens whose text is all in `text` (all of them while no stop hit)
        self._prefix = 0
        self._read = 0
        self._ends: list[int] = []  # per token whose text came out: len(text) after it

    def add(self, token_id: int) -> tuple[str, bool]:
        """Take one more token: (the text that came out, whether a stop string was found)."""
        if self.stopped:
            raise RuntimeError("the text was already cut at a stop string")
        self.ids.append(token_id)
        if self._in_byte_run(self.ids[self._read :]):
            return "", False
        return self._advance(final=False)

    def finish(self) -> tuple[str, bool]:
        """Let out the text still waiting (an unfinished character as U+FFFD, as decode gives it):
        (that text, whether it completed a stop string)."""
        if self.stopped:
            return "", True
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, bool]:
        if self._read == len(self.ids):
            return "", False
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if not final and (len(after) <= len(before) or after.endswith(REPLACEMENT)):
            return "", False  # nothing visible yet, or an unfinished character: wait for more
        new = after[len(before) :]
        start = len(self.text)
        self.text += new
        self._ends += self._waiting_ends(before, after, start)
        self._prefix, self._read = self._read, len(self.ids)
        self.num_tokens = len(self.ids)
        cut = self._find_stop(start)
        if cut is None:
            return new, False
        self.text = self.text[:cut]
        self.num_tokens = bisect_right(self._ends, cut)
        self.stopped = True
        return new[: max(cut - start, 0)], True

    def _waiting_ends(self, before: str, after: str, start: int) -> list[int]:
        """Where the text of each token of ids[read:] ends. When several waited together, decode
        the window up to each: where that is not how the window's text begins (mid-character, or
        a byte run the next tokens regroup), the token ends with the next one that fits."""
        ends: list[int | None] = []
        for j in range(self._read + 1, len(self.ids)):
            part = self._decode(self.ids[self._prefix : j])
            fits = after.startswith(part) and len(part) >= len(before)
            ends.append(start + len(part) - len(before) if fits else None)
        ends.append(start + len(after) - len(before))
        for i in range(len(ends) - 2, -1, -1):
            if ends[i] is None or ends[i] > ends[i + 1]:
                ends[i] = ends[i + 1]
        return ends  # type: ignore[return-value]

    def _find_stop(self, start: int) -> int | None:
        """Where the earliest stop string begins, looking only where one can have just completed:
        text wholly before `start` was searched by earlier calls."""
        if not self.stop:
            return None
        lo = max(start - self._tail, 0)
        seen = self.text[lo:]
        hits = [i for i in (seen.find(s) for s in self.stop) if i >= 0]
        return lo + min(hits) if hits else None

    def _in_byte_run(self, ids: list[int]) -> bool:
        """Whether the last of `ids` that is not a skipped special token is a byte token: skipped
        tokens do not end a run, its bytes are grouped across them."""
        for t in reversed(ids):
            if t not in self._skipped:
                piece = self.tokenizer.convert_ids_to_tokens(t)
                return isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
        return False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
