"""The end of a run in words: the summary table (or one JSON line), what changed since a resumed
run, and the exit code that says how it ended."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import typer
from rich.table import Table

from chunkgen.cli.boundary import EXIT_BAD_INPUT_LINES, err
from chunkgen.device import human_bytes
from chunkgen.jobs.stop import EXIT_SIGNAL


def report(summary, out: Path, quiet: bool, json_log: bool, signum: int | None) -> None:
    if json_log:
        print(json.dumps({"event": "summary", **summary.as_dict()}), file=sys.stderr, flush=True)
    elif summary.requests == 0 and summary.errors == 0 and summary.skipped and not signum:
        err.print(f"every query was already answered in {out} ({summary.skipped} rows); nothing to do", highlight=False)
    else:
        table = Table(title=f"chunkgen run → {out}", show_header=False)
        table.add_row("requests answered", str(summary.requests))
        table.add_row("skipped (already in output)", str(summary.skipped))
        table.add_row("error records", str(summary.errors))
        mixed = (
            f"; {summary.mixed_steps} of {summary.decode_steps} decode steps ran a prefill wave too"
            if summary.mixed_steps
            else ""
        )
        table.add_row(
            "wall time",
            f"{summary.wall_s:.1f} s (prefill {summary.prefill_s:.1f} s, decode {summary.decode_s:.1f} s{mixed})",
        )
        table.add_row("generated tokens", f"{summary.completion_tokens} ({summary.tokens_per_s:.1f} tok/s)")
        table.add_row(
            "prompt tokens",
            f"{summary.prompt_tokens}: {summary.cached_tokens} from the cache "
            f"(hit rate {100 * summary.cache_hit_rate:.1f}%)"
            + (f", {summary.prefilled_tokens} computed" if summary.prefilled_tokens else ""),
        )
        if summary.order == "prefix":
            head = f"; {summary.order_head} rows answered in file order meanwhile" if summary.order_head else ""
            table.add_row("order", f"prefix (every row keyed: {summary.order_s:.1f} s{head})")
        if summary.workers > 1 or summary.model_loads != 1:
            table.add_row("workers (model loads)", f"{summary.workers} ({summary.model_loads})")
            table.add_row("peak KV memory per worker", ", ".join(map(human_bytes, summary.kv_peak_bytes_per_worker)))
        if summary.constrained:
            table.add_row(
                "answers matching their constraint",
                f"{summary.matched} of {summary.constrained}"
                + (
                    " (the others were cut short by max_new_tokens or a stop string)"
                    if summary.matched < summary.constrained
                    else ""
                ),
            )
        if summary.dtype:
            table.add_row("dtype", summary.dtype)
        if summary.device:
            table.add_row("device", summary.device)
        if summary.kv_memory:
            table.add_row("KV budget", summary.kv_memory)
        if summary.batch_invariant:
            table.add_row("batch-invariant", summary.batch_invariant)
        if summary.peak_batch:
            table.add_row(
                "batch",
                f"peak {summary.peak_batch} sequences"
                + (f", at most {summary.max_batch}" if summary.max_batch else "")
                + (
                    f"; rows waited for KV memory in {summary.held_back_steps} steps" if summary.held_back_steps else ""
                ),
            )
        table.add_row(
            "peak KV memory",
            f"{human_bytes(summary.kv_peak_bytes)} (the same sequences without sharing: "
            f"{human_bytes(summary.kv_unshared_peak_bytes)})",
        )
        err.print(table)
    if summary.changed:
        err.print(
            f"[yellow]warning:[/] {summary.changed} answer(s) in {out} were made for a request that has "
            "changed since (its text, sampling or template); they were kept. Pass --rerun-changed "
            "with --resume to answer them again.",
            highlight=False,
        )
    if signum is not None:
        name = signal.Signals(signum).name
        err.print(
            f"stopped by {name}: {summary.requests + summary.errors} records written to {out} in this run; "
            "run the same command with --resume to continue",
            highlight=False,
        )
        raise typer.Exit(EXIT_SIGNAL[signum])
    if summary.errors:
        err.print(
            f"[yellow]{summary.errors} row(s) could not be answered; their error records are in {out}[/]",
            highlight=False,
        )
        raise typer.Exit(EXIT_BAD_INPUT_LINES)
