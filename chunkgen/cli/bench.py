"""`chunkgen bench ...`: the attention kernel, a decode step's split, the prefix order, the prefix
tree's bookkeeping and the machine's ceilings (the end-to-end bench is bench_e2e.py). The work is
bench/'s; these commands parse, run it and print its table."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from chunkgen.cli.boundary import bench_app, err, fail, stdout, usage
from chunkgen.cli.loading import device_text, dtype_line, load_llm
from chunkgen.cli.option_types import BATCH_INVARIANT, DEVICE, DTYPE, DUMMY_WEIGHTS, MAX_BATCH, MODEL, QUANTIZE
from chunkgen.cli.options import resolve_config
from chunkgen.config import (
    DEFAULT_BATCH_INVARIANT,
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULT_MAX_BATCH,
    DEFAULT_MODEL,
    ORDERS,
)
from chunkgen.device import human_bytes


# One line per option: the signature reads like the --help it makes.
# fmt: off
@bench_app.command("kernel")
def bench_kernel(
    quick: bool = typer.Option(False, help="A small subset that runs in seconds."),
    kv_dtype: str | None = typer.Option(None, "--kv-dtype", metavar="DTYPE", help="K/V dtype: fp32 or bf16 on the CPU (default fp32); "
                                                   "fp16, bf16 or fp32 on CUDA (default fp16)."),
    device: DEVICE = DEFAULT_DEVICE,
    json_out: Path | None = typer.Option(None, "--json", metavar="FILE", help="Also write the rows as JSON here."),
    repeats: int = typer.Option(10, metavar="N", help="Timed runs per cell (median reported)."),
    impls: str = typer.Option("naive,sdpa,paged,paged_shared,chunk_tpp,chunk_tpp_per_chunk,chunk_tpp_unstaged,"
                              "chunk_tpp_unsplit",
                              metavar="NAME[,NAME...]", help="Implementations to time (the chunk_tpp_ variants on "
                                                             "CUDA only: chunk_tpp with a kernel step switched off)."),
    batch_invariant: BATCH_INVARIANT = DEFAULT_BATCH_INVARIANT,
) -> None:
    """Decode attention latency, paper Table 3 style: naive, sdpa, paged, paged_shared, chunk_tpp; chunkgen's op as the engine runs it with the same --batch-invariant."""
    import torch

    from chunkgen.bench.kernel import IMPLS, default_grid, run_grid
    from chunkgen.device import device_guard
    from chunkgen.model import parse_dtype

    chosen = tuple(i.strip() for i in impls.split(",") if i.strip())
    if not chosen or set(chosen) - set(IMPLS):
        fail(f"--impls takes a subset of {','.join(IMPLS)}")
    config = resolve_config(device=device, batch_invariant=batch_invariant)
    device = config.device
    err.print(f"device {device_text(config)}; batch-invariant numerics {'on' if config.batch_invariant else 'off'}",
              highlight=False)
    on_cuda = device.startswith("cuda")
    kv_dtype = parse_dtype(kv_dtype or ("fp16" if on_cuda else "fp32"))
    if not on_cuda and kv_dtype == torch.float16:
        fail("the CPU kernel takes fp32 or bf16 K/V; fp16 is for --device cuda")
    with device_guard(device):
        rows = run_grid(default_grid(quick), kv_dtype, repeats=3 if quick else repeats, impls=chosen, device=device,
                        batch_invariant=config.batch_invariant, on_row=lambda r: err.print(f"  {r['impl']:>13} n_p={r['n_p']} n_s={r['n_s']} "
                                                   f"H={r['q_heads']}/{r['kv_heads']}: {r['us']:.0f} us", highlight=False))
    _print_kernel_table(rows)
    if json_out:
        json_out.write_text(json.dumps(rows, indent=2) + "\n")
# fmt: on


