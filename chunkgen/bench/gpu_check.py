"""The GPU regression guard (`make gpu-check`): build with CUDA, run the CUDA tests, time `bench
kernel` and `bench e2e` (32 and 256 rows) on the GPU at hand, and hold every timed cell against the
committed baseline of that same GPU model.

One run fits one lent-GPU call: each stage runs as a subprocess under its own time limit and the
whole under a budget (6 minutes by default), so a hung stage costs its limit, not the call.

A cell is one figure of one row (a kernel's median us, an engine's decode ms a step, prefill s,
generated tokens/s) under a key that names its shape. Baselines live in
`benchmarks/gpu-baselines/<device>.json`, one file per GPU model (the name torch gives, e.g. "NVIDIA
H100 80GB HBM3"), so an H100 is compared with H100 figures only. Without a baseline for the GPU at
hand the run writes one from its own figures and says so; it never changes an existing baseline
unless asked (--write-baseline, after an intended change). The result (a Markdown table and the
same as JSON) goes to `benchmarks/results/`, and is also copied to $OUT when that is set (the lent
machine's return folder).

The torch-only cells (sdpa, naive, transformers' generate) are controls: when they moved as much
as chunkgen's cells, the card or the torch build changed, not chunkgen.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

THRESHOLD = 1.15  # a cell this much slower than its baseline is a regression
BUDGET_S = 360.0  # the whole run: one lent-GPU call
SKIPPED_FOR_TIME = "skipped: the time budget is spent"
ROOT = Path(__file__).resolve().parents[2]
CONTROL_IMPLS = ("sdpa", "naive", "hf", "cublas")  # torch's own kernels: they move with the card, not with chunkgen
E2E_MODEL = "smollm2-135m"
E2E_ROWS = (32, 256)
E2E_SYSTEMS = "hf,chunkgen_noshare,chunkgen"
E2E_KV_MEMORY = "8GiB"  # fixed, not auto (85% of the GPU): transformers' generate runs in the same process


@dataclass(frozen=True)
class Cell:
    """One timed figure: `value` in `unit`; `higher_is_better` for throughputs."""

    value: float
    unit: str
    higher_is_better: bool = False
    control: bool = False  # torch's kernels, not chunkgen's


@dataclass
class Stage:
    """One step of the run: a command, its time limit, and the JSON file it leaves (if any)."""

    name: str
    argv: list[str]
    timeout_s: float
    json_out: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    kind: str = ""  # "kernel", "linear" or "e2e": how its JSON turns into cells
    label: str = ""  # the e2e model name, for its cells' keys
    optional: bool = False  # run only with budget to spare: skipped for time, the run still passes


@dataclass
class StageResult:
    name: str
    status: str  # "ok", "failed (rc N)", "timed out after N s", "skipped: ..."
    seconds: float
    tail: str = ""
    optional: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def passes(self) -> bool:
        """Whether the run can pass with it: ran well, or optional and left out for time."""
        return self.ok or (self.optional and self.status == SKIPPED_FOR_TIME)


# -- cells ----------------------------------------------------------------------------------------


def kernel_cells(rows: Sequence[dict]) -> dict[str, Cell]:
    """`bench kernel --json` rows: one cell per (dtype, shape, impl), the median us."""
    cells = {}
    for r in rows:
        key = (
            f"kernel {r['dtype']} b{r['batch']} h{r['q_heads']}/{r['kv_heads']} d{r['head_dim']} c{r['chunk']} "
            f"n_p={r['n_p']} n_s={r['n_s']} {r['impl']}"
        )
        cells[key] = Cell(float(r["us"]), "us", control=r["impl"] in CONTROL_IMPLS)
    return cells


def linear_cells(rows: Sequence[dict]) -> dict[str, Cell]:
    """`bench linear --device cuda --json` rows: one cell per (dtype, shape, rows, impl), the median
    us; cuBLAS's are controls, the batch-invariant product's are chunkgen's."""
    return {
        f"linear {r['dtype']} {r['n']}x{r['k']} rows={r['rows']} {r['impl']}": Cell(
            float(r["us"]), "us", control=r["impl"] in CONTROL_IMPLS
        )
        for r in rows
    }


