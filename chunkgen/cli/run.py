"""`chunkgen run`: a query file in, an answer per row streamed to --out.

The command checks every option before the model loads (cli/options.py), resolves them into one
Config, opens the rows as a JobSource (jobs/source.py), and hands both to the job loop: locally
(jobs/run.py over one LLM) or on a Ray cluster (scale/ray.py). What it prints at the end is
cli/summary.py's."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from chunkgen.cli.boundary import app, err, fail, usage
from chunkgen.cli.loading import device_text, dtype_text, invariance_text, kv_text, load_llm, weights_text
from chunkgen.cli.option_types import (
    BATCH_INVARIANT,
    CHUNK_SIZE,
    DEVICE,
    DTYPE,
    KV_DTYPE,
    KV_MEMORY,
    MAX_BATCH,
    MIXED_PREFILL_TOKENS,
    MODEL,
    QUANTIZE,
    sampling_options,
)
from chunkgen.cli.options import (
    check_kv_fits,
    check_out,
    check_tokenizer,
    resolve_config,
    resolve_model,
    said_as_mistakes,
    sampling_defaults,
)
from chunkgen.cli.progress import progress_printer
from chunkgen.cli.summary import report
from chunkgen.config import (
    DEFAULT_BATCH_INVARIANT,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULT_KV_MEMORY,
    DEFAULT_MAX_BATCH,
    DEFAULT_MIXED_PREFILL_TOKENS,
    DEFAULT_MODEL,
    DEFAULT_QUANTIZE,
    ORDERS,
    Config,
)
from chunkgen.jobs.source import JobSource, check_format, check_queries_path
from chunkgen.jobs.stop import DEFAULT_STOP_GRACE_S, EXIT_SIGNAL, Interrupted, StopFlag

OUTPUT_ORDERS = ("completion", "input")


# One line per option: the signature reads like the --help it makes.
# fmt: off
@app.command()
@sampling_options
def run(
    queries: str = typer.Option(..., "--queries", "-q", metavar="FILE", help="JSONL queries or an OpenAI batch file; - reads standard input."),
    out: Path = typer.Option(..., "--out", "-o", metavar="FILE", help="Results JSONL (one line per finished request)."),
    template: Path | None = typer.Option(None, "--template", "-t", metavar="PATH", help="A .toml template or a directory of them."),
    model: MODEL = DEFAULT_MODEL,
    dtype: DTYPE = DEFAULT_DTYPE,
    quantize: QUANTIZE = DEFAULT_QUANTIZE,
    device: DEVICE = DEFAULT_DEVICE,
    sampling: dict[str, Any] = ...,  # one option per SamplingParams field (sampling_options)
    max_batch: MAX_BATCH = DEFAULT_MAX_BATCH,
    kv_memory: KV_MEMORY = DEFAULT_KV_MEMORY,
    kv_dtype: KV_DTYPE = None,
    chunk_size: CHUNK_SIZE = DEFAULT_CHUNK_SIZE,
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run: skip rows already answered in --out."),
    rerun_changed: bool = typer.Option(False, "--rerun-changed", help="With --resume: answer again the rows whose request changed since they were answered."),
    output_order: str = typer.Option("completion", "--output-order", metavar="ORDER", help="completion: each result is written as soon as it finishes; input: results in input order (finished ones wait for those before them)."),
    ordered: bool = typer.Option(False, "--ordered", hidden=True, help="Same as --output-order input."),
    order: str = typer.Option("prefix", "--order", metavar="ORDER", help="prefix: answer rows sharing a prompt prefix together, so each shared prefix is prefilled once while cached (the file is read twice; standard input is spooled to a temporary file); input: answer rows in file order."),
    fmt: str = typer.Option("auto", "--format", metavar="FORMAT", help="auto, template or openai."),
    id_field: str = typer.Option("id", metavar="FIELD", help="Field of each row that holds its id."),
    no_share: bool = typer.Option(False, "--no-share", help="Disable prefix sharing (for comparisons)."),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Send each prompt's messages as plain text joined by blank lines instead of through the model's chat template (a base model, or one without a template: refused otherwise)."),
    batch_invariant: BATCH_INVARIANT = DEFAULT_BATCH_INVARIANT,
    mixed_prefill_tokens: MIXED_PREFILL_TOKENS = DEFAULT_MIXED_PREFILL_TOKENS,
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="On the GPU, run every decode step eagerly instead of replaying one CUDA graph per batch size (the CPU always runs eagerly)."),
    shard: str | None = typer.Option(None, metavar="I/N", help="i/N: run only shard i of N (planned over the whole file: prompt-prefix groups kept whole where the balance allows)."),
    use_ray: bool = typer.Option(False, "--ray", help="Run on a Ray cluster: engine actors that live for the whole job (needs: pip install 'chunkgen[ray]')."),
    workers: int | None = typer.Option(None, min=1, metavar="N", help="With --ray: engine actors [default: one per GPU with --device cuda, else 2]."),
    ray_address: str | None = typer.Option(None, metavar="ADDRESS", help="With --ray: cluster address [default: start a local one]."),
    stop_grace: float = typer.Option(DEFAULT_STOP_GRACE_S, "--stop-grace", min=0, metavar="SECONDS", help="After a first Ctrl-C or SIGTERM, how long the rows in flight may run on to their answers (new rows are not started); 0: stop after the current step. A second signal stops at once."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress; the summary only."),
    json_log: bool = typer.Option(False, "--json-log", help="Progress and summary as JSON lines on stderr."),
) -> None:
    """Generate an answer for every query and stream them to --out.

    Sampling options and constraints (--max-new-tokens to --grammar) can be set in four places; for
    each one separately, a row's own value wins, then the command line's, then the template's, then
    the default shown here. A constraint counts as one setting whatever its kind: a row's regex
    replaces a template's JSON schema."""
    with said_as_mistakes():  # everything a user can get wrong is checked here, before the model loads
        _check_choices(fmt, order, output_order, sampling.get("max_new_tokens"), rerun_changed and not resume)
        check_queries_path(queries)
        check_out(out, queries)
        config = resolve_config(device=device, dtype=dtype, quantize=quantize, chunk_size=chunk_size, kv_memory=kv_memory,
                                kv_dtype=kv_dtype, max_batch=max_batch, share_prefix=not no_share, chat_template=not no_chat_template,
                                enforce_eager=True if enforce_eager else None, batch_invariant=batch_invariant, mixed_prefill_tokens=mixed_prefill_tokens,
                                order="input" if use_ray else order)  # Ray groups rows by prefix on the cluster
        defaults = sampling_defaults(sampling)
        part = _shard(shard, queries)
        if use_ray:
            _check_ray()
        source = JobSource.open(queries, template, fmt, defaults, id_field, prefix_order=config.order == "prefix",
                                shard=part, on_note=None if quiet else _json_note if json_log else _note)
    with source:
        if part is not None and not source.plan.rows(part.index):
            return _write_empty_shard(out, queries, part, source.plan.loads, resume, json_log)
        model_dir = resolve_model(model, config)
        config = config.replace(model=str(model_dir))
        check_kv_fits(model_dir, config)
        tokenizer = check_tokenizer(source.templates, model_dir, chat_template=config.chat_template)
        writing = dict(model_dir=model_dir, tokenizer=tokenizer, resume=resume, ordered=ordered or output_order == "input",
                       rerun_changed=rerun_changed, id_field=id_field)
        summary, signum = _answer(source, config, out, writing, quiet, json_log, stop_grace,
                                  ray=dict(workers=workers, address=ray_address) if use_ray else None)
    if queries == "-" and part is None and not summary.interrupted and \
            summary.requests + summary.skipped + summary.errors == 0:  # a file was checked before the model loaded
        fail("standard input held no rows; nothing was run")
    report(summary, out, quiet, json_log, signum)