# One line per option: the signature reads like the --help it makes.
# fmt: off
@bench_app.command("order")
def bench_order(
    model: MODEL = DEFAULT_MODEL,
    docs: int = typer.Option(100, min=1, metavar="D", help="Documents (distinct shared prefixes)."),
    questions: int = typer.Option(4, min=1, metavar="Q", help="Questions on each document (rows sharing its prefix)."),
    doc_tokens: str = typer.Option("300", metavar="T|LO-HI", help="Tokens per document: T, or LO-HI drawn uniformly."),
    shuffle: bool = typer.Option(True, "--shuffle/--no-shuffle", help="Rows in random order, as merged files are; else document by document."),
    data_seed: int = typer.Option(0, metavar="N", help="Seed of the documents, questions and shuffle (run's --seed is the sampling seed)."),
    kv_budget: str = typer.Option("tenth", metavar="SIZE", help="KV cache budget of the runs, e.g. 64MiB, or tenth: a tenth of the distinct prompt tokens, at least two of the longest prompts (small, so the order matters)."),
    max_batch: MAX_BATCH = DEFAULT_MAX_BATCH,
    max_new_tokens: int = typer.Option(16, min=1, metavar="N", help="Tokens generated per answer."),
    dtype: DTYPE = DEFAULT_DTYPE,
    orders: str = typer.Option("input,prefix", "--orders", metavar="ORDERS", help="Orders to run, in turn: input, prefix."),
    write_workload: Path | None = typer.Option(None, metavar="DIR", help="Also keep the template and queries here (for chunkgen run)."),
    dump_token_ids: Path | None = typer.Option(None, metavar="FILE", help="Write the prompts' token ids (file order) for the vLLM comparison script, and run nothing."),
    json_out: Path | None = typer.Option(None, "--json", metavar="FILE", help="Write the rows as JSON here."),
) -> None:
    """Retrieval QA, shuffled: prefix order against file order on the same file and KV budget."""
    from chunkgen.bench.order import docqa_rows, parse_doc_tokens, run_order_bench
    from chunkgen.bench.order import dump_token_ids as dump
    from chunkgen.device import parse_bytes

    chosen = [o.strip() for o in orders.split(",") if o.strip()]
    for o in chosen:
        if o not in ORDERS:
            usage("--order", f"must be prefix or input, not {o!r}")
    try:
        lengths = parse_doc_tokens(doc_tokens)
    except ValueError as exc:
        usage("--doc-tokens", str(exc))
    llm = load_llm(resolve_config(model=model, dtype=dtype, max_batch=max_batch, kv_memory="64MiB", quantize="none"))
    max_batch = llm.config.max_batch
    rows = docqa_rows(llm.tokenizer, docs, questions, lengths, shuffle, data_seed)
    if dump_token_ids:
        dump(llm, rows, max_new_tokens, dump_token_ids)
        err.print(f"{len(rows)} prompts written to {dump_token_ids}", highlight=False)
        return
    try:
        budget = None if kv_budget == "tenth" else parse_bytes(kv_budget)
    except ValueError as exc:
        usage("--kv-budget", str(exc) + " or tenth")
    report = run_order_bench(llm, rows, chosen, budget, max_batch, max_new_tokens, write_workload,
                             on_row=lambda r: err.print(f"  {r['order']:>6}: {r['prefilled_tokens']} tokens prefilled, "
                                                        f"wall {r['wall_s']:.1f} s, {r['gen_tokens_per_s']:.1f} tok/s",
                                                        highlight=False))
    budget = report["kv_memory"]
    table = Table(title=f"docqa: {len(rows)} rows, {docs} documents of {doc_tokens} tokens, {questions} questions each, "
                        f"{'shuffled' if shuffle else 'in document order'}; KV {human_bytes(budget)}, batch {max_batch}, "
                        f"{max_new_tokens} new tokens, {llm.config.dtype_name}; minimum prefill {report['minimum_prefill_tokens']} of "
                        f"{report['prompt_tokens']} prompt tokens")
    for col in ("order", "prefilled tokens", "x minimum", "hit rate", "wall s", "ordering s", "prefill s",
                "decode s", "gen tok/s", "RSS peak", "answers = first"):
        table.add_column(col, justify="right")
    for r in report["results"]:
        table.add_row(r["order"], str(r["prefilled_tokens"]), f"{r['prefill_vs_minimum']:.2f}",
                      f"{100 * r['cache_hit_rate']:.1f}%", f"{r['wall_s']:.1f}", f"{r['order_s']:.2f}",
                      f"{r['prefill_s']:.1f}", f"{r['decode_s']:.1f}", f"{r['gen_tokens_per_s']:.1f}",
                      human_bytes(r["rss_peak_bytes"]), f"{r['answers_equal_to_first']}/{r['rows']}")
    stdout.print(table)
    if json_out:
        json_out.write_text(json.dumps({"docs": docs, "questions": questions, "doc_tokens": doc_tokens,
                                        "shuffle": shuffle, "max_batch": max_batch,
                                        "max_new_tokens": max_new_tokens, "dtype": llm.config.dtype_name, **report}, indent=2) + "\n")
