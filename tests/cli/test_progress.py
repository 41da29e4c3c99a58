"""Progress outside a terminal: a line when the model starts and ends loading, and a line at least
every PROGRESS_EVERY_S even while one long engine step holds the main thread."""

from __future__ import annotations

import json
import re
import time

from typer.testing import CliRunner

import chunkgen.cli as cli
import chunkgen.cli.bench_e2e as bench_e2e
import chunkgen.cli.progress as progress
from chunkgen.engine.engine import Engine
from tests.helpers import base_args

runner = CliRunner()


def _slow_first_step(monkeypatch, seconds: float) -> None:
    step = Engine.step
    calls = []

    def slow(self):
        if not calls:
            time.sleep(seconds)  # stands for a prefill wave of minutes
        calls.append(1)
        return step(self)

    monkeypatch.setattr(Engine, "step", slow)


def _run(tiny_model, tmp_path, *extra: str):
    args = [*base_args(tiny_model, tmp_path / "out.jsonl", quiet=None, max_new_tokens=2, dtype=None), *extra]
    res = runner.invoke(cli.app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def test_lines_while_loading_and_during_a_long_step(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "TTY", False)
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.4)
    _slow_first_step(monkeypatch, 2.0)
    out = _run(tiny_model, tmp_path)
    lines = out.splitlines()
    from chunkgen.device import choose_device, detect

    device = choose_device("auto", detect()).device  # the default --device, as the run resolves it
    # the default --dtype and --quantize
    assert lines[0].startswith(f"loading {tiny_model.name} (auto, {device}, --quantize auto)")
    assert re.match(rf"loaded {tiny_model.name} in [0-9.]+ s", lines[1])
    waiting = [l for l in lines if "first prefill wave running for" in l]
    assert len(waiting) >= 3  # about every 0.4 s of the 2 s step, not one line after it
    assert any(re.match(r"progress: \d+/12 rows done", l) for l in lines)  # counted against the file's rows
    assert re.search(r"requests answered\W+12\b", out)


def test_json_log_has_load_events_and_beats_during_a_long_step(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "JSON_PROGRESS_EVERY_S", 0.4)
    _slow_first_step(monkeypatch, 2.0)
    out = _run(tiny_model, tmp_path, "--json-log")
    events = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["model_loading", "model_loaded"] and kinds[-1] == "summary"
    beats = [e for e in events if e["event"] == "progress" and e["step_running_s"] >= 0.4]
    assert len(beats) >= 3


def test_quiet_prints_no_load_or_progress_lines(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "TTY", False)
    out = _run(tiny_model, tmp_path, "--quiet")
    assert "loading" not in out and "progress:" not in out


def test_bench_e2e_says_which_round_runs_and_that_it_still_does(tiny_model, monkeypatch):
    monkeypatch.setattr(bench_e2e, "PROGRESS_EVERY_S", 0.4)
    _slow_first_step(monkeypatch, 1.5)
    res = runner.invoke(
        cli.app,
        [
            "bench",
            "e2e",
            "--model",
            str(tiny_model),
            "--quick",
            "--n-queries",
            "2",
            "--max-new-tokens",
            "2",
            "--systems",
            "chunkgen",
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    lines = [l.strip() for l in res.output.splitlines()]
    start = lines.index("chunkgen n_shared=512 round 1: running…")
    assert any(l.startswith("chunkgen n_shared=512 round 1: still running") for l in lines[start:])
    assert any(l.startswith("chunkgen n_shared=512 round 1: ") and "tok/s" in l for l in lines[start:])