# fmt: on


def _note(text: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(text)}", highlight=False)


def _json_note(text: str) -> None:
    from chunkgen.cli.progress import json_event

    json_event({"event": "warning", "message": text})


def _check_choices(
    fmt: str, order: str, output_order: str, max_new_tokens: int | None, rerun_without_resume: bool
) -> None:
    check_format(fmt)
    if order not in ORDERS:
        usage("--order", f"must be prefix or input, not {order!r}")
    if output_order not in OUTPUT_ORDERS:
        usage("--output-order", f"must be completion or input, not {output_order!r}")
    if max_new_tokens is not None and max_new_tokens < 1:
        usage("--max-new-tokens", f"must be at least 1, not {max_new_tokens}")
    if rerun_without_resume:
        usage("--rerun-changed", "goes with --resume")


def _shard(shard: str | None, queries: str):
    if shard is None:
        return None
    from chunkgen.jobs.shard import Shard

    try:
        part = Shard.parse(shard)
    except ValueError as exc:
        usage("--shard", str(exc))
    if queries == "-" or not Path(queries).is_file():
        usage(
            "--shard", "plans over the whole file before it runs: give --queries a file, not standard input or a pipe"
        )
    return part


def _check_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        fail("--ray needs Ray: pip install 'chunkgen[ray]'")


