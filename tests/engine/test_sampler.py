"""Sampling: the kept set and the draw's distribution against a sort-based reference, seeded
reproducibility whatever the batch, seeds of several samples, and parameter checks."""

from __future__ import annotations

import math

import pytest
import torch

from chunkgen.engine import sampler
from chunkgen.engine.logits import Penalties, StepLogprobs
from chunkgen.engine.params import MAX_SEED, ParamError, SamplingParams
from chunkgen.engine.sampler import (
    FALLBACKS,
    SamplingBatch,
    StepReader,
    _cut,
    draw,
    make_generator,
    sample,
    sample_seed,
)
from tests.helpers import OpLog, copies_into, host_work


def reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution sampling must follow, by the book: top-k keeps every token tied with the
    k-th; top-p keeps the shortest prefix, by probability then token id, whose mass reaches p."""
    s = logits.double() / temperature
    if top_k:
        s = s.masked_fill(s < s.topk(min(top_k, s.numel())).values[-1], -math.inf)
    probs = s.softmax(-1)
    if top_p < 1.0:
        order = sorted(range(probs.numel()), key=lambda i: (-probs[i].item(), i))
        keep, mass = [], 0.0
        for i in order:
            if mass >= top_p:
                break
            keep.append(i)
            mass += probs[i].item()
        kept = torch.zeros_like(probs, dtype=torch.bool)
        kept[keep] = True
        probs = probs * kept
    return probs / probs.sum()


def draw_many(logits: torch.Tensor, params: SamplingParams, n: int, first_seed: int = 0) -> torch.Tensor:
    """n draws for one row: n copies of it in one batch, each with its own seeded generator."""
    gens = [make_generator(SamplingParams(temperature=1.0, seed=first_seed + i), 0) for i in range(n)]
    return torch.tensor(sample(logits.expand(n, -1).contiguous(), [params] * n, gens))


def logits_with(kind: str, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * 2
    if kind == "ties":  # what bf16 logits look like: many exact ties, some at the cuts
        x = (x * 2).round() / 2
    return x


@pytest.mark.parametrize("kind", ["distinct", "ties"])
@pytest.mark.parametrize(
    "vocab,temperature,top_k,top_p",
    [
        (60, 1.0, 0, 1.0),
        (60, 0.7, 0, 0.9),
        (60, 1.3, 0, 0.5),
        (60, 1.0, 5, 1.0),
        (60, 1.0, 12, 0.8),
        (60, 0.8, 3, 0.3),
        (60, 1.0, 0, 0.05),
        (1000, 0.5, 0, 0.7),
        (1000, 1.0, 30, 1.0),  # kept tokens spread over several blocks of the draw
    ],
)
def test_draws_stay_in_the_kept_set_and_follow_its_distribution(kind, vocab, temperature, top_k, top_p):
    logits = logits_with(kind, vocab, seed=top_k + int(100 * top_p))
    ref = reference(logits, temperature, top_k, top_p)
    n = 20000
    draws = draw_many(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), n)
    freq = torch.bincount(draws, minlength=vocab).double() / n
    outside = set(draws.tolist()) - set(ref.nonzero().squeeze(1).tolist())
    assert not outside, f"drew tokens outside the kept set: {sorted(outside)}"
    assert (freq[ref > 0.01] > 0).all()
    sigma = (ref * (1 - ref) / n).sqrt()
    worst = ((freq - ref).abs() / (sigma + 1e-12))[ref > 0].max().item()
    assert worst < 5.0, f"a frequency is {worst:.1f} standard errors off the kept distribution"


@pytest.mark.parametrize("cap", [5000, 64])
@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 0.9),
        (0.6, 0, 0.99),
        (2.0, 0, 0.5),
        (1.0, 200, 0.9),
        (1.0, 3, 0.9),
        (1.0, 1500, 0.7),
        (1.0, 40, 1.0),
    ],
)
def test_the_kept_set_is_exactly_the_reference_on_a_large_vocabulary(temperature, top_k, top_p, cap):
    """Exactness where draws cannot tell: the weights left after the cut, against the reference,
    for rows of many shapes in one batch (flat, peaky, tied, with -inf entries)."""
    vocab = 5000
    g = torch.Generator().manual_seed(top_k)
    rows = [
        torch.randn(vocab, generator=g),
        torch.randn(vocab, generator=g) * 8,
        (torch.randn(vocab, generator=g) * 4).round() / 4,
        torch.randn(vocab, generator=g),
    ]
    rows[3][::3] = -math.inf
    rows[0][:8] = rows[0].max() + 1  # eight tokens tied at the top
    x = torch.stack(rows)
    s = (x - x.amax(dim=-1, keepdim=True)) / temperature
    w = s.exp()
    R = len(rows)
    short = _cut(s, w, torch.tensor([top_k] * R), torch.tensor([top_p] * R, dtype=torch.float64), max(cap, top_k + 1))
    if cap >= vocab:
        assert not short.any()
    for row, weights, unsettled in zip(s, w, short.tolist()):
        if unsettled:  # the candidate list was too short: sample() redoes such a row exactly
            continue
        ref = reference(row, 1.0, top_k, top_p)
        assert ((weights > 0) == (ref > 0)).all(), f"kept {int((weights > 0).sum())} tokens, not {int((ref > 0).sum())}"
        assert torch.allclose(weights.double() / weights.sum(), ref, atol=1e-6)


def test_seeded_rows_draw_the_same_alone_and_in_any_batch():
    vocab = 1000
    rng = torch.Generator().manual_seed(0)
    row = torch.randn(vocab, generator=rng) * 1.5
    mine = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    others = [
        SamplingParams(),
        SamplingParams(temperature=1.5, seed=7),
        SamplingParams(temperature=0.5, top_p=0.3),
        SamplingParams(temperature=1.0, top_k=5, seed=9),
    ]
    gen = make_generator(mine, 0)
    alone = [sample(row[None], [mine], [gen])[0] for _ in range(40)]
    assert len(set(alone)) > 5  # it does sample
    for at, size in ((0, 4), (3, 9), (35, 40)):  # first row, between greedy ones, past the first row group
        params = [others[i % len(others)] for i in range(size)]
        params[at] = mine
        gens = [make_generator(p, 0) for p in params]
        drawn = []
        for _ in range(40):
            logits = torch.randn(size, vocab, generator=rng) * 3  # the others change every step
            logits[at] = row
            drawn.append(sample(logits, params, gens)[at])
        assert drawn == alone, f"row {at} of {size} drew differently from the same row alone"


def test_greedy_rows_take_the_argmax_and_tiny_temperatures_are_greedy():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 50
    params = [
        SamplingParams(),
        SamplingParams(temperature=1e-300),
        SamplingParams(temperature=9e-6, seed=3),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=1e-5, seed=2),
        SamplingParams(),
    ]
    assert [p.greedy for p in params] == [True, True, True, False, False, True]
    gens = [make_generator(p, 0) for p in params]
    assert gens[1] is None and gens[2] is None
    out = sample(logits, params, gens)
    for i in (0, 1, 2, 5):
        assert out[i] == int(logits[i].argmax())
    assert all(0 <= t < 300 for t in out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 15, 16, 33, 300, 49_152])
def test_the_argmax_is_the_first_of_equals_on_any_row(dtype, n):
    """The CPU argmax op against torch.max's indices: random rows, rows of ties (bf16 makes them
    common), the maximum in the tail past the last full vector, NaN (its first index wins) and
    all -inf rows; fp32 and the model's bf16 logits."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(8, n, generator=gen).to(dtype)
    x[1] = 0  # all equal: index 0
    x[2, n // 2 :] = 7  # a run of equal maxima: its first
    x[3, -1] = 100  # in the tail
    x[4] = float("-inf")
    x[5, n // 3] = float("nan")
    x[5, -1] = float("nan")
    x[6, 0] = float("inf")
    x[7] = torch.randint(0, 3, (n,), generator=gen).to(dtype)  # many ties
    got = sampler._argmax(x)
    assert torch.equal(got, x.max(dim=-1).indices)
    assert got[5] == n // 3 and got[2] == n // 2 and got[1] == 0
    assert torch.equal(sampler._argmax(x[:, :].t().contiguous().t()), got)  # strided rows: torch's path


def test_rows_without_a_distribution_do_not_abort_the_batch():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(2))
    logits[0, 7] = math.nan
    logits[1] = -math.inf
    logits[2, 42] = math.inf
    logits[3] = 3e38
    logits[3, :50] = -3e38  # differences past the float range
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=i) for i in range(5)]
    out = sample(logits, params, [make_generator(p, 0) for p in params])
    assert out[0] != 7 and 0 <= out[0] < 100 and out[2] == 42 and 0 <= out[3] < 100
    assert out[4] == sample(logits[4:], params[4:], [make_generator(params[4], 0)])[0]


