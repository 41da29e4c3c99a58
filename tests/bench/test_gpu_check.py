"""The GPU regression guard's logic on synthetic results (no GPU): cells from the benches' JSON rows,
the comparison with a baseline of the same GPU model only, the first run writing the baseline,
stages under time limits and a budget."""

from __future__ import annotations

import json
import sys

import pytest

from chunkgen.bench import gpu_check as gc

H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
META = {"torch": "2.11.0+cu130", "cuda": "13.0", "arch": "9.0", "date": "2026-11-26", "commit": "abc1234",
        "command": "make gpu-check"}  # fmt: skip


def kernel_row(impl: str, us: float, n_s: int = 2048) -> dict:
    return dict(n_p=2048, n_s=n_s, batch=32, q_heads=9, kv_heads=3, head_dim=64, chunk=64, dtype="bfloat16",
                device="cuda", impl=impl, us=us, q_dtype="bfloat16", cpu_path=None)  # fmt: skip


def e2e_row(system: str, decode_s: float, prefill_s: float, tok_s: float, rows: int = 32) -> dict:
    return dict(system=system, n_shared=2048, n_queries=rows, max_new_tokens=64, dtype="bf16", max_batch=str(rows),
                wall_s=decode_s + prefill_s, prefill_s=prefill_s, decode_s=decode_s, gen_tokens_per_s=tok_s,
                outputs_equal_to_hf=None, round=1)  # fmt: skip


def test_cells_are_keyed_by_shape_and_say_which_way_is_better():
    k = gc.kernel_cells([kernel_row("chunk_tpp", 255.0), kernel_row("sdpa", 127.0)])
    key = "kernel bfloat16 b32 h9/3 d64 c64 n_p=2048 n_s=2048 chunk_tpp"
    assert k[key] == gc.Cell(255.0, "us")
    assert k[key.replace("chunk_tpp", "sdpa")].control
    e = gc.e2e_cells([e2e_row("chunkgen", 0.256, 0.6, 12_000.0, rows=256)], "smollm2-135m")
    base = "e2e smollm2-135m bf16 rows=256 n_shared=2048 chunkgen"
    assert e[f"{base} decode_ms_step"].value == pytest.approx(4.0)  # 0.256 s over 64 steps
    assert e[f"{base} gen_tok_s"].higher_is_better and not e[f"{base} prefill_s"].higher_is_better
    assert f"{base} decode_kernels_step" not in e  # not counted (the CPU, an eager step)
    counted = gc.e2e_cells([{**e2e_row("chunkgen", 0.3, 0.2, 4000.0), "decode_kernels_per_step": 515}], "m")
    assert counted["e2e m bf16 rows=32 n_shared=2048 chunkgen decode_kernels_step"] == gc.Cell(515.0, "kernels")


def test_a_profiled_step_gives_a_graph_time_cell_and_a_report_section(tmp_path):
    """bench e2e's step profile (CUDA graphs only): the graph's GPU time is held to the baseline like
    any time, and the report lists the step's kernels by time."""
    gemm = "sm90_xmma_gemm_bf16bf16_bf16f32"
    row = {**e2e_row("chunkgen", 0.3, 0.2, 4000.0, rows=256), "decode_kernels_per_step": 400,
           "decode_kernels_note": "torch profiler over 3 replays", "decode_graph_us": 2600.0,
           "decode_kernel_us": 2100.0, "decode_top_kernels": [{"name": gemm, "us": 900.0, "calls": 120.0}]}  # fmt: skip
    cells = gc.e2e_cells([row, e2e_row("hf", 1.0, 1.0, 1000.0, rows=256)], "m")
    assert cells["e2e m bf16 rows=256 n_shared=2048 chunkgen decode_graph_us"] == gc.Cell(2600.0, "us")
    assert not any("hf decode_graph_us" in k for k in cells)
    stages, results = _stages_with(tmp_path, [kernel_row("chunk_tpp", 250.0)], [row])
    _, files = gc.finish(H100, META, stages, results, tmp_path / "r", tmp_path / "b")
    report = files[-2].read_text()
    assert "## Where a decode step's time goes" in report
    assert "A step's graph: 2,600 us on the GPU; its 400 kernels 2,100 us of it" in report
    assert f"| `{gemm}` | 900 | 120 |" in report


