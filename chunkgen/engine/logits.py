"""What the engine does to a batch of logits besides sampling from them: the log-probabilities a
request asks to see, and the presence / frequency penalties it asks for."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from chunkgen.engine.sampler import SamplingBatch


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
        entry["top_logprobs"] = [{k: v for k, v in t.as_openai().items() if k != "top_logprobs"} for t in self.top]
        return entry


class StepLogprobs:
    """The log-softmax of the rows that asked for logprobs, taken from the raw logits before
    penalties, constraints or temperature change them. Everything stays on the device:
    `columns` gathers the sampled tokens' entries and the top alternatives into one tensor that
    the step reads back with its tokens, `entries` turns that read into TokenLogprobs.
    (torch's log_softmax is one fused pass, faster on CPU than logsumexp alone.)"""

    def __init__(self, logits: torch.Tensor, batch: SamplingBatch) -> None:
        self.batch = batch
        self.lp: torch.Tensor | None = None
        if not batch.logprob_rows:
            return
        x = logits if batch.logprob_index is None else logits.index_select(0, batch.logprob_index)
        self.lp = torch.log_softmax(x.float(), dim=-1)

    def columns(self, tokens: torch.Tensor) -> torch.Tensor:
        """[rows asking, 1 + 2 x most alternatives asked] float64 on the device: the sampled
        token's logprob, then the alternatives' logprobs and their token ids (exact in float64)."""
        if self.lp is None:
            return tokens.new_empty((0,), dtype=torch.float64)
        b = self.batch
        mine = tokens if b.logprob_index is None else tokens.index_select(0, b.logprob_index)
        cols = [self.lp.gather(1, mine[:, None]).double()]
        if b.max_logprobs:
            v, i = self.lp.topk(b.max_logprobs, dim=-1)
            cols += [v.double(), i.double()]
        return torch.cat(cols, dim=1)

    def chosen(self, row: int, token: int) -> float:
        """A row's logprob of `token`, read on its own: for the rare row drawn again on the host."""
        assert self.lp is not None
        return float(self.lp[self.batch.logprob_rows.index(row), token])

    def entries(
        self,
        read: list[float],
        tokens: list[int],
        text: Callable[[int], tuple[str, bytes]],
        redrawn: Sequence[int] = (),
    ) -> list[TokenLogprob | None]:
        """Per row of the batch, the entry of its sampled token (None for rows that did not ask),
        from `read`, the host copy of `columns`; `text` gives a token's text and bytes; rows in
        `redrawn` changed token after `columns` was taken."""
        b = self.batch
        out: list[TokenLogprob | None] = [None] * len(tokens)
        width = 1 + 2 * b.max_logprobs
        m = b.max_logprobs
        for j, row in enumerate(b.logprob_rows):
            rec = read[j * width : (j + 1) * width]
            k = b.params[row].logprobs or 0
            top = [TokenLogprob(t, *text(t), v) for t, v in zip(map(int, rec[1 + m : 1 + m + k]), rec[1 : 1 + k])]
            chosen = self.chosen(row, tokens[row]) if row in redrawn else rec[0]
            out[row] = TokenLogprob(tokens[row], *text(tokens[row]), chosen, top)
        return out


@dataclass
class PenaltyRows:
    """One batch composition's penalized rows: their batch rows and count slots on the device."""

    rows: torch.Tensor | None  # None: every row of the batch, in order
    slots: torch.Tensor
    frequency: torch.Tensor  # [rows, 1]
    presence: torch.Tensor
    ones: torch.Tensor  # what one more occurrence adds


class Penalties:
    """Generated-token counts of the penalized sequences, [slots, vocab] on the logits' device:
    a step subtracts frequency_penalty x count + presence_penalty x (count > 0) from its rows'
    logits, then adds its sampled tokens to the counts on the device (prompt tokens never count).
    A sequence holds its slot until it finishes; slots are reclaimed when a batch is planned."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.counts = torch.zeros((0, vocab), device=device)
        self.owner: dict[int, object] = {}  # slot -> sequence
        self.slot_of: dict[int, int] = {}  # seq_id -> slot

    def plan(self, seqs: Sequence) -> PenaltyRows | None:
        """The penalized rows of a batch composition, their slots assigned (None: none)."""
        rows = [i for i, s in enumerate(seqs) if s.params.penalized]
        if not rows:
            return None
        for slot, seq in list(self.owner.items()):
            if seq.finish_reason:
                del self.owner[slot], self.slot_of[seq.seq_id]
        dev = self.counts.device
        free = sorted(set(range(self.counts.shape[0])) - set(self.owner))
        fresh = [seqs[i] for i in rows if seqs[i].seq_id not in self.slot_of]
        if len(fresh) > len(free):
            have = self.counts.shape[0]
            grow = max(have, len(fresh) - len(free), 8)
            self.counts = torch.cat([self.counts, self.counts.new_zeros((grow, self.counts.shape[1]))])
            free += range(have, have + grow)
        for seq, slot in zip(fresh, free):
            self.owner[slot], self.slot_of[seq.seq_id] = seq, slot
            self.counts[slot].zero_()
        params = [seqs[i].params for i in rows]
        return PenaltyRows(
            rows=None if len(rows) == len(seqs) else torch.tensor(rows, device=dev),
            slots=torch.tensor([self.slot_of[seqs[i].seq_id] for i in rows], device=dev),
            frequency=torch.tensor([[p.frequency_penalty] for p in params], device=dev),
            presence=torch.tensor([[p.presence_penalty] for p in params], device=dev),
            ones=torch.ones(len(rows), device=dev),
        )

    @torch.inference_mode()  # the model's logits are inference tensors: in-place only in this mode
    def apply_(self, logits: torch.Tensor, rows: PenaltyRows) -> None:
        c = self.counts.index_select(0, rows.slots)
        amount = (c * rows.frequency).add_(c.clamp(max=1.0) * rows.presence).to(logits.dtype)
        if rows.rows is None:
            logits.sub_(amount)
        else:
            logits.index_add_(0, rows.rows, amount, alpha=-1)

    @torch.inference_mode()
    def count_(self, rows: PenaltyRows, tokens: torch.Tensor) -> None:
        """Adds the step's sampled tokens [batch] (on the device) to the penalized rows' counts."""
        mine = tokens if rows.rows is None else tokens.index_select(0, rows.rows)
        self.counts.index_put_((rows.slots, mine), rows.ones, accumulate=True)


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
