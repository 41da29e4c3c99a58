"""The command line: wiring and printing only; the work lives in jobs/, engine/ and bench/."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.tree import Tree

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Offline batched generation on a prefix-aware chunked KV cache.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: the attention kernel, end to end.")
app.add_typer(bench_app, name="bench")
err = Console(stderr=True)
stdout = Console(width=None if sys.stdout.isatty() else 160)  # tables stay readable when piped

EXIT_BAD_INPUT_LINES = 3


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(1)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _read_items(queries: Path, template: Optional[Path], fmt: str, defaults: dict[str, Any], id_field: str):
    """(format, iterator of Job | ErrorRecord) for the query file; bad templates stop here."""
    from chunkgen.jobs.requests import detect_format, read_openai_jobs, read_template_jobs
    from chunkgen.jobs.templates import TemplateError, load_templates

    if not queries.is_file():
        _fail(f"{queries}: queries file not found")
    fmt = detect_format(queries) if fmt == "auto" else fmt
    if fmt == "openai":
        return fmt, read_openai_jobs(queries, defaults)
    if template is None:
        _fail(f"{queries} holds template rows: pass --template (a .toml file or a directory of them)")
    try:
        templates = load_templates(template)
    except TemplateError as exc:
        _fail(str(exc))
    return fmt, read_template_jobs(queries, templates, defaults, id_field)


def _load_llm(model: Optional[str], **kwargs):
    from chunkgen.llm import LLM
    from chunkgen.model import ModelNotFound, UnsupportedModel

    try:
        with err.status("loading model…"):
            return LLM(model=model, **kwargs)
    except (ModelNotFound, UnsupportedModel, ValueError) as exc:
        _fail(str(exc))


@app.command()
def run(
    queries: Path = typer.Option(..., "--queries", "-q", help="JSONL queries, or an OpenAI batch file."),
    out: Path = typer.Option(..., "--out", "-o", help="Results JSONL (one line per finished request)."),
    template: Optional[Path] = typer.Option(None, "--template", "-t", help="A .toml template or a directory of them."),
    model: Optional[str] = typer.Option(None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)."),
    dtype: str = typer.Option("fp32", help="Weights and activations: fp32 or bf16 (fp16/bf16 on GPU)."),
    device: str = typer.Option("cpu", help="cpu, or cuda for the GPU kernels."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Default for rows that do not set it."),
    temperature: Optional[float] = typer.Option(None),
    top_p: Optional[float] = typer.Option(None),
    top_k: Optional[int] = typer.Option(None),
    seed: Optional[int] = typer.Option(None),
    stop: Optional[list[str]] = typer.Option(None, help="Stop string (repeatable)."),
    max_batch: int = typer.Option(32, help="Sequences decoded together."),
    kv_memory: str = typer.Option("4GiB", help="KV cache budget, e.g. 2GiB."),
    chunk_size: int = typer.Option(64, help="Tokens per KV chunk (multiple of 16)."),
    resume: bool = typer.Option(False, help="Continue an interrupted run: skip ids already in --out."),
    ordered: bool = typer.Option(False, help="Write results in input order (buffers finished ones)."),
    fmt: str = typer.Option("auto", "--format", help="auto, template or openai."),
    id_field: str = typer.Option("id", help="Field of each row that holds its id."),
    no_share: bool = typer.Option(False, help="Disable prefix sharing (for comparisons)."),
    shard: Optional[str] = typer.Option(None, help="i/N: run only shard i of N (split by prompt prefix)."),
    use_ray: bool = typer.Option(False, "--ray", help="Run on a Ray cluster with Ray Data (pip install chunkgen[ray])."),
    workers: int = typer.Option(2, help="With --ray: engine actors."),
    ray_address: Optional[str] = typer.Option(None, help="With --ray: cluster address (default: start a local one)."),
    quiet: bool = typer.Option(False, help="No progress bar; summary only."),
    json_log: bool = typer.Option(False, help="Progress and summary as JSON lines on stderr."),
) -> None:
    """Generate an answer for every query and stream them to --out."""
    from chunkgen.jobs.results import OutputExists, ResultWriter
    from chunkgen.jobs.run import run_job

    if fmt not in ("auto", "template", "openai"):
        _fail(f"--format must be auto, template or openai, not {fmt!r}")
    defaults = {k: v for k, v in dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                      top_k=top_k, seed=seed, stop=stop).items() if v is not None}
    fmt, items = _read_items(queries, template, fmt, defaults, id_field)
    if shard is not None:
        from chunkgen.scale.shard import Shard

        try:
            part = Shard.parse(shard)
        except ValueError as exc:
            _fail(str(exc))
        items = (item for item in items if part.owns(item))
    llm_kwargs = dict(model=model, dtype=dtype, chunk_size=chunk_size, kv_memory=kv_memory,
                      max_batch=max_batch, share_prefix=not no_share, device=device)
    if use_ray:
        _run_ray(items, out, fmt, llm_kwargs, resume, ordered, workers, ray_address)
        return
    llm = _load_llm(**llm_kwargs)
    try:
        writer = ResultWriter(out, fmt, model_name=llm.model_path.name, resume=resume, ordered=ordered)
    except (OutputExists, ValueError) as exc:
        _fail(str(exc))

    progress = None
    task = None
    if not quiet and not json_log:
        progress = Progress(
            TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=err, transient=False,
        )
        progress.start()
        task = progress.add_task("run", total=None, info="")

    def on_progress(p) -> None:
        info = (f"{p.generated_tokens / p.elapsed_s:6.1f} tok/s  batch {p.running:3d}  "
                f"KV {_human(p.kv_used_bytes)}  cache hits {100 * p.cache_hit_rate:4.1f}%")
        if progress is not None:
            progress.update(task, completed=p.done, total=p.total, info=info)
        elif json_log:
            print(json.dumps({"event": "progress", **p.__dict__}), file=sys.stderr, flush=True)

    try:
        summary = run_job(llm.engine, llm.encode, items, writer, llm.model.max_context, on_progress)
    finally:
        if progress is not None:
            progress.stop()
    if json_log:
        print(json.dumps({"event": "summary", **summary.__dict__}), file=sys.stderr, flush=True)
    else:
        table = Table(title=f"chunkgen run → {out}", show_header=False)
        table.add_row("requests answered", str(summary.requests))
        table.add_row("skipped (already in output)", str(summary.skipped))
        table.add_row("bad input lines", str(summary.errors))
        table.add_row("wall time", f"{summary.wall_s:.1f} s (prefill {summary.prefill_s:.1f} s, decode {summary.decode_s:.1f} s)")
        table.add_row("generated tokens", f"{summary.completion_tokens} ({summary.tokens_per_s:.1f} tok/s)")
        table.add_row("prompt tokens (from cache)", f"{summary.prompt_tokens} ({summary.cached_tokens})")
        table.add_row("peak KV memory", f"{_human(summary.kv_peak_bytes)} (without sharing: {_human(summary.kv_unshared_peak_bytes)})")
        err.print(table)
    if summary.errors:
        err.print(f"[yellow]{summary.errors} bad input line(s) were written as error records to {out}[/]")
        raise typer.Exit(EXIT_BAD_INPUT_LINES)


def _run_ray(items, out: Path, fmt: str, llm_kwargs: dict, resume: bool, ordered: bool, workers: int,
             address: Optional[str]) -> None:
    import time

    from chunkgen.jobs.results import OutputExists, ResultWriter
    from chunkgen.model import ModelNotFound, resolve_model

    try:
        import ray  # noqa: F401
    except ImportError:
        _fail("--ray needs Ray Data: pip install 'chunkgen[ray]'")
    from chunkgen.scale.ray import run_on_ray

    try:
        model_dir = resolve_model(llm_kwargs["model"])  # convert a GGUF once, before the workers start
    except ModelNotFound as exc:
        _fail(str(exc))
    llm_kwargs = {**llm_kwargs, "model": str(model_dir)}
    try:
        writer = ResultWriter(out, fmt, model_name=model_dir.name, resume=resume, ordered=ordered)
    except (OutputExists, ValueError) as exc:
        _fail(str(exc))
    t0 = time.perf_counter()
    counts = run_on_ray(items, writer, llm_kwargs, workers, address=address)
    err.print(f"ray: {counts['records']} records written, {counts['skipped']} already done, "
              f"{counts['errors']} bad line(s); {time.perf_counter() - t0:.1f} s with {workers} workers → {out}")
    if counts["errors"]:
        raise typer.Exit(EXIT_BAD_INPUT_LINES)


@app.command("inspect-tree")
def inspect_tree(
    queries: Path = typer.Option(..., "--queries", "-q"),
    template: Optional[Path] = typer.Option(None, "--template", "-t"),
    model: Optional[str] = typer.Option(None),
    chunk_size: int = typer.Option(64),
    dtype: str = typer.Option("fp32", help="KV dtype the figures assume."),
    fmt: str = typer.Option("auto", "--format"),
    id_field: str = typer.Option("id"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the figures as JSON here."),
) -> None:
    """Insert every prompt into a prefix tree (no model run) and show sharing and memory."""
    from transformers import AutoConfig, AutoTokenizer

    from chunkgen.cache import ChunkPool, PrefixTree
    from chunkgen.cache.stats import tree_stats
    from chunkgen.jobs.requests import ErrorRecord
    from chunkgen.llm import encode_prompt
    from chunkgen.model import ModelNotFound, parse_dtype, resolve_model

    _, items = _read_items(queries, template, fmt, {}, id_field)
    try:
        path = resolve_model(model)
    except ModelNotFound as exc:
        _fail(str(exc))
    tok = AutoTokenizer.from_pretrained(path)
    cfg = AutoConfig.from_pretrained(path)
    kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    pool = ChunkPool(cfg.num_hidden_layers, kv_heads, head_dim, chunk_size, parse_dtype(dtype),
                     budget_bytes=1 << 62, storage=False)
    tree = PrefixTree(pool)
    bad = 0
    for item in items:
        if isinstance(item, ErrorRecord):
            bad += 1
            continue
        tree.insert(item.id, encode_prompt(tok, item.messages))
        tree.mark_ready(item.id)
    st = tree_stats(tree)
    figures = {"sequences": st.sequences, "tokens": st.tokens, "chunks_shared": st.chunks_shared,
               "chunks_unshared": st.chunks_unshared, "bytes_shared": st.bytes_shared,
               "bytes_unshared": st.bytes_unshared, "sharing_ratio": st.sharing_ratio,
               "prefill_tokens_saved": st.cache_hit_tokens, "bad_lines": bad}
    view = Tree(f"[bold]prefix forest[/] ({st.sequences} prompts, chunk {chunk_size})")
    _draw(tree.root, view)
    console = stdout
    console.print(view)
    table = Table(title="KV memory for these prompts", show_header=True)
    table.add_column("")
    table.add_column("chunks", justify="right")
    table.add_column("bytes", justify="right")
    table.add_row("with sharing", str(st.chunks_shared), _human(st.bytes_shared))
    table.add_row("without sharing", str(st.chunks_unshared), _human(st.bytes_unshared))
    console.print(table)
    console.print(f"sharing ratio {100 * st.sharing_ratio:.1f}%  ·  prefill tokens saved "
                  f"{st.cache_hit_tokens} of {st.inserted_tokens}  ·  alignment loss {100 * st.alignment_loss:.1f}%")
    if json_out:
        json_out.write_text(json.dumps(figures, indent=2) + "\n")


def _draw(node, view: Tree) -> None:
    """Shared runs are collapsed into one line; a fan-out of private tails is summarised."""
    for child in node.children:
        run, cur = 1, child
        while len(cur.children) == 1 and cur.children[0].ref == cur.ref:
            cur, run = cur.children[0], run + 1
        if cur.ref <= 1 and not cur.children:
            continue
        branch = view.add(f"{run} chunk(s) shared by {cur.ref} prompts")
        private = sum(1 for c in cur.children if c.ref <= 1)
        if private:
            branch.add(f"[dim]{private} private tail(s)[/]")
        _draw(cur, branch)


@bench_app.command("kernel")
def bench_kernel(
    quick: bool = typer.Option(False, help="A small subset that runs in seconds."),
    dtype: Optional[str] = typer.Option(None, help="KV dtype: fp32 or bf16 on the CPU (default fp32); "
                                                   "fp16, bf16 or fp32 on CUDA (default fp16)."),
    device: str = typer.Option("cpu", help="cpu, or cuda for the GPU kernels."),
    json_out: Optional[Path] = typer.Option(None, "--json"),
    repeats: int = typer.Option(10, help="Timed runs per cell (median reported)."),
    impls: str = typer.Option("naive,sdpa,paged,paged_shared,chunk_tpp", help="Implementations to time."),
) -> None:
    """Decode attention latency, paper Table 3 style: naive, sdpa, paged, paged_shared, chunk_tpp."""
    import torch

    from chunkgen._native import native_cuda_available
    from chunkgen.bench.kernel import IMPLS, default_grid, run_grid
    from chunkgen.model import parse_dtype

    chosen = tuple(i.strip() for i in impls.split(",") if i.strip())
    if not chosen or set(chosen) - set(IMPLS):
        _fail(f"--impls takes a subset of {','.join(IMPLS)}")
    on_cuda = device.startswith("cuda")
    if on_cuda and not (torch.cuda.is_available() and native_cuda_available()):
        _fail("--device cuda needs a CUDA GPU, a CUDA build of torch and chunkgen built with its CUDA kernels")
    kv_dtype = parse_dtype(dtype or ("fp16" if on_cuda else "fp32"))
    if not on_cuda and kv_dtype == torch.float16:
        _fail("the CPU kernel takes fp32 or bf16 K/V; fp16 is for --device cuda")
    rows = run_grid(default_grid(quick), kv_dtype, repeats=3 if quick else repeats, impls=chosen, device=device,
                    on_row=lambda r: err.print(f"  {r['impl']:>13} n_p={r['n_p']} n_s={r['n_s']} "
                                               f"H={r['q_heads']}/{r['kv_heads']}: {r['us']:.0f} us", highlight=False))
    _print_kernel_table(rows)
    if json_out:
        json_out.write_text(json.dumps(rows, indent=2) + "\n")


@bench_app.command("e2e")
def bench_e2e(
    model: Optional[str] = typer.Option(None),
    n_shared: str = typer.Option("1024,2048", help="Shared prompt lengths in tokens, comma-separated."),
    n_queries: int = typer.Option(32),
    max_new_tokens: int = typer.Option(64),
    max_batch: int = typer.Option(32),
    dtype: str = typer.Option("fp32"),
    systems: str = typer.Option(",".join(("hf", "chunkgen_noshare", "chunkgen_paged", "chunkgen")),
                                help="Subset of hf, chunkgen_noshare, chunkgen_paged, chunkgen."),
    quick: bool = typer.Option(False, help="512 shared tokens, 8 queries, 16 new tokens."),
    json_out: Optional[Path] = typer.Option(None, "--json"),
) -> None:
    """Whole runs side by side: transformers generate vs chunkgen without sharing, paged, full."""
    from chunkgen.bench.e2e import SYSTEMS, run_e2e

    chosen = [s.strip() for s in systems.split(",") if s.strip()]
    unknown = set(chosen) - set(SYSTEMS)
    if unknown:
        _fail(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    chosen = [s for s in SYSTEMS if s in chosen]  # hf first: the others are compared with it
    if quick:
        n_shared, n_queries, max_new_tokens = "512", 8, 16
    lengths = [int(x) for x in n_shared.split(",")]
    llm = _load_llm(model, dtype=dtype, max_batch=max_batch, kv_memory="8GiB")
    rows = run_e2e(llm, lengths, n_queries, max_new_tokens, chosen, dtype,
                   on_row=lambda r: err.print(f"  {r['system']:>16} n_shared={r['n_shared']}: "
                                              f"{r['gen_tokens_per_s']:.1f} tok/s, wall {r['wall_s']:.1f} s",
                                              highlight=False))
    table = Table(title=f"end to end: {n_queries} queries, {max_new_tokens} new tokens, {dtype}")
    for col in ("system", "n_shared", "wall s", "prefill s", "decode s", "gen tok/s", "decode tok/s",
                "KV peak", "RSS peak", "= hf"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["system"], str(r["n_shared"]), f"{r['wall_s']:.1f}", f"{r['prefill_s']:.1f}",
                      f"{r['decode_s']:.1f}", f"{r['gen_tokens_per_s']:.1f}", f"{r['decode_tokens_per_s']:.1f}",
                      _human(r["kv_peak_bytes"]), _human(r["rss_peak_bytes"]),
                      "-" if r["outputs_equal_to_hf"] is None else f"{r['outputs_equal_to_hf']}/{r['n_queries']}")
    stdout.print(table)
    if json_out:
        json_out.write_text(json.dumps(rows, indent=2) + "\n")


@bench_app.command("step")
def bench_step(
    model: Optional[str] = typer.Option(None),
    n_shared: int = typer.Option(2048),
    n_queries: int = typer.Option(32),
    steps: int = typer.Option(30),
    dtype: str = typer.Option("fp32"),
) -> None:
    """Split of one decode step: attention, linear layers, other model ops, engine (tree, sampling)."""
    from chunkgen.bench.e2e import build_workload
    from chunkgen.bench.step import profile_decode_steps

    llm = _load_llm(model, dtype=dtype, max_batch=n_queries, kv_memory="8GiB")
    r = profile_decode_steps(llm, build_workload(llm, n_shared, n_queries, steps).prompts, steps)
    stdout.print(f"decode step at batch {r['batch']} ({n_shared} shared tokens, mean of {r['steps']} steps): "
                 f"{r['step_ms']:.1f} ms = attention {r['attention_ms']:.1f} + linear layers {r['linear_ms']:.1f}"
                 f" + other model ops {r['other_model_ms']:.1f} + engine (tree, sampling, Python) {r['engine_ms']:.1f}")


@bench_app.command("machine")
def bench_machine() -> None:
    """The ceilings the kernel is compared with: fp32 FMA GFLOP/s and streaming-read GB/s."""
    import time

    import torch

    from chunkgen._native import native

    gflops = native().fma_peak_gflops()
    x = torch.ones(256 * 1024 * 1024 // 4)
    x.sum()
    t0 = time.perf_counter()
    for _ in range(5):
        x.sum()
    gbs = 5 * x.numel() * 4 / (time.perf_counter() - t0) / 1e9
    stdout.print(f"fp32 FMA peak {gflops:.0f} GFLOP/s ({native().simd_width()} lanes, all threads); "
                 f"streaming read {gbs:.1f} GB/s (torch sum over 256 MiB)")


@bench_app.command("tree")
def bench_tree(sequences: int = typer.Option(64), json_out: Optional[Path] = typer.Option(None, "--json")) -> None:
    """Per-step cost of the prefix tree's bookkeeping (appends + kernel context), and of a rebuild."""
    from chunkgen.bench.tree import tree_overhead

    r = tree_overhead(sequences)
    stdout.print(f"{r['sequences']} sequences, {r['steps']} decode steps: tree work per step "
                    f"{r['step_us_median']:.0f} µs median ({r['step_us_p90']:.0f} µs p90), "
                    f"{r['rebuilds_during_steps']} rebuilds; full context rebuild {r['rebuild_us_median']:.0f} µs")
    if json_out:
        json_out.write_text(json.dumps(r, indent=2) + "\n")


def _print_kernel_table(rows: list[dict]) -> None:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    table = Table(title="decode attention latency (µs, median)")
    for col in ("shape", "n_p", "n_s", *impls, "tpp speedup vs best other"):
        table.add_column(col, justify="right")
    cells: dict[tuple, dict[str, float]] = {}
    for r in rows:
        key = (f"b{r['batch']} h{r['q_heads']}/{r['kv_heads']} d{r['head_dim']} c{r['chunk']} {r['dtype']} {r['device']}",
               r["n_p"], r["n_s"])
        cells.setdefault(key, {})[r["impl"]] = r["us"]
    for (shape, n_p, n_s), by in cells.items():
        others = [v for k, v in by.items() if k != "chunk_tpp"]
        speed = f"{min(others) / by['chunk_tpp']:.2f}x" if others and "chunk_tpp" in by else "-"
        table.add_row(shape, str(n_p), str(n_s), *[f"{by[i]:.0f}" if i in by else "-" for i in impls], speed)
    stdout.print(table)


def main() -> None:  # pragma: no cover
    app()