def test_compare_flags_cells_slower_than_the_threshold_in_either_direction():
    base = {
        "t_ok": gc.Cell(100.0, "us"),
        "t_slow": gc.Cell(100.0, "us"),
        "tput_slow": gc.Cell(1000.0, "tok/s", True),
        "tput_ok": gc.Cell(1000.0, "tok/s", True),
        "gone": gc.Cell(1.0, "s"),
    }
    now = {
        "t_ok": gc.Cell(114.0, "us"),  # 1.14x: within the threshold
        "t_slow": gc.Cell(116.0, "us"),
        "tput_slow": gc.Cell(860.0, "tok/s", True),  # 1000/860 = 1.163x slower
        "tput_ok": gc.Cell(2000.0, "tok/s", True),  # twice as fast
        "new": gc.Cell(1.0, "s"),
    }
    c = gc.compare(base, now)
    assert [v.key for v in c.slower()] == ["t_slow", "tput_slow"]
    assert [v.key for v in c.faster()] == ["tput_ok"]
    assert c.missing == ["gone"] and c.new == ["new"]
    assert gc.slowdown(gc.Cell(5.0, "tok/s", True), gc.Cell(0.0, "tok/s", True)) == float("inf")


def test_control_median_separates_a_slower_card_from_a_slower_chunkgen():
    base = {"sdpa": gc.Cell(100.0, "us", control=True), "ours": gc.Cell(100.0, "us")}
    c = gc.compare(base, {"sdpa": gc.Cell(130.0, "us", control=True), "ours": gc.Cell(130.0, "us")})
    assert c.control_median() == pytest.approx(1.3)
    assert gc.compare({"ours": base["ours"]}, {"ours": base["ours"]}).control_median() is None


def test_device_slug_and_a_baseline_of_another_gpu_is_refused(tmp_path):
    assert gc.device_slug(H100) == "nvidia-h100-80gb-hbm3"
    with pytest.raises(ValueError):
        gc.device_slug("  ")
    path = gc.baseline_path(tmp_path, H100)
    path.write_text(json.dumps(gc.baseline_record("NVIDIA H100 80GB HBM3 ", META, {})))  # same slug, other name
    with pytest.raises(ValueError, match="not of this GPU"):
        gc.load_baseline(path, H100)
    assert gc.load_baseline(gc.baseline_path(tmp_path, H200), H200) is None


def _stages_with(tmp_path, kernel_rows, e2e_rows) -> tuple[list[gc.Stage], list[gc.StageResult]]:
    k, e = tmp_path / "k.json", tmp_path / "e.json"
    k.write_text(json.dumps(kernel_rows))
    e.write_text(json.dumps(e2e_rows))
    stages = [gc.Stage("kernel", [], 1, k, kind="kernel"), gc.Stage("e2e", [], 1, e, kind="e2e", label="m")]
    return stages, [gc.StageResult("kernel", "ok", 1.0), gc.StageResult("e2e", "ok", 1.0)]


def test_first_run_writes_the_baseline_then_a_later_run_is_held_to_it(tmp_path):
    results_dir, baseline_dir = tmp_path / "results", tmp_path / "baselines"
    work = tmp_path / "w1"
    work.mkdir()
    stages, results = _stages_with(work, [kernel_row("chunk_tpp", 250.0), kernel_row("sdpa", 125.0)],
                                   [e2e_row("chunkgen", 0.3, 0.2, 4000.0)])  # fmt: skip
    status, files = gc.finish(H100, META, stages, results, results_dir, baseline_dir)
    assert status == 0
    assert gc.baseline_path(baseline_dir, H100) in files
    report = (results_dir / "2026-11-26-gpu-check-nvidia-h100-80gb-hbm3.md").read_text()
    assert "No baseline for NVIDIA H100 80GB HBM3 existed" in report and "commit it" in report
    assert json.loads(gc.baseline_path(baseline_dir, H100).read_text())["device"] == H100

    # The kernel 1.3x slower, the engine's throughput the same: one cell flagged, status 1.
    work = tmp_path / "w2"
    work.mkdir()
    stages, results = _stages_with(work, [kernel_row("chunk_tpp", 325.0), kernel_row("sdpa", 126.0)],
                                   [e2e_row("chunkgen", 0.3, 0.2, 4000.0)])  # fmt: skip
    status, files = gc.finish(H100, META, stages, results, results_dir, baseline_dir)
    assert status == 1
    assert gc.baseline_path(baseline_dir, H100) not in files  # an existing baseline is kept
    report = files[0].read_text()
    assert "**1 of 5 cells slower than 1.15x the baseline**" in report
    assert "| kernel bfloat16 b32 h9/3 d64 c64 n_p=2048 n_s=2048 chunk_tpp | 250 us | 325 us | 1.30x |" in report
    record = json.loads(files[1].read_text())
    assert [v["key"] for v in record["slower"]] == ["kernel bfloat16 b32 h9/3 d64 c64 n_p=2048 n_s=2048 chunk_tpp"]
    assert "1.30x" in gc.summary(results, files)

    # Another GPU model is never compared with the H100's figures: it gets a baseline of its own.
    status, files = gc.finish(H200, META, stages, results, results_dir, baseline_dir)
    assert status == 0 and gc.baseline_path(baseline_dir, H200) in files