# fmt: on


# One line per option: the signature reads like the --help it makes.
# fmt: off
@bench_app.command("order-pass")
def bench_order_pass(
    rows: int = typer.Option(1_000_000, min=1, metavar="N", help="Short rows in the file."),
    prefixes: int = typer.Option(1000, min=1, metavar="N", help="Distinct personas (shared prefixes), interleaved at random."),
    work_dir: Path | None = typer.Option(None, metavar="DIR", help="Where the file is written [default: a temporary folder]."),
    run_rows: int = typer.Option(1 << 18, min=1, metavar="N", help="Keys held in memory before a sorted run is spilled to disk."),
) -> None:
    """The cost of --order prefix alone on a large file: keying, sorting and re-reading every row
    (no model: the peak RSS is the pass's own)."""
    import tempfile

    from chunkgen.bench.order import ordering_pass, write_persona_rows

    with tempfile.TemporaryDirectory(prefix="chunkgen-order-pass-") as tmp:
        template, queries = write_persona_rows(work_dir or Path(tmp), rows, prefixes)
        r = ordering_pass(template, queries, run_rows=run_rows)
    stdout.print(f"{r['rows']} rows over {prefixes} prefixes: ordering pass {r['wall_s']:.1f} s "
                 f"(keying {r['keying_s']:.1f} s, re-reading {r['reread_s']:.1f} s; {r['rows'] / r['wall_s']:.0f} rows/s), "
                 f"{r['spilled_runs']} sorted runs spilled, rows come out in {r['prefix_runs']} runs of one prefix, "
                 f"peak RSS {human_bytes(r['rss_peak_bytes'])}")
# fmt: on


