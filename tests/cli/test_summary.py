"""What a run's summary says about where it ran: the device and the KV budget, each with its reason."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from chunkgen import device as devmod
from chunkgen.cli import app
from chunkgen.device import choose_device
from tests.helpers import base_args

runner = CliRunner()


def test_the_run_summary_names_the_device_and_the_kv_budget(tiny_model, tmp_path):
    out = tmp_path / "out.jsonl"
    argv = base_args(
        tiny_model, out, kv_memory=None, quiet=None, max_new_tokens=2, json_log=True
    )  # the KV budget: auto
    res = runner.invoke(app, argv, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads([l for l in res.output.splitlines() if '"summary"' in l][-1])
    want = choose_device("auto", devmod.detect())
    assert summary["device"] == f"{want.device} ({want.reason})"
    if want.device == "cpu":
        assert summary["kv_memory"].startswith("4.0 GiB (auto: 4.0 GiB on the CPU")
        assert summary["batch_invariant"].startswith("on: a row's answer")
    argv = base_args(tiny_model, tmp_path / "off.jsonl", quiet=None, max_new_tokens=2, json_log=True)
    res = runner.invoke(app, [*argv, "--batch-invariant", "off"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads([l for l in res.output.splitlines() if '"summary"' in l][-1])
    assert summary["batch_invariant"].startswith("off (--batch-invariant off)")


def test_the_summary_says_where_answers_do_not_depend_on_the_batch():
    """On by default on the CPU; off when asked; on the GPU off by default, on when asked."""
    from types import SimpleNamespace

    from chunkgen.cli.loading import invariance_text

    def text(on: bool, device: str, auto: bool) -> str:
        config = SimpleNamespace(batch_invariant=on, device=device, auto=frozenset({"batch_invariant"} if auto else ()))
        return invariance_text(config)

    assert text(True, "cpu", auto=True).startswith("on:")
    assert text(False, "cpu", auto=False).startswith("off (--batch-invariant off)")
    assert text(True, "cuda:0", auto=False).startswith("on:")
    assert text(False, "cuda:0", auto=True).startswith("off on the GPU by default")
    assert text(False, "cuda:0", auto=False).startswith("off (--batch-invariant off)")
