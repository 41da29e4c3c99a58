"""What the engine does to a batch of logits besides sampling from them: the log-probabilities a
request asks to see, and the presence / frequency penalties it asks for."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from chunkgen.engine.sampler import SamplingParams


@dataclass(slots=True)  # hundreds are made per step at top_logprobs=20
class TokenLogprob:
    """One generated token's log-probability and, when asked, its most likely alternatives."""

    token_id: int
    token: str  # the token decoded alone
    raw: bytes  # its bytes: for a piece of a multi-byte character, what `token` cannot show
    logprob: float
    top: list[TokenLogprob] = field(default_factory=list)  # most likely first

    def as_openai(self) -> dict:
        """The Chat Completions shape of one entry of `logprobs.content`."""
        entry = {"token": self.token, "logprob": self.logprob, "bytes": list(self.raw)}
        entry["top_logprobs"] = [{k: v for k, v in t.as_openai().items() if k != "top_logprobs"}
                                 for t in self.top]
        return entry


class StepLogprobs:
    """The log-softmax of the rows that asked for logprobs, taken from the raw logits before
    penalties, constraints or temperature change them; `pick` reads the sampled tokens' entries.
    (torch's log_softmax is one fused pass, faster on CPU than logsumexp alone.)"""

    def __init__(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
        self.rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.k = [params[i].logprobs or 0 for i in self.rows]
        self.lp = self.top = None
        if not self.rows:
            return
        x = logits
        if len(self.rows) < logits.shape[0]:
            x = logits.index_select(0, torch.tensor(self.rows, device=logits.device))
        self.lp = torch.log_softmax(x.float(), dim=-1)
        if max(self.k):
            v, i = self.lp.topk(max(self.k), dim=-1)
            self.top = (v.tolist(), i.tolist())

    def pick(self, tokens: list[int], text: Callable[[int], tuple[str, bytes]]) -> list[TokenLogprob | None]:
        """Per row of the batch, the entry of its sampled token (None for rows that did not ask);
        `text` gives a token's text and bytes."""
        out: list[TokenLogprob | None] = [None] * len(tokens)
        if self.lp is None:
            return out
        chosen_ids = torch.tensor([tokens[i] for i in self.rows], device=self.lp.device)
        chosen = self.lp.gather(1, chosen_ids[:, None]).squeeze(1).tolist()
        for j, (row, k) in enumerate(zip(self.rows, self.k)):
            top = []
            if k:
                top_v, top_i = self.top
                top = [TokenLogprob(t, *text(t), v) for t, v in zip(top_i[j][:k], top_v[j][:k])]
            out[row] = TokenLogprob(tokens[row], *text(tokens[row]), chosen[j], top)
        return out


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    counts: Sequence[dict[int, int] | None]) -> None:
    """Subtracts in place, per row, frequency_penalty x (times each token was generated) +
    presence_penalty x (1 if it was) from the logits; `counts` are the rows' generated-token
    counts (None or empty: nothing to do)."""
    rows: list[int] = []
    ids: list[int] = []
    amounts: list[float] = []
    for r, (p, c) in enumerate(zip(params, counts)):
        if c and p.penalized:
            for token, n in c.items():
                rows.append(r)
                ids.append(token)
                amounts.append(p.frequency_penalty * n + p.presence_penalty)
    if not rows:
        return
    dev = logits.device
    index = (torch.tensor(rows, device=dev), torch.tensor(ids, device=dev))
    with torch.inference_mode():  # the model's logits are inference tensors
        logits.index_put_(index, -torch.tensor(amounts, dtype=logits.dtype, device=dev), accumulate=True)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE (GPT-2, Llama 3, SmolLM) spells each byte as one printable character: the
    printable Latin-1 bytes stand for themselves, the other bytes, in order, for U+0100 onwards.
    This maps those characters back to bytes."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return table


def token_texts(tokenizer) -> Callable[[int], tuple[str, bytes]]:
    """A token id's text as the APIs show it, the token decoded alone, and its bytes. A piece of a
    multi-byte character decodes to U+FFFD; its bytes are then read off the vocabulary entry."""
    cache: dict[int, tuple[str, bytes]] = {}
    table: dict[str, int] | None = None

    def raw(token_id: int, text: str) -> bytes:
        nonlocal table
        if "\ufffd" in text:
            piece = tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                m = _BYTE_PIECE.fullmatch(piece)
                if m:
                    return bytes([int(m.group(1), 16)])
                table = table if table is not None else _byte_level_table()
                if piece and all(ch in table for ch in piece):
                    return bytes(table[ch] for ch in piece)
        return text.encode("utf-8")

    def text(token_id: int) -> tuple[str, bytes]:
        hit = cache.get(token_id)
        if hit is None:
            t = tokenizer.decode([token_id])
            hit = cache[token_id] = (t, raw(token_id, t))
        return hit

    return text
