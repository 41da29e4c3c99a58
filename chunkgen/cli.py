"""The command line: wiring and printing only; the work lives in jobs/, engine/ and bench/."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.tree import Tree

_TTY = sys.stderr.isatty()
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  rich_markup_mode="rich" if _TTY else None,  # plain, unwrapped messages in logs and CI
                  help="Offline batched generation on a prefix-aware chunked KV cache.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: the attention kernel, end to end.")
app.add_typer(bench_app, name="bench")
err = Console(stderr=True, soft_wrap=not _TTY)
stdout = Console(width=None if sys.stdout.isatty() else 160)  # tables stay readable when piped

# Exit codes: 0 done; 1 an error (message, no traceback); 2 a usage error (a bad option, as typer);
# 3 some rows became error records; 130 / 143 stopped by SIGINT / SIGTERM (resumable).
EXIT_ERROR = 1
EXIT_BAD_INPUT_LINES = 3
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}
PROGRESS_EVERY_S = 10.0  # plain progress lines outside a terminal
JSON_PROGRESS_EVERY_S = 1.0


def _fail(message: str) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    raise typer.Exit(EXIT_ERROR)


def _usage(option: str, message: str) -> NoReturn:
    raise typer.BadParameter(message, param_hint=f"'{option}'")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _version(value: bool) -> None:
    if value:
        from chunkgen import __version__

        print(f"chunkgen {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Offline batched generation on a prefix-aware chunked KV cache."""


# -- checks that run before anything is loaded ------------------------------------------------------
def _check_queries(queries: str) -> None:
    if queries == "-":
        return
    path = Path(queries)
    if path.is_dir():
        _usage("--queries", f"{path} is a directory; give a JSONL file (or - for standard input)")
    if not path.exists():
        _usage("--queries", f"{path}: queries file not found")


def _check_out(out: Path, queries: str) -> None:
    if out.is_dir():
        _usage("--out", f"{out} is a directory; give a file path, e.g. {out / 'results.jsonl'}")
    if queries != "-" and out.exists():
        try:
            same = os.path.samefile(out, queries)
        except OSError:
            same = False
        if same:
            _usage("--out", f"{out} is the queries file; results go to a file of their own")


def _check_format(fmt: str) -> None:
    if fmt not in ("auto", "template", "openai"):
        _usage("--format", f"must be auto, template or openai, not {fmt!r}")


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 16 or chunk_size % 16:
        _usage("--chunk-size", f"must be a multiple of 16 (16, 32, 64, ...), not {chunk_size}")


def _dtype_option(dtype: str):
    from chunkgen.model import parse_dtype

    try:
        return parse_dtype(dtype)
    except ValueError as exc:
        _usage("--dtype", str(exc))


def _check_engine_options(dtype: str, device: str, chunk_size: int, kv_memory: str) -> int:
    """Validates dtype, device, chunk size and the KV budget's format; returns the budget in bytes."""
    import torch

    from chunkgen.llm import parse_bytes

    kv_dtype = _dtype_option(dtype)
    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:") and device[5:].isdigit()):
        _usage("--device", f"must be cpu, cuda or cuda:N, not {device!r}")
    if device.startswith("cuda"):
        from chunkgen._native import native_cuda_available

        if not (torch.cuda.is_available() and native_cuda_available()):
            _fail("--device cuda needs a CUDA GPU, a CUDA build of torch and chunkgen built with its CUDA "
                  "kernels (CHUNKGEN_CUDA=1 at install)")
    elif kv_dtype == torch.float16:
        err.print("[yellow]warning:[/] --dtype fp16 on the CPU runs several times slower than fp32 or bf16; "
                  "fp16 is for --device cuda", highlight=False)
    _check_chunk_size(chunk_size)
    try:
        budget = parse_bytes(kv_memory)
    except ValueError as exc:
        _usage("--kv-memory", str(exc))
    if budget <= 0:
        _usage("--kv-memory", f"must be positive, not {kv_memory!r}")
    return budget


SAMPLING_OPTIONS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
                    "top_k": "--top-k", "seed": "--seed", "stop": "--stop", "logprobs": "--logprobs",
                    "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
                    "json_schema": "--json-schema",
                    "regex": "--regex", "grammar": "--grammar"}