def test_an_incomplete_run_writes_no_baseline_and_fails(tmp_path):
    stages, results = _stages_with(tmp_path, [kernel_row("chunk_tpp", 250.0)], [])
    results[1] = gc.StageResult("e2e", "timed out after 120 s", 120.0, "last lines")
    status, files = gc.finish(H100, META, stages, results, tmp_path / "r", tmp_path / "b")
    assert status == 1
    assert not gc.baseline_path(tmp_path / "b", H100).exists()
    report = files[0].read_text()
    assert "this run is incomplete: none was written" in report and "## e2e: timed out after 120 s" in report


def test_stages_run_under_their_limits_and_the_budget(tmp_path):
    py = sys.executable
    stages = [
        gc.Stage("build", [py, "-c", "print('built')"], 30),
        gc.Stage("hangs", [py, "-c", "import time; print('started', flush=True); time.sleep(30)"], 1.0),
        gc.Stage("fails", [py, "-c", "raise SystemExit(3)"], 30),
        gc.Stage("late", [py, "-c", "print('x')"], 30),
    ]
    lines: list[str] = []
    results = gc.run_stages(stages, budget_s=60.0, cwd=tmp_path, log=lines.append)
    assert [r.status for r in results] == ["ok", "timed out after 1 s", "failed (rc 3)", "ok"]
    assert "started" in results[1].tail  # what a hung stage printed is kept for the report
    spent = gc.run_stages(stages[:1], budget_s=4.0, cwd=tmp_path, log=lines.append)
    assert spent[0].status == "skipped: the time budget is spent"
    broken = gc.run_stages([gc.Stage("build", [py, "-c", "raise SystemExit(1)"], 30), stages[3]], 60, tmp_path,
                           lines.append)  # fmt: skip
    assert broken[1].status == "skipped: the build failed"


def test_an_optional_stage_left_out_for_time_does_not_fail_the_run(tmp_path):
    py = sys.executable
    stages = [
        gc.Stage("slow", [py, "-c", "import time; time.sleep(1.5)"], 30),
        gc.Stage("extra", [py, "-c", "print('x')"], 30, optional=True),
        gc.Stage("needed", [py, "-c", "print('x')"], 30),
    ]
    results = gc.run_stages(stages, budget_s=6.0, cwd=tmp_path, log=lambda line: None)
    assert [r.status for r in results] == ["ok", gc.SKIPPED_FOR_TIME, gc.SKIPPED_FOR_TIME]
    assert [r.passes for r in results] == [True, True, False]
    failing = gc.run_stages([gc.Stage("extra", [py, "-c", "raise SystemExit(2)"], 30, optional=True)], 60, tmp_path,
                            lambda line: None)  # fmt: skip
    assert failing[0].status == "failed (rc 2)" and not failing[0].passes  # optional is about time only


def test_default_stages_cover_the_issue_grid(tmp_path):
    stages = gc.default_stages("python3", tmp_path, "9.0")
    names = [s.name for s in stages]
    assert names == ["requirements", "build", "tests/kernels/test_cuda.py", "bench kernel bf16", "bench e2e 32 rows",
                     "bench e2e 256 rows", "bench e2e 256 rows, batch-invariant",
                     "bench linear bf16", "bench e2e 256 rows, prefill group by group"]  # fmt: skip
    by_name = dict(zip(names, stages))
    assert by_name["build"].env["TORCH_CUDA_ARCH_LIST"] == "9.0" and by_name["build"].env["CHUNKGEN_CUDA"] == "1"
    assert by_name["requirements"].argv[-1] == str(tmp_path / "site")
    extra = by_name["bench e2e 256 rows, prefill group by group"]
    assert extra.env == {"CHUNKGEN_PREFILL_VARLEN": "0"} and extra.optional
    assert [s.name for s in stages if s.optional] == [extra.name]
    e2e = by_name["bench e2e 256 rows, batch-invariant"].argv
    assert e2e[e2e.index("--n-queries") + 1] == "256" and e2e[e2e.index("--max-batch") + 1] == "256"
    assert all("--device" in s.argv and "cuda" in s.argv for s in stages if s.kind)  # every bench
    assert e2e[e2e.index("--kv-memory") + 1] == "8GiB"  # not auto: hf shares the GPU


