"""inspect-tree: names the templates of its branches, explains its figures, and counts prefill
tokens saved as a run does."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from chunkgen.cli import app
from tests.helpers import PROMPTS, base_args

runner = CliRunner()


def test_branches_name_their_templates_and_figures_are_explained(tiny_model, tmp_path):
    res = runner.invoke(
        app,
        ["inspect-tree", "-t", str(PROMPTS), "-q", str(PROMPTS / "mixed.queries.jsonl"), "--model", str(tiny_model)],
        terminal_width=400,
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    for name in ("tool_dispatcher", "arithmetic_cot", "document_qa"):
        assert f"· template {name}" in res.output
    assert "alignment loss" in res.output and "token slots left empty" in res.output
    assert "KV memory to hold all 40 prompts at once" in res.output


def test_prefill_tokens_saved_agree_with_a_run(tiny_model, tmp_path):
    common = [
        "-t",
        str(PROMPTS / "arithmetic_cot.toml"),
        "-q",
        str(PROMPTS / "arithmetic_cot.queries.jsonl"),
        "--model",
        str(tiny_model),
        "--chunk-size",
        "16",
    ]
    fig = tmp_path / "tree.json"
    res = runner.invoke(app, ["inspect-tree", *common, "--json", str(fig)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    planned = json.loads(fig.read_text())

    def summary(out: str, *extra: str) -> dict:
        run = base_args(tiny_model, tmp_path / out, quiet=None, max_new_tokens=2, dtype=None, json_log=True)
        res = runner.invoke(app, run + list(extra), catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return next(json.loads(l) for l in res.output.splitlines() if '"event": "summary"' in l)

    apart = summary("apart.jsonl", "--mixed-prefill-tokens", "0")  # every wave before the next decode step
    assert planned["prefill_tokens_saved"] == apart["cached_tokens"]
    assert planned["tokens"] == apart["prompt_tokens"]
    # Rows admitted while others decode may also match tokens those rows generated: never fewer hits.
    mixed = summary("mixed.jsonl")
    assert planned["prefill_tokens_saved"] <= mixed["cached_tokens"] <= planned["prefill_tokens_saved"] + 16


def test_the_planned_tree_holds_one_chunk_per_distinct_chunk_aligned_prefix(tiny_model):
    """Rows of one prefill wave that share a chunk still being computed wait for it instead of
    computing a copy, so the tree a run builds (and inspect-tree reports) is the minimum."""
    import random

    import torch
    from transformers import AutoConfig

    from chunkgen.cache import ChunkPool
    from chunkgen.cache.stats import plan_tree, tree_stats
    from chunkgen.config import DEFAULT_MAX_PREFILL_TOKENS

    rng = random.Random(0)
    system = [rng.randrange(400) for _ in range(1300)]
    # The system prompt ends 20 tokens into a 64-token chunk; openings shared by several rows fill
    # that chunk and end inside the next, so a row gains less than a chunk of tokens by waiting.
    openings = [[rng.randrange(400) for _ in range(rng.randrange(44, 60))] for _ in range(6)]
    prompts = [
        system + rng.choice(openings) + [rng.randrange(400) for _ in range(rng.randrange(1, 30))] for _ in range(64)
    ]
    for chunk in (16, 64):
        minimum = len({tuple(p[: k + chunk]) for p in prompts for k in range(0, len(p), chunk)})
        pool = ChunkPool.for_config(
            AutoConfig.from_pretrained(tiny_model), chunk, torch.float32, budget_bytes=1 << 40, storage=False
        )
        assert tree_stats(plan_tree(pool, prompts, DEFAULT_MAX_PREFILL_TOKENS)).chunks_shared == minimum


def test_a_budget_below_the_prompts_says_what_the_run_does_and_what_would_suffice(tiny_model):
    args = ["inspect-tree", "-t", str(PROMPTS), "-q", str(PROMPTS / "mixed.queries.jsonl"), "--model", str(tiny_model)]
    ample = runner.invoke(app, args, terminal_width=400, catch_exceptions=False)
    assert ample.exit_code == 0 and "need at once" not in ample.output
    tight = runner.invoke(app, [*args, "--kv-memory", "256KiB"], terminal_width=400, catch_exceptions=False)
    assert tight.exit_code == 0, tight.output
    text = " ".join(tight.output.split())
    assert "the prompts need at once" in text and "rows wait" in text and "preempted" in text
    assert "would hold them all" in text
    assert "a smaller --chunk-size lowers it" not in text  # not what its own figures show