def _constraint_options(json_schema: Optional[Path], regex: Optional[str], grammar: Optional[Path]) -> dict[str, Any]:
    """--json-schema / --regex / --grammar as sampling defaults (files read, not yet compiled)."""
    given = [o for o, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar)) if v is not None]
    if len(given) > 1:
        _usage(given[1], f"cannot be combined with {given[0]} (give at most one constraint)")
    if regex is not None:
        return {"regex": regex}
    option, path = ("--json-schema", json_schema) if json_schema is not None else ("--grammar", grammar)
    if path is None:
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        _usage(option, f"cannot read {path} ({getattr(exc, 'strerror', None) or exc})")
    if option == "--grammar":
        return {"grammar": text}
    try:
        return {"json_schema": json.loads(text)}
    except json.JSONDecodeError as exc:
        _usage(option, f"{path} is not valid JSON: {exc}")


def _check_defaults(defaults: dict[str, Any]) -> None:
    from chunkgen.engine.sampler import ParamError
    from chunkgen.jobs.requests import check_defaults

    try:
        check_defaults(defaults)
    except ParamError as exc:
        _usage(SAMPLING_OPTIONS.get(exc.field, exc.field), exc.message)


def _read_items(queries: str, template: Optional[Path], fmt: str, defaults: dict[str, Any], id_field: str):
    """(format, iterator of Job | ErrorRecord) over the query file; a bad template stops here."""
    from chunkgen.jobs.requests import detect_format, open_queries, openai_jobs, read_rows, template_jobs
    from chunkgen.jobs.templates import TemplateError, load_templates

    templates = None
    if template is not None:
        try:
            templates = load_templates(template)
        except TemplateError as exc:
            _fail(str(exc))
    try:
        stream = open_queries(queries)
    except OSError as exc:
        _fail(f"{queries}: cannot read the queries file ({exc.strerror})")
    rows = read_rows(stream)
    if fmt == "auto":
        fmt, rows = detect_format(rows)
    if fmt == "openai":
        return fmt, openai_jobs(rows, defaults)
    if templates is None:
        _fail(f"{queries} holds template rows: pass --template (a .toml file or a directory of them)")
    return fmt, template_jobs(rows, templates, defaults, id_field)


def _count_lines(queries: str) -> int | None:
    """Rows in the file for the progress total (a pipe cannot be counted ahead)."""
    if queries == "-" or not Path(queries).is_file():
        return None
    n, last = 0, b"\n"
    with open(queries, "rb") as f:
        while block := f.read(1 << 20):
            n, last = n + block.count(b"\n"), block[-1:]
    return n + (last != b"\n")


def _resolve(model: Optional[str]) -> Path:
    """The model's directory, checked (architecture, weights) without loading any weights."""
    from chunkgen.model import ModelNotFound, check_model_dir, resolve_model

    def notice(gguf: Path, target: Path, size: int | None) -> None:
        if size is None:
            err.print(f"first use of {gguf.name}: converting it once to full-precision weights in {target} "
                      "(later runs load that copy)", highlight=False)
        else:
            err.print(f"converted: {_human(size)} in {target} (set CHUNKGEN_CACHE to keep it elsewhere)",
                      highlight=False)

    try:
        path = resolve_model(model, on_convert=notice)
        check_model_dir(path)
    except ModelNotFound as exc:
        _fail(str(exc))
    return path


def _planning_pool(model_dir: Path, chunk_size: int, kv_dtype):
    """A ChunkPool with bookkeeping only, shaped like the model's KV cache (for sizes and plans)."""
    from transformers import AutoConfig

    from chunkgen.cache import ChunkPool

    return ChunkPool.for_config(AutoConfig.from_pretrained(model_dir), chunk_size, kv_dtype,
                                budget_bytes=1 << 62, storage=False)


def _check_budget(model_dir: Path, chunk_size: int, dtype: str, device: str, budget: int) -> None:
    import torch

    from chunkgen.model import parse_dtype

    kv_dtype = parse_dtype(dtype)
    if device == "cpu" and kv_dtype == torch.float16:
        kv_dtype = torch.float32  # the CPU kernel keeps fp16 models' K/V in fp32
    per_chunk = _planning_pool(model_dir, chunk_size, kv_dtype).bytes_per_slot
    if budget < per_chunk:
        _usage("--kv-memory", f"{_human(budget)} holds no KV chunk of this model: one chunk of {chunk_size} "
                              f"tokens needs {_human(per_chunk)}")


def _load_llm(model: Optional[str], **kwargs):
    from chunkgen.llm import LLM
    from chunkgen.model import ModelNotFound, UnsupportedModel

    try:
        if _TTY:
            with err.status("loading model…"):
                return LLM(model=model, **kwargs)
        return LLM(model=model, **kwargs)
    except (ModelNotFound, UnsupportedModel, ValueError) as exc:
        _fail(str(exc))