def test_samples_of_a_request_never_share_a_stream_with_another_request():
    def stream(seed: int, index: int) -> tuple[float, ...]:
        g = make_generator(SamplingParams(temperature=1.0, seed=seed, n=4), index)
        return tuple(torch.rand(4, generator=g, dtype=torch.float64).tolist())

    assert stream(1, 1) != stream(2, 0)  # seed + index would make these one stream
    assert sample_seed(5, 0) == 5  # a single sample keeps drawing what it always drew
    streams = [stream(s, i) for s in range(300) for i in range(4)]
    assert len(set(streams)) == len(streams)
    # torch's CPU generator keys its stream on a seed's low 32 bits: derived seeds keep clear of
    # every request seed below 2**31 there, and of each other
    low = [sample_seed(s, i) & 0xFFFFFFFF for s in range(2000) for i in range(1, 8)]
    assert min(low) >= 2**31 and len(set(low)) == len(low)


def test_seeds_span_63_bits():
    p = SamplingParams(temperature=1.0, seed=MAX_SEED, n=3)
    gens = [make_generator(p, i) for i in range(3)]
    assert all(0 <= t < 50 for t in sample(torch.zeros(3, 50), [p] * 3, gens))
    for bad in (2**63, 2**70, -1):
        with pytest.raises(ParamError) as e:
            SamplingParams(seed=bad)
        assert e.value.field == "seed"


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_new_tokens", -1),
        ("max_new_tokens", 5.0),
        ("max_new_tokens", "5"),
        ("max_new_tokens", True),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -0.1),
        ("temperature", "1"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_p", None),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", False),
        ("n", 0),
        ("n", 129),
        ("n", 2.0),
        ("seed", 1.0),
        ("seed", True),
        ("seed", "7"),
        ("stop", [""]),
        ("stop", [3]),
        ("stop", ["x"] * 17),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["2"]),
        ("stop_token_ids", 2),
        ("ignore_eos", "yes"),
    ],
)
def test_each_bad_value_is_a_param_error_naming_its_field(field, value):
    with pytest.raises(ParamError) as e:
        SamplingParams(**{field: value})
    assert isinstance(e.value, ValueError)
    assert e.value.field == field
    assert str(e.value) == f"{field} {e.value.message}"