def e2e_cells(rows: Sequence[dict], model: str) -> dict[str, Cell]:
    """`bench e2e --json` rows: per (model, dtype, rows, n_shared, system), the decode ms a step,
    the prefill s, the generated tokens/s and, where counted, the kernels a decode step launches."""
    cells = {}
    for r in rows:
        base = f"e2e {model} {r['dtype']} rows={r['n_queries']} n_shared={r['n_shared']} {r['system']}"
        control = r["system"] in CONTROL_IMPLS
        steps = max(int(r["max_new_tokens"]), 1)
        cells[f"{base} decode_ms_step"] = Cell(1e3 * float(r["decode_s"]) / steps, "ms", control=control)
        cells[f"{base} prefill_s"] = Cell(float(r["prefill_s"]), "s", control=control)
        cells[f"{base} gen_tok_s"] = Cell(float(r["gen_tokens_per_s"]), "tok/s", True, control)
        if r.get("decode_kernels_per_step") is not None:  # more kernels a step: slower, whatever the clock says
            cells[f"{base} decode_kernels_step"] = Cell(float(r["decode_kernels_per_step"]), "kernels")
        if r.get("decode_graph_us") is not None:  # the step's graph alone on the GPU, no host in it
            cells[f"{base} decode_graph_us"] = Cell(float(r["decode_graph_us"]), "us")
    return cells


def step_profiles(rows: Sequence[dict], model: str) -> list[str]:
    """Markdown: where each profiled decode step's GPU time goes (bench e2e's top kernels)."""
    lines: list[str] = []
    for r in rows:
        if not r.get("decode_top_kernels"):
            continue
        graph, kern = r.get("decode_graph_us"), r.get("decode_kernel_us")
        lines += [
            f"### {model} {r['dtype']} rows={r['n_queries']} n_shared={r['n_shared']} {r['system']}",
            "",
            f"A step's graph: {_fmt(graph)} us on the GPU; its {r['decode_kernels_per_step']} kernels "
            f"{_fmt(kern)} us of it ({r['decode_kernels_note']}).",
            "",
            "| kernel | us a step | calls a step |",
            "|---|---:|---:|",
            *[f"| `{k['name']}` | {_fmt(k['us'])} | {k['calls']:g} |" for k in r["decode_top_kernels"]],
            "",
        ]
    return lines


def cells_to_json(cells: dict[str, Cell]) -> dict[str, dict]:
    return {k: asdict(c) for k, c in sorted(cells.items())}


def cells_from_json(data: dict[str, dict]) -> dict[str, Cell]:
    return {k: Cell(**v) for k, v in data.items()}


# -- comparison -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    key: str
    baseline: float
    now: float
    unit: str
    slowdown: float  # > 1: slower than the baseline (time up, or throughput down)
    control: bool

    @property
    def regressed(self) -> bool:
        return self.slowdown > THRESHOLD


@dataclass
class Comparison:
    verdicts: list[Verdict]
    missing: list[str]  # in the baseline, not measured now (a failed or skipped stage, a changed grid)
    new: list[str]  # measured now, not in the baseline
    threshold: float = THRESHOLD

    def slower(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.slowdown > self.threshold]

    def faster(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.slowdown < 1 / self.threshold]

    def control_median(self) -> float | None:
        """The median slowdown of the torch-only cells: near 1 when the card and torch are as before."""
        ratios = [v.slowdown for v in self.verdicts if v.control]
        return statistics.median(ratios) if ratios else None


def slowdown(base: Cell, now: Cell) -> float:
    """How many times slower `now` is than `base` (inf when a throughput fell to 0 or a time from 0)."""
    if base.higher_is_better:
        return base.value / now.value if now.value > 0 else float("inf")
    if base.value <= 0:
        return 1.0 if now.value <= 0 else float("inf")
    return now.value / base.value


def compare(baseline: dict[str, Cell], now: dict[str, Cell], threshold: float = THRESHOLD) -> Comparison:
    verdicts = [
        Verdict(k, baseline[k].value, now[k].value, now[k].unit, slowdown(baseline[k], now[k]), now[k].control)
        for k in sorted(baseline.keys() & now.keys())
    ]
    return Comparison(verdicts, sorted(baseline.keys() - now.keys()), sorted(now.keys() - baseline.keys()), threshold)


# -- baselines ------------------------------------------------------------------------------------


def device_slug(name: str) -> str:
    """A file name for a GPU model: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not slug:
        raise ValueError(f"no file name can be made of the device name {name!r}")
    return slug


def baseline_path(baseline_dir: Path, device: str) -> Path:
    return baseline_dir / f"{device_slug(device)}.json"


def load_baseline(path: Path, device: str) -> dict[str, Cell] | None:
    """The baseline cells for `device`, or None when there is none. A file whose device differs
    (two GPU models with one slug) is refused: the point is never to compare across models."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("device") != device:
        raise ValueError(f"{path}: baseline of {data.get('device')!r}, not of this GPU ({device!r})")
    return cells_from_json(data["cells"])