class _StopFlag:
    """SIGINT / SIGTERM ask the run to stop after the current step; a second one stops at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old = {s: signal.signal(s, self._handle) for s in EXIT_SIGNAL}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __call__(self) -> bool:
        return self.signum is not None

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _progress_printer(quiet: bool, json_log: bool):
    """(callback, stop) for progress: a bar on a terminal, plain lines now and then elsewhere."""
    if quiet:
        return None, lambda: None
    last = [float("-inf")]

    def text(p) -> str:
        rate = p.generated_tokens / p.elapsed_s if p.elapsed_s else 0.0
        return (f"{rate:6.1f} tok/s  batch {p.running:3d}  KV {_human(p.kv_used_bytes)}  "
                f"cache hits {100 * p.cache_hit_rate:4.1f}%")

    if json_log:
        def on_json(p) -> None:
            if p.elapsed_s - last[0] >= JSON_PROGRESS_EVERY_S:
                last[0] = p.elapsed_s
                print(json.dumps({"event": "progress", **p.__dict__}), file=sys.stderr, flush=True)
        return on_json, lambda: None
    if not _TTY:
        def on_line(p) -> None:
            if p.elapsed_s - last[0] >= PROGRESS_EVERY_S:
                last[0] = p.elapsed_s
                of = f"/{p.total}" if p.total else ""
                print(f"progress: {p.done}{of} rows done, {p.errors} errors, {p.elapsed_s:.0f} s, {text(p)}",
                      file=sys.stderr, flush=True)
        return on_line, lambda: None
    progress = Progress(
        TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=err, transient=False,
    )
    progress.start()
    task = progress.add_task("run", total=None, info="")

    def on_bar(p) -> None:
        progress.update(task, completed=p.done, total=p.total, info=text(p))
    return on_bar, progress.stop


@app.command()
def run(
    queries: str = typer.Option(..., "--queries", "-q", help="JSONL queries or an OpenAI batch file; - reads standard input."),
    out: Path = typer.Option(..., "--out", "-o", help="Results JSONL (one line per finished request)."),
    template: Optional[Path] = typer.Option(None, "--template", "-t", help="A .toml template or a directory of them."),
    model: Optional[str] = typer.Option(None, help="HF model directory or .gguf file [default: the embedded SmolLM2-135M-Instruct]."),
    dtype: str = typer.Option("fp32", help="Weights and activations: fp32 or bf16 (fp16 on GPU)."),
    device: str = typer.Option("cpu", help="cpu, or cuda for the GPU kernels."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Tokens to generate at most, for rows and templates that do not set it [default: the template's, else 64]."),
    temperature: Optional[float] = typer.Option(None, help="Sampling temperature; 0 is greedy [default: the template's, else 0]."),
    top_p: Optional[float] = typer.Option(None, help="Nucleus sampling: keep the smallest set of tokens whose probability reaches this, in (0, 1] [default: 1]."),
    top_k: Optional[int] = typer.Option(None, help="Sample among the k most likely tokens; 0 is off [default: 0]."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling, in [0, 2^63): the same seed gives the same answer in any batch [default: random]."),
    stop: Optional[list[str]] = typer.Option(None, help="Stop string, repeatable: the answer ends before it."),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="Return each generated token's log-probability and its N most likely alternatives, N in [0, 20] [default: none]."),
    presence_penalty: Optional[float] = typer.Option(None, "--presence-penalty", help="Subtracted from the logit of every token already generated, in [-2, 2] [default: 0]."),
    frequency_penalty: Optional[float] = typer.Option(None, "--frequency-penalty", help="Subtracted from a token's logit once per time it was generated, in [-2, 2] [default: 0]."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="Constrain answers to this JSON schema (a .json file), for rows and templates that set no constraint."),
    regex: Optional[str] = typer.Option(None, "--regex", help="Constrain answers to match this regex, for rows and templates that set no constraint."),
    grammar: Optional[Path] = typer.Option(None, "--grammar", help="Constrain answers to this Lark grammar (a file), for rows and templates that set no constraint."),
    max_batch: int = typer.Option(32, min=1, help="Sequences decoded together."),
    kv_memory: str = typer.Option("4GiB", help="KV cache budget, e.g. 2GiB."),
    chunk_size: int = typer.Option(64, help="Tokens per KV chunk (a multiple of 16)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run: skip rows already answered in --out."),
    rerun_changed: bool = typer.Option(False, "--rerun-changed", help="With --resume: answer again the rows whose request changed since they were answered."),
    ordered: bool = typer.Option(False, "--ordered", help="Write results in input order (buffers finished ones)."),
    fmt: str = typer.Option("auto", "--format", help="auto, template or openai."),
    id_field: str = typer.Option("id", help="Field of each row that holds its id."),
    no_share: bool = typer.Option(False, "--no-share", help="Disable prefix sharing (for comparisons)."),
    shard: Optional[str] = typer.Option(None, help="i/N: run only shard i of N (planned over the whole file: prompt-prefix groups kept whole where the balance allows)."),
    use_ray: bool = typer.Option(False, "--ray", help="Run on a Ray cluster: engine actors that live for the whole job (needs: pip install 'chunkgen[ray]')."),
    workers: Optional[int] = typer.Option(None, min=1, help="With --ray: engine actors [default: one per GPU with --device cuda, else 2]."),
    ray_address: Optional[str] = typer.Option(None, help="With --ray: cluster address [default: start a local one]."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress; the summary only."),
    json_log: bool = typer.Option(False, "--json-log", help="Progress and summary as JSON lines on stderr."),
) -> None:
    """Generate an answer for every query and stream them to --out."""
    from chunkgen.jobs.lock import OutputLocked
    from chunkgen.jobs.results import OutputError, OutputExists, ResultWriter

    # Everything a user can get wrong is checked here, before the model loads.
    _check_format(fmt)
    if max_new_tokens is not None and max_new_tokens < 1:
        _usage("--max-new-tokens", f"must be at least 1, not {max_new_tokens}")
    if rerun_changed and not resume:
        _usage("--rerun-changed", "goes with --resume")
    _check_queries(queries)
    _check_out(out, queries)
    budget = _check_engine_options(dtype, device, chunk_size, kv_memory)
    defaults = {k: v for k, v in dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                      top_k=top_k, seed=seed, stop=stop or None, logprobs=logprobs,
                                      presence_penalty=presence_penalty,
                                      frequency_penalty=frequency_penalty).items() if v is not None}
    defaults.update(_constraint_options(json_schema, regex, grammar))
    _check_defaults(defaults)
    part = None
    if shard is not None:
        from chunkgen.scale.shard import Shard

        try:
            part = Shard.parse(shard)
        except ValueError as exc:
            _usage("--shard", str(exc))
    if use_ray:
        try:
            import ray  # noqa: F401
        except ImportError:
            _fail("--ray needs Ray: pip install 'chunkgen[ray]'")
    if part is not None and queries == "-":
        _usage("--shard", "plans over the whole file before it runs: give --queries a file, not standard input")
    fmt, items = _read_items(queries, template, fmt, defaults, id_field)
    if part is not None:
        from chunkgen.scale.shard import plan_items

        plan = plan_items(items, part.count)
        fmt, items = _read_items(queries, template, fmt, defaults, id_field)
        if not plan.rows(part.index):
            return _write_empty_shard(out, queries, part, plan.loads, resume, json_log)
        items = plan.select(items, part.index)
    model_dir = _resolve(model)
    _check_budget(model_dir, chunk_size, dtype, device, budget)
    try:
        writer = ResultWriter(out, fmt, model_name=model_dir.name, resume=resume, ordered=ordered,
                              rerun_changed=rerun_changed)
    except (OutputLocked, OutputExists, OutputError) as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot write {out}: {exc.strerror or exc}")
    llm_kwargs = dict(model=str(model_dir), dtype=dtype, chunk_size=chunk_size, kv_memory=budget,
                      max_batch=max_batch, share_prefix=not no_share, device=device)
    stop_flag = _StopFlag()
    try:
        if use_ray:
            summary = _run_ray(items, writer, llm_kwargs, workers, ray_address, device, stop_flag)
        else:
            summary = _run_local(items, writer, llm_kwargs, _count_lines(queries), stop_flag, quiet, json_log)
    except OutputError as exc:
        _fail(str(exc))
    finally:
        writer.close()
        stop_flag.restore()
    _report(summary, out, quiet, json_log, stop_flag.signum)


def _write_empty_shard(out: Path, queries: str, part, loads: list[int], resume: bool, json_log: bool) -> None:
    """A shard the plan gave no rows: its (empty) output file, so a collect step finds every shard's."""
    from chunkgen.jobs.lock import OutputLock, OutputLocked
    from chunkgen.jobs.run import JobSummary

    try:
        with OutputLock(out):
            if out.exists() and out.stat().st_size and not resume:
                _fail(f"{out} already has results; pass --resume to continue it, or choose another --out")
            out.touch()
    except OutputLocked as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot write {out}: {exc.strerror or exc}")
    err.print(f"shard {part.index}/{part.count}: none of the {sum(loads)} rows of {queries} fall to this shard "
              f"(rows per shard: {', '.join(map(str, loads))}); wrote an empty {out}", highlight=False)
    if json_log:
        summary = JobSummary(requests=0, skipped=0, errors=0, changed=0, prompt_tokens=0, cached_tokens=0,
                             completion_tokens=0, wall_s=0.0, prefill_s=0.0, decode_s=0.0, kv_peak_bytes=0,
                             kv_unshared_peak_bytes=0, workers=0, model_loads=0)
        print(json.dumps({"event": "summary", **summary.__dict__}), file=sys.stderr, flush=True)