def step_table(r: dict, ceilings: dict | None) -> Table:
    """bench step's split as a table: time, share, and the products' rates against the FMA peak."""
    peak = ceilings["fma_gflops"] if ceilings else None
    table = Table(
        title=f"prefill ({r['prefill_steps']} waves) and a decode step at batch {r['batch']}"
        + (
            f"; fp32 FMA peak {peak:.0f} GFLOP/s (bf16 dot products: twice), read {ceilings['read_gb_s']:.1f} GB/s"
            if ceilings
            else ""
        )
    )
    for col in ("part", "time", "share", "GFLOP/s", "of fp32 FMA peak", "GB/s"):
        table.add_column(col, justify="left" if col == "part" else "right")

    def row(part: str, seconds: float, whole: float, unit: str, gflop: float | None = None, gb: float | None = None):
        rate = gflop / seconds if gflop and seconds > 0 else None
        table.add_row(
            part,
            f"{seconds * (1e3 if unit == 'ms' else 1):.{1 if unit == 'ms' else 2}f} {unit}",
            f"{100 * seconds / whole:.0f}%" if whole > 0 else "",
            f"{rate:.0f}" if rate else "",
            f"{100 * rate / peak:.0f}%" if rate and peak else "",
            f"{gb / seconds:.1f}" if gb and seconds > 0 else "",
        )

    wave = r["prefill_s"]
    row("prefill", wave, wave, "s", r["prefill_attention_gflop"] + r["prefill_linear_gflop"])
    row("  attention", r["prefill_attention_s"], wave, "s", r["prefill_attention_gflop"])
    row("  linear layers", r["prefill_linear_s"], wave, "s", r["prefill_linear_gflop"])
    row("  other model ops", r["prefill_other_model_s"], wave, "s")
    row("  engine", r["prefill_engine_s"], wave, "s")
    step = r["step_ms"] / 1e3
    gflop = r["linear_gflop"] + r.get("chunk_first_gflop", 0.0) + r.get("seq_first_gflop", 0.0)
    row("decode step", step, step, "ms", gflop)
    row("  attention", r["attention_ms"] / 1e3, step, "ms")
    if "chunk_first_ms" in r:
        row("    chunk-first", r["chunk_first_ms"] / 1e3, step, "ms", r["chunk_first_gflop"])
        row("    sequence-first", r["seq_first_ms"] / 1e3, step, "ms", r["seq_first_gflop"], r["seq_first_gb"])
        row("    segment merge", r["merge_ms"] / 1e3, step, "ms")
        outside = r["attention_ms"] - r["chunk_first_ms"] - r["seq_first_ms"] - r["merge_ms"]
        row("    plan, op dispatch", outside / 1e3, step, "ms")
    row("  linear layers", r["linear_ms"] / 1e3, step, "ms", r["linear_gflop"])
    row("  other model ops", r["other_model_ms"] / 1e3, step, "ms")
    row("  engine", r["engine_ms"] / 1e3, step, "ms")
    return table


def _on_threads(threads: list[int]) -> str:
    """' on 2 threads', or ' on 1-2 threads' where the thread governor changed the count between steps."""
    if not threads:
        return ""
    low, high = threads[0], threads[-1]
    return f" on {low} thread{'s' if high > 1 else ''}" if low == high else f" on {low}-{high} threads"


# One line per option: the signature reads like the --help it makes.
# fmt: off
@bench_app.command("step")
def bench_step(
    model: MODEL = DEFAULT_MODEL,
    n_shared: int = typer.Option(2048, metavar="N", help="Shared prompt length in tokens."),
    n_queries: int = typer.Option(32, metavar="N", help="Sequences in the decode batch."),
    steps: int = typer.Option(30, metavar="N", help="Decode steps timed (their mean is printed)."),
    dtype: DTYPE = DEFAULT_DTYPE,
    quantize: QUANTIZE = "none",
    batch_invariant: BATCH_INVARIANT = DEFAULT_BATCH_INVARIANT,
    dummy_weights: DUMMY_WEIGHTS = None,
    json_out: Path | None = typer.Option(
        None, "--json", metavar="FILE", help="Also measure the host's share of a step and write every figure to this file: "
        "ops_per_step (profiler, this model and batch), host_floor_ms_b32 / _b256 (CPU time of a step of a "
        "30-layer random model with hidden size 64, the attention op dispatched without its arithmetic; "
        "cpu_step_ms_b32 / _b256 with it), graph_breaks (torch._dynamo.explain of the decode forward)."),
) -> None:
    """Split of the prefill and of one decode step: attention (the kernel's phases), linear layers, other model ops, engine (tree, sampling); FLOP rates against the machine's FMA peak."""
    from chunkgen.bench import step as bench
    from chunkgen.bench.e2e import build_workload
    from chunkgen.bench.machine import machine_ceilings

    llm = load_llm(resolve_config(model=model, dummy_weights=dummy_weights, dtype=dtype, max_batch=n_queries,
                                   kv_memory="8GiB", quantize=quantize, batch_invariant=batch_invariant))
    dtype = dtype_line(llm.config) + ("" if llm.quantized == "none" else f", quantized: {llm.quantized}")
    prompts = build_workload(llm, n_shared, n_queries, steps).prompts
    r = bench.profile_steps(llm, prompts, steps)
    # The ceilings after the steps: measured just before them, their full-core loops left the
    # steps' host work slower for a while (on a Zen 3, the engine's CPU time a step at 32 rows
    # 1.14 ms right after them, 0.32 ms before).
    ceilings = machine_ceilings() if llm.config.device == "cpu" else None
    r["machine"] = ceilings
    stdout.print(f"decode step at batch {r['batch']} ({n_shared} shared tokens, {dtype}, mean of {r['steps']} steps"
                 f"{_on_threads(r['threads'])}): "
                 f"{r['step_ms']:.1f} ms = attention {r['attention_ms']:.1f} + linear layers {r['linear_ms']:.1f}"
                 f" + other model ops {r['other_model_ms']:.1f} + engine (tree, sampling, Python) {r['engine_ms']:.1f}"
                 f" ({r['engine_cpu_ms']:.2f} ms of it the engine thread's CPU time)")
    stdout.print(step_table(r, ceilings))
    if json_out:
        floor = bench.host_floor_engine(llm.tokenizer)
        r.update(ops_per_step=bench.ops_per_step(llm, prompts), host_floor_ms_b32=bench.host_floor_ms(floor, 32),
                 host_floor_ms_b256=bench.host_floor_ms(floor, 256),
                 cpu_step_ms_b32=bench.host_floor_ms(floor, 32, attention=True),
                 cpu_step_ms_b256=bench.host_floor_ms(floor, 256, attention=True),
                 graph_breaks=bench.graph_breaks(llm, prompts))
        stdout.print(f"host share: {r['ops_per_step']} ops a step; host floor {r['host_floor_ms_b32']:.2f} ms at "
                     f"batch 32, {r['host_floor_ms_b256']:.2f} ms at batch 256 (with the CPU attention kernel: "
                     f"{r['cpu_step_ms_b32']:.2f} and {r['cpu_step_ms_b256']:.2f} ms); {r['graph_breaks']} graph breaks")
        json_out.write_text(json.dumps(r, indent=2) + "\n")