def test_the_stages_name_only_options_their_commands_have(tmp_path):
    """Each bench stage's command line parses (typer's own parser, no run): a renamed option would
    otherwise surface only on a GPU, as a failed stage."""
    import click
    import typer

    from chunkgen.cli import app

    root = typer.main.get_command(app)
    for st in (s for s in gc.default_stages("python3", tmp_path, "9.0") if s.kind):
        args = st.argv[st.argv.index("chunkgen") + 1 :]
        group = root.get_command(click.Context(root), args[0])
        cmd = group.get_command(click.Context(group), args[1])
        cmd.make_context(args[1], list(args[2:]), resilient_parsing=False)


def test_the_check_times_batch_invariant_numerics_beside_the_default(tmp_path):
    """A 256-row chunkgen run with --batch-invariant on, its cells keyed apart from the default
    run's, so the first GPU check says what the mode costs there."""
    stages = gc.default_stages("python", tmp_path, None)
    inv = [st for st in stages if "--batch-invariant" in st.argv]
    assert len(inv) == 1 and inv[0].kind == "e2e"
    argv = inv[0].argv
    assert argv[argv.index("--batch-invariant") + 1] == "on" and argv[argv.index("--n-queries") + 1] == "256"
    assert inv[0].label != gc.E2E_MODEL and inv[0].json_out not in [st.json_out for st in stages if st is not inv[0]]


def test_the_check_times_the_invariant_linear_product_against_cublas(tmp_path):
    """The linear layers' share of that cost, per shape and rows: cuBLAS's cells are controls (they
    move with the card), the invariant product's are chunkgen's and held to the baseline."""
    (stage,) = [st for st in gc.default_stages("python", tmp_path, None) if st.kind == "linear"]
    rows = [dict(n=960, k=576, rows=32, dtype="bfloat16", impl=impl, us=us, tflops=0.0, vs_cublas=us / 4.0)
            for impl, us in (("cublas", 4.0), ("invariant", 9.5))]  # fmt: skip
    stage.json_out.write_text(json.dumps(rows))
    cells, _ = gc.collect_cells([stage], [gc.StageResult(stage.name, "ok", 1.0)])
    assert cells["linear bfloat16 960x576 rows=32 invariant"] == gc.Cell(9.5, "us")
    assert cells["linear bfloat16 960x576 rows=32 cublas"].control


def test_main_runs_the_stages_with_the_requirements_site_on_their_path(tmp_path, monkeypatch):
    """The whole run as a lent machine makes it, with the GPU and the stages stood in for: every stage
    finds the requirements stage's site folder on its path, the report, the first baseline and the
    log are written and copied to the return folder, and the exit status is 0."""
    work, out = tmp_path / "work", tmp_path / "out"
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setattr(gc, "gpu_identity", lambda: (H200, {"torch": "2.11.0+cu130", "cuda": "13.0", "arch": "9.0"}))
    rows = json.dumps([kernel_row("chunk_tpp", 250.0), kernel_row("sdpa", 125.0)])
    site_first = f"import os, sys; assert sys.path.index({str(work / 'site')!r}) < len(sys.path), sys.path"
    write = f"{site_first}; open({str(work / 'kernel.json')!r}, 'w').write({rows!r})"

    def stages(python, work_dir, arch):
        assert work_dir == work and arch == "9.0"
        return [
            gc.Stage("requirements", [python, "-c", "print('met')"], 30),
            gc.Stage("bench kernel bf16", [python, "-c", write], 30, work / "kernel.json", kind="kernel"),
        ]

    monkeypatch.setattr(gc, "default_stages", stages)
    argv = ["--results-dir", str(tmp_path / "results"), "--baseline-dir", str(tmp_path / "baselines"),
            "--work-dir", str(work), "--copy-to", str(out)]  # fmt: skip
    assert gc.main(argv) == 0
    names = sorted(p.name for p in out.iterdir())
    assert "gpu-check.log" in names and "nvidia-h200.json" in names
    assert any(n.endswith("-gpu-check-nvidia-h200.md") for n in names)
    report = next(out.glob("*-gpu-check-nvidia-h200.md")).read_text()
    assert "| requirements | ok |" in report and "No baseline for NVIDIA H200 existed" in report