def _run_local(items, writer, llm_kwargs: dict, total: int | None, stop_flag: _StopFlag, quiet: bool, json_log: bool):
    from chunkgen.jobs.run import run_job

    llm = _load_llm(**llm_kwargs)
    on_progress, stop_progress = _progress_printer(quiet, json_log)
    try:
        return run_job(llm.engine, llm.encode, items, writer, total=total, should_stop=stop_flag,
                       on_progress=on_progress)
    finally:
        stop_progress()


def _report(summary, out: Path, quiet: bool, json_log: bool, signum: int | None) -> None:
    if json_log:
        print(json.dumps({"event": "summary", **summary.__dict__}), file=sys.stderr, flush=True)
    elif summary.requests == 0 and summary.errors == 0 and summary.skipped and not signum:
        err.print(f"every query was already answered in {out} ({summary.skipped} rows); nothing to do",
                  highlight=False)
    else:
        table = Table(title=f"chunkgen run → {out}", show_header=False)
        table.add_row("requests answered", str(summary.requests))
        table.add_row("skipped (already in output)", str(summary.skipped))
        table.add_row("error records", str(summary.errors))
        table.add_row("wall time", f"{summary.wall_s:.1f} s (prefill {summary.prefill_s:.1f} s, decode {summary.decode_s:.1f} s)")
        table.add_row("generated tokens", f"{summary.completion_tokens} ({summary.tokens_per_s:.1f} tok/s)")
        table.add_row("prompt tokens (from cache)", f"{summary.prompt_tokens} ({summary.cached_tokens})")
        table.add_row("prefix cache hit rate", f"{100 * summary.cache_hit_rate:.1f}%")
        if summary.workers > 1 or summary.model_loads != 1:
            table.add_row("workers (model loads)", f"{summary.workers} ({summary.model_loads})")
            table.add_row("peak KV memory per worker", ", ".join(map(_human, summary.kv_peak_bytes_per_worker)))
        if summary.constrained:
            table.add_row("answers matching their constraint",
                          f"{summary.matched} of {summary.constrained}"
                          + (" (the others were cut short by max_new_tokens or a stop string)" if summary.matched < summary.constrained else ""))
        table.add_row("peak KV memory", f"{_human(summary.kv_peak_bytes)} (without sharing: {_human(summary.kv_unshared_peak_bytes)})")
        err.print(table)
    if summary.changed:
        err.print(f"[yellow]warning:[/] {summary.changed} answer(s) in {out} were made for a request that has "
                  "changed since (its text, sampling or template); they were kept. Pass --rerun-changed "
                  "with --resume to answer them again.", highlight=False)
    if signum is not None:
        name = signal.Signals(signum).name
        err.print(f"stopped by {name}: {summary.requests + summary.errors} records written to {out} in this run; "
                  "run the same command with --resume to continue", highlight=False)
        raise typer.Exit(EXIT_SIGNAL[signum])
    if summary.errors:
        err.print(f"[yellow]{summary.errors} row(s) could not be answered; their error records are in {out}[/]",
                  highlight=False)
        raise typer.Exit(EXIT_BAD_INPUT_LINES)