# fmt: on


ROWS_DEFAULT, SHAPES_DEFAULT = "1,32,256,2048", "576x576,1536x576,576x1536,49152x576"  # the CPU's defaults


# One line per option: the signature reads like the --help it makes.
# fmt: off
@bench_app.command("linear")
def bench_linear(
    types: str = typer.Option("q4_0,q4_1,q4_k,q5_k,q6_k,q8_0,int8", metavar="TYPE[,TYPE...]", help="Quantized types timed against fp32 (and bf16)."),
    rows: str = typer.Option(ROWS_DEFAULT, metavar="M[,M...]", help="Rows of x (a decode step's rows, a prefill's tokens)."),
    shapes: str = typer.Option(SHAPES_DEFAULT, metavar="NxK[,NxK...]", help="Products as output x input features (default: SmolLM2-135M's; a K-quant needs K a multiple of 256, else it is left out)."),
    threads: int | None = typer.Option(None, metavar="N", help="torch threads (default: torch's)."),
    min_seconds: float = typer.Option(0.3, metavar="S", help="Time each cell at least this long (best call reported)."),
    json_out: Path | None = typer.Option(None, "--json", metavar="FILE", help="Also write the rows as JSON here."),
    device: DEVICE = DEFAULT_DEVICE,
    batch_invariant: BATCH_INVARIANT = DEFAULT_BATCH_INVARIANT,
) -> None:
    """One linear product: the quantized kernel against the fp32 product (and the bf16 one where the CPU has a bf16 path), side by side, random weights, each as the engine runs it with the same --batch-invariant; on a GPU, cuBLAS against the batch-invariant product in bf16 (--rows and --shapes then default to decode and prefill products of SmolLM2-135M and Llama-3.2-1B)."""
    import torch

    from chunkgen.bench.linear import TYPES, run_linear
    from chunkgen.device import device_guard

    config = resolve_config(device=device, batch_invariant=batch_invariant)
    err.print(f"device {device_text(config)}", highlight=False)
    if config.device.startswith("cuda"):
        with device_guard(config.device):
            return _bench_linear_cuda(rows, shapes, json_out)

    chosen = tuple(t.strip() for t in types.split(",") if t.strip())
    if set(chosen) - set(TYPES):
        fail(f"--types takes a subset of {','.join(TYPES)}")
    try:
        ms = tuple(int(m) for m in rows.split(","))
        nk = tuple(tuple(int(d) for d in s.lower().split("x")) for s in shapes.split(","))
    except ValueError:
        fail("--rows takes integers, --shapes NxK pairs, comma-separated")
    if any(len(s) != 2 or s[1] % 32 for s in nk):
        fail("--shapes takes NxK pairs with K a multiple of 32")
    if threads:
        torch.set_num_threads(threads)
    err.print(f"{torch.get_num_threads()} threads; quantized path {torch.ops.chunkgen.quant_isa()}; batch-invariant "
              f"numerics {'on' if config.batch_invariant else 'off'}", highlight=False)
    result = run_linear(nk, ms, chosen, min_seconds, config.batch_invariant, on_row=lambda r: err.print(
        f"  {r['n']}x{r['k']} rows {r['rows']:>5} {r['type']:>5}: {r['ms']:9.3f} ms {r['gflops']:7.1f} GFLOP/s "
        f"{r['vs_fp32']:5.2f}x fp32" + (f" {r['vs_bf16']:5.2f}x bf16" if r["vs_bf16"] else ""), highlight=False))
    with_bf16 = any(r["vs_bf16"] for r in result)
    table = Table("n x k", "rows", "type", "ms", "GFLOP/s", "vs fp32", *(["vs bf16"] if with_bf16 else []))
    for r in result:
        table.add_row(f"{r['n']}x{r['k']}", str(r["rows"]), r["type"], f"{r['ms']:.3f}", f"{r['gflops']:.1f}",
                      f"{r['vs_fp32']:.2f}x", *([f"{r['vs_bf16']:.2f}x"] if with_bf16 else []))
    stdout.print(table)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2) + "\n")
