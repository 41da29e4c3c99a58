"""bench e2e: its count of kernels a decode step (where it is counted, what it leaves out), and whole
runs of the command on random weights (a row per batch, parity with transformers, the memory check)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from chunkgen import device as devmod
from chunkgen.bench.e2e import is_kernel, kernel_time_by_name, profile_decode_step
from chunkgen.cli import app
from tests.helpers import cli_args

runner = CliRunner()


def engine_on(device: str, capture=None):
    runner = SimpleNamespace(device=torch.device(device), largest_capture=lambda: capture)
    return SimpleNamespace(runner=runner)


def test_kernels_are_counted_on_cuda_graphs_only_and_say_why_not():
    prof = profile_decode_step(engine_on("cpu"))
    assert prof.kernels is None and prof.top == [] and "CUDA only" in prof.note
    prof = profile_decode_step(engine_on("cuda"))  # stepped eagerly: no graph to count
    assert prof.kernels is None and prof.graph_us is None and "eagerly" in prof.note


def test_a_steps_kernel_time_by_name():
    """Per replay: the kernels, their summed time, and the names ranked by time (copies left out,
    long template names cut)."""
    gemm, attn = "sm90_xmma_gemm_bf16bf16_bf16f32", "void chunkgen::sequence_first_kernel<" + "x" * 300 + ">"
    events = [(gemm, 10.0), (attn, 4.0), ("Memcpy HtoD (Pinned -> Device)", 50.0), (gemm, 6.0)] * 2
    kernels, us, top = kernel_time_by_name(events, replays=2, top=1)
    assert kernels == 3 and us == pytest.approx(20.0)
    assert top == [{"name": gemm, "us": pytest.approx(16.0), "calls": 2.0}]
    _, _, top = kernel_time_by_name(events, replays=2)
    assert [r["name"] for r in top] == [gemm, attn[:160]] and top[1]["us"] == pytest.approx(4.0)


def test_copies_and_fills_are_not_kernels():
    assert is_kernel("void chunkgen::(anonymous namespace)::sequence_first_kernel<__nv_bfloat16, false>(...)")
    assert is_kernel("sm90_xmma_gemm_bf16bf16_bf16f32")
    assert not is_kernel("Memcpy HtoD (Pinned -> Device)") and not is_kernel("Memset (Device)")


def test_a_text_workload_without_the_shipped_templates_says_where_it_looked(tmp_path, monkeypatch):
    from chunkgen.bench import e2e

    monkeypatch.setattr(e2e, "PROMPTS_DIR", tmp_path)  # an install without the source tree's prompts/
    llm = SimpleNamespace(tokenizer=SimpleNamespace(ids_only=False))
    with pytest.raises(e2e.NoTemplates, match=f"{tmp_path}, which holds no \\*.toml.*pip install -e"):
        e2e.build_workload(llm, 64, 2, 3)
    with pytest.raises(e2e.NoTemplates, match="tool_dispatcher.schema.json"):
        e2e.tool_calls_schema()


# -- whole runs: the command, random weights, memory ----------------------------------------------
def test_bench_e2e_dummy_weights_on_a_tiny_config_matches_transformers(tiny_config, tmp_path):
    out = tmp_path / "rows.json"
    res = runner.invoke(
        app,
        cli_args(
            ["bench", "e2e"],
            dummy_weights=tiny_config,
            dtype="fp32",
            n_shared=80,
            n_queries=3,
            max_new_tokens=6,
            systems="hf,chunkgen",
            device="cpu",
            json=out,
        ),
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert "device cpu (as asked)" in res.output and "KV budget " in res.output
    assert "(auto: " in res.output.split("KV budget ", 1)[1].splitlines()[0]  # --kv-memory's default
    rows = {r["system"]: r for r in json.loads(out.read_text())}
    assert rows["chunkgen"]["outputs_equal_to_hf"] >= 2  # random weights: a near tie may flip one
    assert rows["chunkgen"]["kv_peak_bytes"] > 0


def test_bench_e2e_gives_a_row_per_batch_and_the_first_round_apart(tiny_config, tmp_path):
    out = tmp_path / "rows.json"
    res = runner.invoke(
        app,
        cli_args(
            ["bench", "e2e"],
            dummy_weights=tiny_config,
            dtype="fp32",
            n_shared=40,
            n_queries=3,
            max_new_tokens=3,
            repeat=2,
            systems="chunkgen",
            max_batch="auto,2",
            json=out,
        ),
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    rows = {r["max_batch"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"auto", "2"} and rows["auto"]["peak_batch"] == 3 and rows["2"]["peak_batch"] == 2
    assert all(len(r["gen_tokens_per_s_runs"]) == 2 for r in rows.values())
    assert "round 1 gen tok/s" in res.output and "auto (peak 3)" in res.output
    bad = runner.invoke(app, ["bench", "e2e", "--dummy-weights", str(tiny_config), "--max-batch", "auto,zero"])
    assert bad.exit_code == 2 and "--max-batch" in bad.output


def test_bench_e2e_auto_batch_admits_rows_as_run_does(tiny_config, tmp_path):
    """`--max-batch auto` is run's auto: at most AUTO_MAX_BATCH rows, admitted by the engine's rule
    (a job of more rows than that opens it in parts: tests/engine/test_scheduler.py), so the bench
    measures what a run does; a number runs that wide."""
    from chunkgen.config import AUTO_MAX_BATCH

    out = tmp_path / "rows.json"
    rows = AUTO_MAX_BATCH + 8
    args = cli_args(["bench", "e2e"], dummy_weights=tiny_config, dtype="fp32", n_shared=40, n_queries=rows)
    args += cli_args([], max_new_tokens=16, systems="chunkgen", max_batch=f"auto,{rows}", json=out)
    res = runner.invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    by_batch = {r["max_batch"]: r for r in json.loads(out.read_text())}
    assert by_batch["auto"]["peak_batch"] <= AUTO_MAX_BATCH < by_batch[str(rows)]["peak_batch"] == rows


@pytest.mark.real_model
def test_bench_e2e_dummy_smollm2_shapes_use_the_default_tokenizer(default_model_dir, tmp_path):
    from chunkgen.llm import LLM

    llm = LLM(dummy_weights="smollm2-135m", dtype="bf16", device="cpu", kv_memory="64MiB")
    assert not getattr(llm.tokenizer, "ids_only", False) and llm.model.dtype == torch.bfloat16
    out = tmp_path / "rows.json"
    res = runner.invoke(
        app,
        cli_args(
            ["bench", "e2e"],
            dummy_weights="smollm2-135m",
            dtype="bf16",
            device="cpu",
            n_shared=64,
            n_queries=2,
            max_new_tokens=3,
            systems="chunkgen_paged,chunkgen",
            json=out,
        ),
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())
    assert [r["system"] for r in rows] == ["chunkgen_paged", "chunkgen"] and all(r["dtype"] == "bf16" for r in rows)


def test_bench_e2e_refuses_weights_that_do_not_fit(monkeypatch):
    monkeypatch.setattr(devmod, "free_bytes", lambda device: 8 << 30)
    res = runner.invoke(app, ["bench", "e2e", "--dummy-weights", "llama-2-7b", "--dtype", "fp32", "--device", "cpu"])
    assert res.exit_code == 1 and "more than the 8.0 GiB memory available" in res.output
    assert "--dtype bf16 halves it" in res.output and "leave hf out of --systems" in res.output
    res = runner.invoke(app, ["bench", "e2e", "--dummy-weights", "no-such-model", "--device", "cpu"])
    assert res.exit_code == 1 and "not a shipped config" in res.output