def baseline_record(device: str, meta: dict, cells: dict[str, Cell]) -> dict:
    return {"device": device, **meta, "cells": cells_to_json(cells)}


# -- the report -----------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.3g}"


def report_markdown(
    device: str,
    meta: dict,
    stages: list[StageResult],
    cells: dict[str, Cell],
    comparison: Comparison | None,
    baseline_note: str,
    profiles: Sequence[str] = (),
) -> str:
    lines = [
        f"# GPU check, {meta['date']}: {device}",
        "",
        f"Commit {meta['commit']}; torch {meta['torch']} (CUDA {meta['cuda']}); command `{meta['command']}`.",
        "Figures measured by this run on this GPU, one run each (bench kernel: median of its repeats).",
        "",
        "| stage | status | s |",
        "|---|---|---:|",
        *[f"| {s.name} | {s.status} | {s.seconds:.0f} |" for s in stages],
        "",
        baseline_note,
        "",
    ]
    if comparison is not None:
        slower = comparison.slower()
        lines.append(
            f"**{len(slower)} of {len(comparison.verdicts)} cells slower than {comparison.threshold:.2f}x the "
            "baseline**" + (":" if slower else ".")
        )
        ctrl = comparison.control_median()
        if ctrl is not None:
            lines.append(
                f"Torch-only control cells (sdpa, naive, cuBLAS, hf): median {ctrl:.2f}x"
                + (
                    " -- the card or torch moved too; compare ratios, not figures."
                    if ctrl > comparison.threshold
                    else "."
                )
            )
        lines.append("")
        if slower:
            lines += ["| cell | baseline | now | slower |", "|---|---:|---:|---:|"]
            lines += [
                f"| {v.key}{' (control)' if v.control else ''} | {_fmt(v.baseline)} {v.unit} | {_fmt(v.now)} {v.unit} "
                f"| {v.slowdown:.2f}x |"
                for v in sorted(slower, key=lambda v: -v.slowdown)
            ]
            lines.append("")
        faster = comparison.faster()
        if faster:
            lines.append(f"{len(faster)} cells faster than 1/{comparison.threshold:.2f} of the baseline.")
        if comparison.missing:
            lines.append(f"Not measured this time ({len(comparison.missing)}): " + "; ".join(comparison.missing))
        if comparison.new:
            lines.append(f"New cells, not in the baseline ({len(comparison.new)}): " + "; ".join(comparison.new))
        lines.append("")
    lines += ["## Every cell", "", "| cell | now |", "|---|---:|"]
    lines += [f"| {k} | {_fmt(c.value)} {c.unit} |" for k, c in sorted(cells.items())]
    if profiles:
        lines += ["", "## Where a decode step's time goes", "", *profiles]
    failed = [s for s in stages if not s.ok and s.tail]
    for s in failed:
        lines += ["", f"## {s.name}: {s.status}", "", "```", s.tail.rstrip(), "```"]
    return "\n".join(lines) + "\n"


# -- running --------------------------------------------------------------------------------------