def test_param_messages_read_well_and_good_values_are_normalised():
    with pytest.raises(ParamError, match=r"^temperature must be a number >= 0, got nan$"):
        SamplingParams(temperature=math.nan)
    with pytest.raises(ParamError, match=r"^max_new_tokens must be an integer >= 0, got 5\.0$"):
        SamplingParams(max_new_tokens=5.0)
    p = SamplingParams(temperature=1, top_p=1, stop="###", stop_token_ids=[5], seed=0, n=128)
    assert p.stop == ("###",) and p.stop_token_ids == (5,) and isinstance(p.temperature, float)
    assert p.as_dict()["stop"] == ["###"] and p.as_dict()["seed"] == 0
    with pytest.raises(AttributeError):
        p.n = 2  # type: ignore[misc]


def mixed_batch(rows: int = 32, vocab: int = 3000) -> tuple[torch.Tensor, list[SamplingParams]]:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(rows, vocab, generator=g) * 6  # peaky, as a trained model's: nuclei well inside the list
    kinds = [
        dict(),
        dict(temperature=0.8, top_k=50),
        dict(temperature=1.0, top_p=0.9),
        dict(temperature=0.7, top_k=40, top_p=0.8),
        dict(temperature=1.2),
    ]
    params = [
        SamplingParams(
            seed=i, logprobs=i % 3, presence_penalty=0.5 * (i % 2), frequency_penalty=0.3, **kinds[i % len(kinds)]
        )
        for i in range(rows)
    ]
    return logits, params


class _Seq:
    """What the penalty state reads of a sequence."""

    def __init__(self, i: int, params: SamplingParams) -> None:
        self.seq_id, self.params, self.finish_reason = i, params, None


