"""The progress every run shows (chunkgen/progress.py): prefill before the first answer, a recent
rate, a time left, and no empty batch while rows are left."""

from __future__ import annotations

from chunkgen.progress import RECENT_S, Meter, Snapshot, format_seconds


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_prefill_moves_before_the_first_answer_then_rows_rate_and_eta():
    clock = Clock()
    meter = Meter(clock)
    clock.now = 1.0
    meter.update(Snapshot(0, 300, 0, 1800, 9000, 64))
    assert "prefill 1800/9000 prompt tokens" in meter.text()
    assert "ETA" not in meter.text()  # nothing finished yet: no pace to go by
    clock.now = 11.0
    meter.update(Snapshot(0, 300, 640, 9000, 9000, 64))
    assert "prefill" not in meter.text() and "64.0 tok/s" in meter.text()
    clock.now = 21.0
    meter.update(Snapshot(60, 300, 1280, 9000, 9000, 64))
    assert meter.eta_s == (300 - 60) * 20.0 / 60  # rows left at the recent pace of rows
    assert "60/300 rows done" in meter.text() and "ETA 1:20" in meter.text()


def test_the_rate_is_recent_not_since_the_start():
    clock = Clock()
    meter = Meter(clock)
    meter.update(Snapshot(0, 10, 0, 0, 0, 1))
    clock.now = 100.0  # a slow start (loading, the first prefill)
    meter.update(Snapshot(0, 10, 0, 0, 0, 1))
    for step in range(1, 40):
        clock.now = 100.0 + step
        meter.update(Snapshot(0, 10, 50 * step, 0, 0, 8))
    assert abs(meter.tokens_per_s - 50.0) < 1e-9  # over the last RECENT_S seconds only
    assert RECENT_S < 39


def test_no_empty_batch_is_shown_while_rows_are_left():
    meter = Meter(Clock())
    meter.update(Snapshot(44, 300, 10, 10, 10, 0))
    assert "batch" not in meter.text()


def test_format_seconds():
    assert [format_seconds(s) for s in (5, 65, 3725)] == ["5 s", "1:05", "1:02:05"]


def test_generate_progress_off_and_on(tiny_llm, capfd):
    from chunkgen.engine import SamplingParams

    params = SamplingParams(max_new_tokens=3)
    quiet = tiny_llm.generate(["a b", "c d"], params, progress=False)
    assert capfd.readouterr().err == ""
    shown = tiny_llm.generate(["a b", "c d"], params, progress=True)
    assert "generating" in capfd.readouterr().err
    assert [r.token_ids for r in quiet] == [r.token_ids for r in shown]