def default_stages(python: str, work: Path, arch: str | None) -> list[Stage]:
    """The project's requirements, build, test, then the timed benches (each writing JSON into
    `work`). What this python lacks is installed from carried wheels into `work`/site, which
    main() puts on every stage's path (chunkgen/bench/gpu_deps.py)."""
    build_env = {"CHUNKGEN_CUDA": "1", "MAX_JOBS": str(os.cpu_count() or 4)}
    if arch:
        build_env["TORCH_CUDA_ARCH_LIST"] = arch  # only the GPU at hand: a shorter build
    chunkgen = [python, "-m", "chunkgen"]
    stages = [
        Stage("requirements", [python, "-m", "chunkgen.bench.gpu_deps", str(work / "site")], 60),
        Stage("build", [python, "setup.py", "-q", "build_ext", "--inplace"], 180, env=build_env),
        Stage("tests/kernels/test_cuda.py", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                              "tests/kernels/test_cuda.py"], 120),
        Stage(
            "bench kernel bf16",
            [*chunkgen, "bench", "kernel", "--device", "cuda", "--kv-dtype", "bf16", "--repeats", "20",
             "--json", str(work / "kernel-bf16.json")],
            90,
            work / "kernel-bf16.json",
            kind="kernel",
        ),
    ]  # fmt: skip

    def e2e(name: str, rows: int, systems: str, file: str, limit: float, label: str, *extra: str, **stage) -> Stage:
        """A bench e2e stage on the E2E_MODEL workload at `rows` rows (batch = rows)."""
        out = work / file
        argv = [*chunkgen, "bench", "e2e", "--device", "cuda", "--dtype", "bf16", "--dummy-weights", E2E_MODEL,
                "--n-shared", "2048", "--max-new-tokens", "64", "--n-queries", str(rows), "--max-batch", str(rows),
                "--kv-memory", E2E_KV_MEMORY, *extra, "--systems", systems, "--json", str(out)]  # fmt: skip
        return Stage(name, argv, limit, out, kind="e2e", label=label, **stage)

    for rows in E2E_ROWS:
        stages.append(e2e(f"bench e2e {rows} rows", rows, E2E_SYSTEMS, f"e2e-{rows}.json", 120, E2E_MODEL))
    # The cost of batch-invariant numerics on the GPU (off there by default until this is known):
    # chunkgen alone at 256 rows with --batch-invariant on, beside the 256-row stage above.
    stages.append(
        e2e("bench e2e 256 rows, batch-invariant", 256, "chunkgen", "e2e-256-invariant.json", 90,
            f"{E2E_MODEL} batch-invariant", "--batch-invariant", "on")
    )  # fmt: skip
    # The linear layers' part of that cost: cuBLAS against the batch-invariant product per shape.
    out = work / "linear-bf16.json"
    stages.append(
        Stage("bench linear bf16", [*chunkgen, "bench", "linear", "--device", "cuda", "--json", str(out)], 60, out,
              kind="linear")
    )  # fmt: skip
    # Last and optional (it takes only what the budget has left): prefill a group or lone sequence
    # at a time, as before the variable-length products (kernels/varlen.py), beside the 256-row
    # stage's chunkgen_noshare and chunkgen: what they save.
    stages.append(
        e2e("bench e2e 256 rows, prefill group by group", 256, "chunkgen_noshare,chunkgen",
            "e2e-256-group-by-group-prefill.json", 90, f"{E2E_MODEL} prefill group by group",
            env={"CHUNKGEN_PREFILL_VARLEN": "0"}, optional=True)
    )  # fmt: skip
    return stages


def run_stages(stages: list[Stage], budget_s: float, cwd: Path, log) -> list[StageResult]:
    """Each stage in turn under min(its limit, what is left of the budget); after a failed build
    nothing else can run."""
    results: list[StageResult] = []
    t_start = time.monotonic()
    for st in stages:
        left = budget_s - (time.monotonic() - t_start)
        if any(r.name == "build" and not r.ok for r in results):
            results.append(StageResult(st.name, "skipped: the build failed", 0.0))
            continue
        if left < 5:
            results.append(StageResult(st.name, SKIPPED_FOR_TIME, 0.0, optional=st.optional))
            continue
        limit = min(st.timeout_s, left)
        log(f"== {st.name} (limit {limit:.0f} s): {' '.join(st.argv)}")
        env = {**os.environ, **st.env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(cwd), env.get("PYTHONPATH", "")) if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                st.argv, cwd=cwd, env=env, timeout=limit, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            out, status = proc.stdout, "ok" if proc.returncode == 0 else f"failed (rc {proc.returncode})"
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            status = f"timed out after {limit:.0f} s"
        seconds = time.monotonic() - t0
        log(out.rstrip())
        log(f"== {st.name}: {status} ({seconds:.0f} s)")
        results.append(StageResult(st.name, status, seconds, "\n".join(out.splitlines()[-40:])))
    return results


def collect_cells(stages: list[Stage], results: list[StageResult]) -> tuple[dict[str, Cell], list[str]]:
    """Cells of every timed stage that left its JSON (a timed-out stage's file is not there), and
    the e2e stages' step profiles."""
    cells: dict[str, Cell] = {}
    profiles: list[str] = []
    for st, res in zip(stages, results):
        if not st.json_out or not res.ok or not st.json_out.exists():
            continue
        rows = json.loads(st.json_out.read_text())
        if st.kind == "kernel":
            cells.update(kernel_cells(rows))
        elif st.kind == "linear":
            cells.update(linear_cells(rows))
        else:
            cells.update(e2e_cells(rows, st.label))
            profiles += step_profiles(rows, st.label)
    return cells, profiles