@pytest.mark.parametrize("greedy", [True, False])
def test_a_step_reads_the_device_once_and_never_waits_on_it_before(greedy):
    """The common path of a step (greedy batch; seeded top-k / top-p / temperature rows with
    penalties and logprobs) under a dispatch log: no scalar read, nonzero, boolean-mask index or
    tensor from Python data, and one copy to the host, of tokens and logprobs together."""
    logits, params = mixed_batch()
    if greedy:
        params = [SamplingParams()] * len(params)
    gens = [make_generator(p, 0) for p in params]
    batch = SamplingBatch(params, gens, logits.device)  # once per batch composition
    penalties = Penalties(logits.shape[1], logits.device)
    pen = penalties.plan([_Seq(i, p) for i, p in enumerate(params)])
    reader = StepReader()
    reader.read(torch.zeros(4096, dtype=torch.float64))  # its buffer exists before the logged steps
    for _ in range(3):
        x = logits.clone()
        with OpLog() as log:
            lp = StepLogprobs(x, batch)
            if pen is not None:
                penalties.apply_(x, pen)
            tokens, short = draw(x, batch)
            parts = [tokens, lp.columns(tokens)] + ([short] if short is not None else [])
            read = reader.read(*parts)
            if pen is not None:
                penalties.count_(pen, tokens)
        assert host_work(log.calls) == {"syncs": [], "nonzero": [], "bool_index": [], "from_python": []}
        assert copies_into(log.calls, reader.buf) == 1
        assert short is None or not any(read[2])  # every row settled within its candidate list
        got = [int(t) for t in read[0]]
        if greedy:
            assert got == logits.argmax(dim=-1).tolist() and pen is None and short is None
    if not greedy:
        assert int(penalties.counts.sum()) == 3 * len(params)  # every sampled token counted once


def test_rows_the_candidate_list_cannot_settle_are_redone_exactly(monkeypatch):
    """A flat row's nucleus lies past the candidate list: the row is flagged, counted and drawn
    again over its whole vocabulary with the same uniform number, so it gets the token an
    unlimited list gives; the peaky rows beside it are not redone."""
    vocab = 5000
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(vocab, generator=g) * 0.1
    peaky = torch.randn(vocab, generator=g) * 8
    logits = torch.stack([peaky, flat, peaky, flat])
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in range(4)]
    for trial in range(20):
        gens = [make_generator(SamplingParams(temperature=1.0, seed=trial * 4 + i), 0) for i in range(4)]
        before = FALLBACKS.rows
        got = sample(logits, params, gens)
        assert FALLBACKS.rows - before == 2  # the flat rows only
        monkeypatch.setattr(sampler, "CANDIDATES", vocab)
        gens = [make_generator(SamplingParams(temperature=1.0, seed=trial * 4 + i), 0) for i in range(4)]
        assert sample(logits, params, gens) == got
        assert FALLBACKS.rows - before == 2  # an unlimited list settles every row
        monkeypatch.undo()


def test_top_k_ties_running_past_the_list_are_redone():
    """Top-k keeps every token tied with the k-th, even past the k + 1 the list holds."""
    logits = torch.zeros(1, 300)
    logits[0, :5] = 3.0
    params = [SamplingParams(temperature=1.0, top_k=2, seed=1)]
    before = FALLBACKS.rows
    draws = draw_many(logits[0], params[0], 2000)
    assert FALLBACKS.rows - before == 2000
    assert set(draws.tolist()) == set(range(5))  # all five tied tokens kept, none of the rest


@pytest.mark.parametrize("top_k,top_p", [(0, 0.7), (0, 0.95), (0, 0.3), (0, 0.05), (40, 0.9), (10, 0.8)])
def test_draws_follow_the_kept_distribution_when_the_candidate_list_is_short(monkeypatch, top_k, top_p):
    """With a candidate list shorter than many nuclei (rows settled on the device and rows redone
    on the host mixed), draws still stay in the reference's kept set at its frequencies."""
    monkeypatch.setattr(sampler, "CANDIDATES", 24)
    vocab = 400
    logits = logits_with("ties", vocab, seed=11) * 0.5
    ref = reference(logits, 1.0, top_k, top_p)
    n = 20000
    before = FALLBACKS.rows
    draws = draw_many(logits, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p), n)
    if int((ref > 0).sum()) > 24 and not top_k:  # the nucleus is longer than the list: every row redone
        assert FALLBACKS.rows - before == n
    freq = torch.bincount(draws, minlength=vocab).double() / n
    assert not set(draws.tolist()) - set(ref.nonzero().squeeze(1).tolist())
    sigma = (ref * (1 - ref) / n).sqrt()
    assert ((freq - ref).abs() / (sigma + 1e-12))[ref > 0].max().item() < 5.0