# fmt: on


def _bench_linear_cuda(rows: str, shapes: str, json_out: Path | None) -> None:
    """bench linear --device cuda: cuBLAS against the batch-invariant product, per shape and rows."""
    import torch

    from chunkgen._native import native_cuda_available
    from chunkgen.bench.linear import CUDA_ROWS, CUDA_SHAPES, run_linear_cuda

    if not native_cuda_available():
        fail("--device cuda: chunkgen was built without its CUDA kernels (CHUNKGEN_CUDA=1 at install builds them)")
    try:
        ms = CUDA_ROWS if rows == ROWS_DEFAULT else tuple(int(m) for m in rows.split(","))
        nk = (
            CUDA_SHAPES
            if shapes == SHAPES_DEFAULT
            else tuple(tuple(int(d) for d in s.lower().split("x")) for s in shapes.split(","))
        )
    except ValueError:
        fail("--rows takes integers, --shapes NxK pairs, comma-separated")
    err.print(f"{torch.cuda.get_device_name()}; cuBLAS against the batch-invariant product, bf16", highlight=False)
    result = run_linear_cuda(nk, ms, on_row=lambda r: err.print(
        f"  {r['n']}x{r['k']} rows {r['rows']:>5} {r['impl']:>9}: {r['us']:9.1f} us {r['tflops']:7.2f} TFLOP/s "
        f"{r['vs_cublas']:5.2f}x cuBLAS's time", highlight=False))  # fmt: skip
    table = Table("n x k", "rows", "impl", "us", "TFLOP/s", "time / cuBLAS's")
    for r in result:
        table.add_row(f"{r['n']}x{r['k']}", str(r["rows"]), r["impl"], f"{r['us']:.1f}", f"{r['tflops']:.2f}",
                      f"{r['vs_cublas']:.2f}x")  # fmt: skip
    stdout.print(table)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2) + "\n")