def _answer(
    source: JobSource,
    config: Config,
    out: Path,
    writing: dict[str, Any],
    quiet: bool,
    json_log: bool,
    stop_grace: float,
    ray: dict[str, Any] | None,
):
    """(summary, the signal that stopped the run or None): the rows answered into a writer on --out.
    From here on a signal is never a traceback: the writer may be repairing the file."""
    from chunkgen.jobs.ledger import OutputError
    from chunkgen.jobs.lock import OutputLocked
    from chunkgen.jobs.order import QueryFileChanged, TempSpaceError
    from chunkgen.jobs.writer import OutputExists, ResultWriter
    from chunkgen.model import display_name

    stop_flag = StopFlag(out, grace_s=stop_grace, announce="none" if quiet else "json" if json_log else "line")
    writer = None
    try:
        try:
            writer = ResultWriter(
                out,
                source.fmt,
                model_name=display_name(writing["model_dir"]),
                resume=writing["resume"],
                ordered=writing["ordered"],
                rerun_changed=writing["rerun_changed"],
                id_field=writing["id_field"],
            )
        except (OutputLocked, OutputExists, OutputError) as exc:
            fail(str(exc))
        except OSError as exc:
            fail(f"cannot write {out}: {exc.strerror or exc}")
        for note in writer.notes:
            err.print(f"note: {note}", highlight=False)
        if ray is not None:
            summary = _run_ray(source, writer, config, stop_flag, **ray)
        else:
            summary = _run_local(source, writer, config, stop_flag, quiet, json_log, writing["tokenizer"])
    except (OutputError, QueryFileChanged, TempSpaceError) as exc:
        fail(str(exc))
    except Interrupted as exc:  # during the model load: nothing was answered, nothing to keep
        if writer is not None:
            writer.close()
        name = signal.Signals(exc.signum).name
        err.print(f"interrupted ({name}) while the model loaded; nothing was answered", highlight=False)
        raise typer.Exit(EXIT_SIGNAL[exc.signum]) from None
    except KeyboardInterrupt:  # a second signal: stop at once, without the end-of-run rewrite
        stop_flag.settle()
        if writer is not None:
            writer.close(rewrite=False)
        err.print(
            f"stopped at once by a second signal: every record written to {out} is whole; run the "
            "same command with --resume to continue",
            highlight=False,
        )
        raise typer.Exit(EXIT_SIGNAL[stop_flag.signum or signal.SIGINT]) from None
    finally:
        if writer is not None:
            writer.close()  # after an error: releases the lock (a no-op when the run closed it)
        stop_flag.restore()
    if writer.rekeyed and not quiet:
        err.print(
            f"[yellow]warning:[/] {writer.rekeyed} row(s) were answered by an earlier run under another key (an id "
            f"added since): the same line and request, so those answers were kept as they are in {out}, with the "
            "ids they were written with",
            highlight=False,
        )
    # A signal that came after every row had its record (during the final rewrite) stopped nothing.
    return summary, stop_flag.signum if summary.interrupted else None


