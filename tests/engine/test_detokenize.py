"""Incremental detokenization against full decodes, and stop strings cut where they begin."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from chunkgen.engine.detokenize import IncrementalDetokenizer

TEXTS = [
    "héllo wörld 日本語 🙂 ok and more",
    "€ and ünïcödé — “quotes” 🎉🎉!",
    "a\nb  c\t d",
    "  leading spaces",
    "x.y, z! 'quote' n't",
    "<|im_start|>assistant\n2 + 2 = 4<|im_end|>",
]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)  # sentencepiece with byte fallback


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def streams(tok, rng: random.Random, count: int) -> list[list[int]]:
    """Token streams of real text (characters outside the vocabulary split into byte tokens),
    with stray tokens in between, and streams of tokens drawn at random from the whole vocabulary
    (special tokens, and bytes that never form a character, included)."""
    out = []
    for i in range(count):
        if i % 2:
            out.append([rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))])
            continue
        ids: list[int] = []
        for _ in range(rng.randrange(1, 4)):
            ids += tok.encode(rng.choice(TEXTS), add_special_tokens=False)
            if rng.random() < 0.3:
                ids.append(rng.randrange(len(tok)))
        out.append(ids)
    return out


def check_stream(tok, ids: list[int]) -> int:
    """Feed ids one by one; return how many steps held text back."""
    d = IncrementalDetokenizer(tok)
    held = 0
    for i, t in enumerate(ids):
        new, hit = d.add(t)
        assert not hit
        full = decode(tok, ids[: i + 1])
        assert d.text == decode(tok, ids[: d.num_tokens])  # what came out is what those tokens decode to
        if d.text != full:
            held += 1
            # only an unfinished character, or a byte run the next token may regroup, waits
            assert full.endswith("\ufffd") or d._in_byte_run(ids[: i + 1]), (ids[: i + 1], d.text, full)
    d.finish()
    assert d.text == decode(tok, ids) and d.num_tokens == len(ids)
    return held


def test_text_is_the_full_decode_at_every_character_boundary(tok):
    rng = random.Random(0)
    held = sum(check_stream(tok, ids) for ids in streams(tok, rng, 300))
    assert held > 50  # characters split across byte tokens did occur


def test_byte_level_bpe_of_the_real_tokenizer(default_model_dir):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    rng = random.Random(1)
    assert sum(check_stream(tok, ids) for ids in streams(tok, rng, 60)) > 5


@pytest.mark.parametrize("stop", ["本", "wö", "o w", "🙂", "ok a", " more", "語 🙂", "h", "ld 日"])
def test_stop_strings_across_token_boundaries_cut_text_and_tokens(tok, stop):
    text = TEXTS[0]
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, (stop, "never there"))
    for t in ids:
        _, hit = d.add(t)
        if hit:
            break
    assert hit and d.stopped
    cut = text.index(stop)
    assert d.text == text[:cut] and stop not in d.text
    with pytest.raises(RuntimeError):
        d.add(ids[0])

    def wholly_before(m: int) -> bool:
        s = decode(tok, ids[:m])
        return text[:cut].startswith(s) and not s.endswith("\ufffd")

    # token_ids end with the last token whose text ends at or before the cut
    assert wholly_before(d.num_tokens) and not wholly_before(d.num_tokens + 1)


def test_the_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode(TEXTS[1], add_special_tokens=False)
    d = IncrementalDetokenizer(tok, ["!", "ünï", "€ and"])
    steps = next(i for i, t in enumerate(ids) if d.add(t)[1])
    assert d.text == "" and decode(tok, ids[: d.num_tokens]) == ""  # "€ and" begins the text
    assert decode(tok, ids[: steps + 1]).startswith("€ and") and "ünï" not in decode(tok, ids[: steps + 1])


def test_random_stop_strings_are_found_wherever_they_fall(tok):
    rng = random.Random(2)
    found = 0
    for ids in streams(tok, rng, 300):
        full = decode(tok, ids)
        if "\ufffd" in full or len(full) < 2:
            continue  # garbage bytes: their text is rewritten by later tokens, nothing to cut at
        a = rng.randrange(len(full) - 1)
        stop = full[a : a + rng.randrange(1, 5)]
        d = IncrementalDetokenizer(tok, [stop])
        hit = False
        for t in ids:
            _, hit = d.add(t)
            if hit:
                break
        if not hit:
            _, hit = d.finish()
        assert hit and d.text == full[: full.index(stop)] and stop not in d.text
        assert d.text.startswith(decode(tok, ids[: d.num_tokens]))
        found += 1
    assert found > 100


def test_text_waiting_at_the_end_can_complete_a_stop_string(tok):
    ids = tok.encode("ok 日", add_special_tokens=False)  # ends in byte tokens
    d = IncrementalDetokenizer(tok, ["日"])
    assert not any(d.add(t)[1] for t in ids)  # the last byte run is still open
    assert d.finish() == ("", True) and d.text == "ok " and decode(tok, ids[: d.num_tokens]) == "ok "