def gpu_identity() -> tuple[str, dict]:
    """The GPU's model name, and torch's and CUDA's versions (torch imported here only)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu-check: no CUDA GPU is visible to torch; nothing to check")
    name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    return name, {"torch": torch.__version__, "cuda": torch.version.cuda, "arch": f"{major}.{minor}"}


def commit_of(cwd: Path) -> str:
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown (no git here: pass COMMIT=...)"


def finish(
    device: str,
    meta: dict,
    stages: list[Stage],
    results: list[StageResult],
    results_dir: Path,
    baseline_dir: Path,
    write_baseline: bool = False,
    threshold: float = THRESHOLD,
) -> tuple[int, list[Path]]:
    """Compare, write the report (and a first baseline); returns the exit status and the files
    written. Status 0: every stage ran and no cell is slower than the threshold; 1 otherwise."""
    cells, profiles = collect_cells(stages, results)
    path = baseline_path(baseline_dir, device)
    baseline = load_baseline(path, device)
    written: list[Path] = []
    comparison = None
    if baseline is not None:
        comparison = compare(baseline, cells, threshold)
    if baseline is None or write_baseline:
        if cells and all(r.passes for r in results):
            baseline_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(baseline_record(device, meta, cells), indent=2) + "\n")
            written.append(path)
            note = (
                f"No baseline for {device} existed: this run's {len(cells)} cells were written as its baseline "
                f"({path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}); commit it."
                if baseline is None
                else f"The baseline of {device} was replaced by this run's cells (--write-baseline)."
            )
        else:
            note = f"No baseline for {device}, and this run is incomplete: none was written."
    else:
        note = (
            f"Baseline: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} (threshold {threshold:.2f}x)."
        )
    stem = f"{meta['date']}-gpu-check-{device_slug(device)}"
    results_dir.mkdir(parents=True, exist_ok=True)
    md = results_dir / f"{stem}.md"
    md.write_text(report_markdown(device, meta, results, cells, comparison, note, profiles))
    js = results_dir / f"{stem}.json"
    record = {
        **baseline_record(device, meta, cells),
        "stages": [asdict(r) for r in results],
        "baseline_note": note,
        "slower": [asdict(v) for v in comparison.slower()] if comparison else [],
        "missing": comparison.missing if comparison else [],
    }
    js.write_text(json.dumps(record, indent=2) + "\n")
    written += [md, js]
    ok = all(r.passes for r in results) and (comparison is None or not comparison.slower())
    return (0 if ok else 1), written


def summary(results: list[StageResult], files: list[Path]) -> str:
    """The stages' statuses and the report's verdict lines, for the end of the output."""
    report = files[-2].read_text().splitlines()
    verdict = [ln for ln in report if ln.startswith(("**", "Torch-only", "No baseline", "Baseline:", "The baseline"))]
    slower = [ln for ln in report if ln.startswith("| ") and ln.endswith("x |")]
    return "\n".join(
        ["== gpu-check summary", *[f"  {r.name}: {r.status} ({r.seconds:.0f} s)" for r in results], *verdict, *slower]
        + [f"  wrote {f}" for f in files]
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chunkgen.bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's time limit")
    ap.add_argument("--threshold", type=float, default=THRESHOLD)
    ap.add_argument("--skip-build", action="store_true", help="the CUDA extension is already built in place")
    ap.add_argument("--write-baseline", action="store_true", help="replace this GPU's baseline with this run")
    ap.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--baseline-dir", type=Path, default=ROOT / "benchmarks" / "gpu-baselines")
    ap.add_argument("--work-dir", type=Path, default=ROOT / "build" / "gpu-check",
                    help="the stages' JSON, the log and the requirements' site folder (emptied first)")  # fmt: skip
    ap.add_argument("--copy-to", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                    help="also copy the result files and the log here (default: $OUT when set)")  # fmt: skip
    args = ap.parse_args(argv)

    device, meta = gpu_identity()
    now = _dt.datetime.now(_dt.UTC)
    meta = {
        **meta,
        "date": now.strftime("%Y-%m-%d"),
        "time_utc": now.strftime("%H:%M"),
        "commit": commit_of(ROOT),
        "command": "make gpu-check",
    }
    work = args.work_dir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log_path = work / "gpu-check.log"

    def log(text: str) -> None:
        print(text, flush=True)
        with log_path.open("a") as f:
            f.write(text + "\n")

    log(f"gpu-check: {device}, torch {meta['torch']}, CUDA {meta['cuda']}, commit {meta['commit']}")
    stages = default_stages(sys.executable, work, meta["arch"])
    if args.skip_build:
        stages = [s for s in stages if s.name != "build"]
    # The requirements stage installs what this python lacks here; every stage after it finds it.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(work / "site"), os.environ.get("PYTHONPATH")) if p)
    results = run_stages(stages, args.budget_s, ROOT, log)
    status, files = finish(
        device, meta, stages, results, args.results_dir, args.baseline_dir, args.write_baseline, args.threshold
    )
    print(files[-2].read_text())
    print(summary(results, files))  # last: a lent machine's reply keeps only the output's end
    if args.copy_to:
        args.copy_to.mkdir(parents=True, exist_ok=True)
        for f in [*files, log_path]:
            shutil.copy(f, args.copy_to / f.name)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