def _run_local(
    source: JobSource, writer, config: Config, stop_flag: StopFlag, quiet: bool, json_log: bool, tokenizer=None
):
    from chunkgen.jobs.run import run_job

    with stop_flag.at_once():  # a signal during the load ends the run now, not after the load
        llm = load_llm(config, announce="none" if quiet else "json" if json_log else "line", tokenizer=tokenizer)
    if any(t.output for t in (source.templates or {}).values()):
        llm.engine.constraints.prepare()  # a template's constraint: its rows need llguidance's tokenizer
    if source.prefix_order is not None and not (quiet or json_log):
        err.print(
            "--order prefix: every row is read and keyed by its prompt's text, so rows sharing a prefix run "
            "together (--order input skips this pass); in a file of over 2,048 rows the first 256, then one in "
            "64 of the rest, are answered in file order while the rest are keyed",
            highlight=False,
        )
    on_progress, stop_progress = progress_printer(quiet, json_log, source.total)
    try:
        summary = run_job(
            llm.engine,
            llm.encode,
            source.items,
            writer,
            total=source.total,
            should_stop=stop_flag,
            stop_now=stop_flag.overdue,
            on_progress=on_progress,
            order=source.prefix_order,
            on_note=None if quiet else _json_note if json_log else _note,
        )
    finally:
        stop_progress()
    loaded = llm.config
    summary.dtype, summary.device, summary.kv_memory = dtype_text(loaded), device_text(loaded), kv_text(loaded)
    if weights := weights_text(llm):
        summary.dtype += f"; {weights}"
    summary.max_batch = f"{loaded.max_batch} ({loaded.why['max_batch']})"
    summary.batch_invariant = invariance_text(loaded)
    return summary


def _run_ray(source: JobSource, writer, config: Config, stop_flag: StopFlag, workers: int | None, address: str | None):
    from chunkgen.scale.ray import run_on_ray

    def started(shape) -> None:
        err.print(
            f"ray: {shape.count} workers, each with {shape.num_cpus:g} CPU(s)"
            + (f" and {shape.num_gpus} GPU" if shape.num_gpus else ""),
            highlight=False,
        )

    t0 = time.perf_counter()
    try:
        summary = run_on_ray(
            source.items,
            writer,
            config,
            workers,
            address=address,
            should_stop=stop_flag,
            on_start=started,
            stop_now=stop_flag.overdue,
        )
    except (ValueError, RuntimeError) as exc:
        fail(str(exc))
    err.print(
        f"ray: {summary.requests} answered, {summary.skipped} already done, {summary.errors} error record(s); "
        f"{time.perf_counter() - t0:.1f} s with {summary.workers} workers, {summary.model_loads} model loads",
        highlight=False,
    )
    return summary


def _write_empty_shard(out: Path, queries: str, part, loads: list[int], resume: bool, json_log: bool) -> None:
    """A shard the plan gave no rows: its (empty) output file, so a collect step finds every shard's."""
    from chunkgen.jobs.lock import OutputLock, OutputLocked
    from chunkgen.jobs.run import JobSummary

    try:
        with OutputLock(out):
            if out.exists() and out.stat().st_size and not resume:
                fail(f"{out} already has results; pass --resume to continue it, or choose another --out")
            out.touch()
    except OutputLocked as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")
    err.print(
        f"shard {part.index}/{part.count}: none of the {sum(loads)} rows of {queries} fall to this shard "
        f"(rows per shard: {', '.join(map(str, loads))}); wrote an empty {out}",
        highlight=False,
    )
    if json_log:
        summary = JobSummary(
            requests=0,
            skipped=0,
            errors=0,
            changed=0,
            prompt_tokens=0,
            cached_tokens=0,
            completion_tokens=0,
            wall_s=0.0,
            prefill_s=0.0,
            decode_s=0.0,
            kv_peak_bytes=0,
            kv_unshared_peak_bytes=0,
            workers=0,
            model_loads=0,
        )
        print(json.dumps({"event": "summary", **summary.as_dict()}), file=sys.stderr, flush=True)