def _run_ray(items, writer, llm_kwargs: dict, workers: Optional[int], address: Optional[str], device: str,
             stop_flag: _StopFlag):
    from chunkgen.scale.ray import run_on_ray

    def started(shape) -> None:
        err.print(f"ray: {shape.count} workers, each with {shape.num_cpus:g} CPU(s)"
                  + (f" and {shape.num_gpus} GPU" if shape.num_gpus else ""), highlight=False)

    t0 = time.perf_counter()
    try:
        summary = run_on_ray(items, writer, llm_kwargs, workers, address=address, device=device,
                             should_stop=stop_flag, on_start=started)
    except (ValueError, RuntimeError) as exc:
        _fail(str(exc))
    err.print(f"ray: {summary.requests} answered, {summary.skipped} already done, {summary.errors} error record(s); "
              f"{time.perf_counter() - t0:.1f} s with {summary.workers} workers, {summary.model_loads} model loads",
              highlight=False)
    return summary


@app.command("inspect-tree")
def inspect_tree(
    queries: str = typer.Option(..., "--queries", "-q", help="JSONL queries or an OpenAI batch file; - reads standard input."),
    template: Optional[Path] = typer.Option(None, "--template", "-t", help="A .toml template or a directory of them."),
    model: Optional[str] = typer.Option(None, help="Model whose tokenizer and KV shape are used [default: the embedded one]."),
    chunk_size: int = typer.Option(64, help="Tokens per KV chunk (a multiple of 16)."),
    dtype: str = typer.Option("fp32", help="KV dtype the figures assume: fp32, bf16 or fp16."),
    fmt: str = typer.Option("auto", "--format", help="auto, template or openai."),
    id_field: str = typer.Option("id", help="Field of each row that holds its id."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the figures as JSON here."),
) -> None:
    """Insert every prompt into a prefix tree (no model run) and show sharing and memory."""
    from transformers import AutoTokenizer

    from chunkgen.cache.stats import plan_tree, tree_stats
    from chunkgen.jobs.requests import ErrorRecord
    from chunkgen.llm import encode_prompt

    _check_format(fmt)
    _check_chunk_size(chunk_size)
    kv_dtype = _dtype_option(dtype)
    _check_queries(queries)
    _, items = _read_items(queries, template, fmt, {}, id_field)
    path = _resolve(model)
    tok = AutoTokenizer.from_pretrained(path)
    bad = 0

    def prompts():
        nonlocal bad
        for item in items:
            if isinstance(item, ErrorRecord):
                bad += 1
            else:
                yield encode_prompt(tok, item.messages, item.data)

    tree = plan_tree(_planning_pool(path, chunk_size, kv_dtype), prompts())
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
                                help="Subset of hf, chunkgen_noshare, chunkgen_paged, chunkgen, chunkgen_schema "
                                     "(chunkgen with every answer held to a JSON schema of tool calls: the cost of masking)."),
    quick: bool = typer.Option(False, help="512 shared tokens, 8 queries, 16 new tokens."),
    repeat: int = typer.Option(1, min=1, help="Rounds in which the systems take turns; each row is the median round."),
    json_out: Optional[Path] = typer.Option(None, "--json"),
) -> None:
    """Whole runs side by side: transformers generate vs chunkgen without sharing, paged, full, constrained."""
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
                   repeat=repeat,
                   on_row=lambda r: err.print(f"  {r['system']:>16} n_shared={r['n_shared']} round {r['round']}: "
                                              f"{r['gen_tokens_per_s']:.1f} tok/s, wall {r['wall_s']:.1f} s"
                                              + (f" (+{r['constraint_setup_s']:.1f} s grammar set-up, once, "
                                                 "not in the wall time)" if r.get("constraint_setup_s") else ""),
                                              highlight=False))
    table = Table(title=f"end to end: {n_queries} queries, {max_new_tokens} new tokens, {dtype}"
                  + (f", median of {repeat} rounds" if repeat > 1 else ""))
    for col in ("system", "n_shared", "wall s", "prefill s", "decode s", "mask s", "gen tok/s", "decode tok/s",
                "KV peak", "RSS peak", "= hf"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["system"], str(r["n_shared"]), f"{r['wall_s']:.1f}", f"{r['prefill_s']:.1f}",
                      f"{r['decode_s']:.1f}", f"{r['mask_s']:.2f}" if "mask_s" in r else "-",
                      f"{r['gen_tokens_per_s']:.1f}", f"{r['decode_tokens_per_s']:.1f}",
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
    from chunkgen.bench.machine import machine_ceilings

    r = machine_ceilings()
    stdout.print(f"fp32 FMA peak {r['fma_gflops']:.0f} GFLOP/s ({r['simd_lanes']} lanes, all threads); "
                 f"streaming read {r['read_gb_s']:.1f} GB/s (torch sum over {r['read_mib']} MiB)")


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
