"""`chunkgen inspect-tree`: a job's prompts in one prefix tree, without running the model: the
forest, the KV memory with and without sharing, and the cache hit rate a run reaches in each order
(the figures are cache/forecast.py's)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from chunkgen.cli.boundary import app, stdout
from chunkgen.cli.option_types import CHUNK_SIZE, DTYPE, KV_DTYPE, KV_MEMORY, MAX_BATCH, MODEL
from chunkgen.cli.options import check_kv_fits, resolve_config, resolve_model, said_as_mistakes
from chunkgen.config import DEFAULT_CHUNK_SIZE, DEFAULT_DTYPE, DEFAULT_KV_MEMORY, DEFAULT_MAX_BATCH, DEFAULT_MODEL
from chunkgen.device import human_bytes
from chunkgen.jobs.source import JobSource, check_format, check_queries_path
from chunkgen.model.precision import DTYPE_NAMES


# One line per option: the signature reads like the --help it makes.
# fmt: off
@app.command("inspect-tree")
def inspect_tree(
    queries: str = typer.Option(..., "--queries", "-q", metavar="FILE", help="JSONL queries or an OpenAI batch file; - reads standard input."),
    template: Path | None = typer.Option(None, "--template", "-t", metavar="PATH", help="A .toml template or a directory of them."),
    model: MODEL = DEFAULT_MODEL,
    chunk_size: CHUNK_SIZE = DEFAULT_CHUNK_SIZE,
    dtype: DTYPE = DEFAULT_DTYPE,
    fmt: str = typer.Option("auto", "--format", metavar="FORMAT", help="auto, template or openai."),
    id_field: str = typer.Option("id", metavar="FIELD", help="Field of each row that holds its id."),
    json_out: Path | None = typer.Option(None, "--json", metavar="FILE", help="Write the figures as JSON here."),
    kv_memory: KV_MEMORY = DEFAULT_KV_MEMORY,
    kv_dtype: KV_DTYPE = None,
    max_batch: MAX_BATCH = DEFAULT_MAX_BATCH,
) -> None:
    """Insert every prompt into a prefix tree (no model run) and show sharing, memory, and the cache
    hit rate a run here with these options (--dtype, --kv-memory, --max-batch, --chunk-size) reaches in
    file order and in prefix order."""
    from chunkgen.cache.forecast import TreeForecast
    from chunkgen.model.loading import load_tokenizer

    with said_as_mistakes():
        check_format(fmt)
        config = resolve_config(device="cpu", dtype=dtype, chunk_size=chunk_size,
                                kv_memory=kv_memory, kv_dtype=kv_dtype, max_batch=max_batch)
        check_queries_path(queries)
        source = JobSource.open(queries, template, fmt, {}, id_field, prefix_order=True)
    with source:
        path = resolve_model(model)
        check_kv_fits(path, config)
        forecast = TreeForecast(path, config.chunk_size, config.kv_dtype, config.kv_memory, config.max_batch,
                                config.max_prefill_tokens)
        _feed(forecast, source, load_tokenizer(path), config.chunk_size)
    tree, st, templates_under = forecast.forest()
    view = Tree(f"[bold]prefix forest[/] ({st.sequences} prompts, chunk {config.chunk_size} tokens)")
    _draw(tree.root, view, templates_under)
    stdout.print(view)
    _print_figures(forecast, st, config)
    if json_out:
        json_out.write_text(json.dumps(forecast.figures(st), indent=2) + "\n")
# fmt: on


def _feed(forecast, source: JobSource, tokenizer, chunk_size: int) -> None:
    """Every prompt tokenized once and given to the forecast in file order, then in prefix order."""
    from chunkgen.jobs.requests import ErrorRecord
    from chunkgen.llm import encode_prompt

    tokens_of: dict[int, list[int]] = {}  # row index -> its prompt's tokens, until prefix order takes it
    template_of: dict[int, str] = {}

    def in_file_order():
        for index, item in enumerate(source.items):
            if isinstance(item, ErrorRecord):
                forecast.bad_rows += 1
                continue
            tokens = tokens_of[index] = encode_prompt(tokenizer, item.messages, item.data, item.layout)
            template_of[index] = item.template or "OpenAI rows"
            forecast.add_in_file_order(tokens)
            yield index, item

    for index, _ in source.prefix_order.apply(in_file_order(), chunk_size):
        forecast.add_in_prefix_order(tokens_of.pop(index), template_of.pop(index))


def _print_figures(forecast, st, config) -> None:
    budget = config.kv_memory
    table = Table(
        title=f"KV memory to hold all {st.sequences} prompts at once ({DTYPE_NAMES[config.kv_dtype]})", show_header=True
    )
    table.add_column("")
    table.add_column("chunks", justify="right")
    table.add_column("bytes", justify="right")
    table.add_row("with sharing", str(st.chunks_shared), human_bytes(st.bytes_shared))
    table.add_row(
        "without sharing (each prompt its own chunks)", str(st.chunks_unshared), human_bytes(st.bytes_unshared)
    )
    stdout.print(table)
    stdout.print(
        f"sharing ratio {100 * st.sharing_ratio:.1f}%: the share of chunks that sharing saves\n"
        f"prefill tokens saved {st.cache_hit_tokens} of {st.inserted_tokens}: prompt tokens already in the tree "
        "when each prompt is inserted, in file order and in prefill waves as a run forms them (the run's "
        "'from cache' count; a run with more prompts than --max-batch may differ by a few tokens), while its "
        "peak KV memory counts only the sequences running at once, with their answers\n"
        f"alignment loss {100 * st.alignment_loss:.1f}%: token slots left empty in partly filled chunks (the "
        f"last chunk of each prompt, and a shared prefix that ends inside a chunk), per token stored",
        highlight=False,
    )
    hits = Table(
        title=f"cache hit rate of a run with --kv-memory {human_bytes(budget)}, --max-batch {config.max_batch}"
    )
    for col in ("--order", "prompt tokens", "from the cache", "computed", "hit rate"):
        hits.add_column(col, justify="right")
    for name, r in forecast.replays.items():
        hits.add_row(
            name,
            str(r.prompt_tokens),
            str(r.cached_tokens),
            str(r.prompt_tokens - r.cached_tokens),
            f"{100 * r.hit_rate:.1f}%",
        )
    stdout.print(hits)
    if budget < st.bytes_shared:
        stdout.print(
            f"--kv-memory {human_bytes(budget)} is below the {human_bytes(st.bytes_shared)} the prompts need at once "
            "(with sharing): a run holds fewer of them together, so rows wait for others to finish, cached "
            "prefixes are evicted and computed again (the hit rates above count this), and a sequence whose "
            "answer outgrows the memory is preempted and recomputed; "
            f"--kv-memory {human_bytes(st.bytes_shared)} plus room for the answers would hold them all",
            highlight=False,
        )
    if forecast.too_long:
        stdout.print(
            f"{forecast.too_long} prompt(s) do not fit in --kv-memory {human_bytes(budget)} at all: a run refuses them"
        )


def _draw(node, view: Tree, templates_under: dict[int, set[str]], top: bool = True) -> None:
    """Shared runs are collapsed into one line; a fan-out of private tails is summarised. The
    outermost branches name the templates whose prompts they hold."""
    for child in node.children:
        run, cur = 1, child
        while len(cur.children) == 1 and cur.children[0].ref == cur.ref:
            cur, run = cur.children[0], run + 1
        if cur.ref <= 1 and not cur.children:
            continue
        label = f"{run} chunk(s) shared by {cur.ref} prompts"
        if top:
            names = sorted(templates_under.get(id(child), ()))
            label += f" · {'template' if len(names) == 1 else 'templates'} {', '.join(names)}"
        branch = view.add(escape(label))
        private = sum(1 for c in cur.children if c.ref <= 1)
        if private:
            branch.add(f"[dim]{private} private tail(s)[/]")
        _draw(cur, branch, templates_under, top=False)