# One line per option: the signature reads like the --help it makes.
# fmt: off
@bench_app.command("machine")
def bench_machine() -> None:
    """The ceilings the kernels are compared with: fp32 FMA GFLOP/s, the quantized linear layers'
    int8 products (AVX2 vpmaddubsw + vpaddw; AVX512_VNNI vpdpbusd), bf16 dot products (AVX512_BF16
    vdpbf16ps) and streaming-read GB/s."""
    from chunkgen.bench.machine import machine_ceilings

    r = machine_ceilings(int8=True)
    stdout.print(f"fp32 FMA peak {r['fma_gflops']:.0f} GFLOP/s ({r['simd_lanes']} lanes, all threads); "
                 f"streaming read {r['read_gb_s']:.1f} GB/s (torch sum over {r['read_mib']} MiB)")
    if r["int8_gops"]:
        stdout.print(f"quantized linear layers' inner step (int8 vpmaddubsw + int16 vpaddw, no scales or loads): "
                     f"{r['int8_gops']:.0f} GOP/s, {r['int8_gops'] / r['fma_gflops']:.2f}x the fp32 FMA peak")
    if r["vnni_gops"]:
        stdout.print(f"AVX512_VNNI vpdpbusd (int8, the quantized linear layers' instruction here): "
                     f"{r['vnni_gops']:.0f} GOP/s, {r['vnni_gops'] / r['fma_gflops']:.2f}x the fp32 FMA peak")
    if r["bf16_gflops"]:
        stdout.print(f"AVX512_BF16 vdpbf16ps (bf16 dot products): {r['bf16_gflops']:.0f} GFLOP/s, "
                     f"{r['bf16_gflops'] / r['fma_gflops']:.2f}x the fp32 FMA peak")
# fmt: on


# One line per option: the signature reads like the --help it makes.
# fmt: off
@bench_app.command("tree")
def bench_tree(sequences: int = typer.Option(64, metavar="N", help="Sequences decoding on one shared prefix."),
               json_out: Path | None = typer.Option(None, "--json", metavar="FILE",
                                                       help="Also write the figures as JSON here.")) -> None:
    """Per-step cost of the prefix tree's bookkeeping (appends + kernel context), and of a rebuild."""
    from chunkgen.bench.tree import tree_overhead

    r = tree_overhead(sequences)
    stdout.print(f"{r['sequences']} sequences, {r['steps']} decode steps: tree work per step "
                    f"{r['step_us_median']:.0f} µs median ({r['step_us_p90']:.0f} µs p90), "
                    f"{r['rebuilds_during_steps']} rebuilds; full context rebuild {r['rebuild_us_median']:.0f} µs")
    if json_out:
        json_out.write_text(json.dumps(r, indent=2) + "\n")
# fmt: on


def _print_kernel_table(rows: list[dict]) -> None:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    table = Table(title="decode attention latency (µs, median)")
    for col in ("shape", "n_p", "n_s", *impls, "tpp speedup vs best other"):
        table.add_column(col, justify="right")
    cells: dict[tuple, dict[str, float]] = {}
    for r in rows:
        key = (
            f"b{r['batch']} h{r['q_heads']}/{r['kv_heads']} d{r['head_dim']} c{r['chunk']} {r['dtype']} {r['device']}"
            f" q/out {r.get('q_dtype', r['dtype'])}",
            r["n_p"],
            r["n_s"],
        )
        cells.setdefault(key, {})[r["impl"]] = r["us"]
    for (shape, n_p, n_s), by in cells.items():
        others = [v for k, v in by.items() if not k.startswith("chunk_tpp")]
        speed = f"{min(others) / by['chunk_tpp']:.2f}x" if others and "chunk_tpp" in by else "-"
        table.add_row(shape, str(n_p), str(n_s), *[f"{by[i]:.0f}" if i in by else "-" for i in impls], speed)
    stdout.print(table)
    paths = sorted({r["cpu_path"] for r in rows if r.get("cpu_path")})
    if paths:
        stdout.print(f"CPU kernel path: {', '.join(paths)} (CHUNKGEN_CPU_ISA forces a lower one)")
