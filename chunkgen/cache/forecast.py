"""What a job's prompts will do to the cache, without running the model (`chunkgen inspect-tree`):
the prefix forest of all prompts at once, the memory it takes with and without sharing, and the
cache hit rate a run with a given budget and batch reaches in file order and in prefix order.

The caller feeds the prompts' token ids twice, in file order (`add_in_file_order`) and in prefix
order (`add_in_prefix_order`, with the name of each prompt's template); the figures come from the
same bookkeeping-only pools and trees a run uses (cache/stats.py), so they agree with its summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chunkgen.cache.pool import ChunkPool
from chunkgen.cache.stats import CacheReplay, TreeStats, plan_tree, tree_stats
from chunkgen.cache.tree import PrefixTree


def planning_pool(model_dir: Path | str, chunk_size: int, kv_dtype: torch.dtype, budget: int = 1 << 62) -> ChunkPool:
    """A ChunkPool with bookkeeping only, shaped like the model's KV cache (for sizes and plans)."""
    from chunkgen.model.loading import model_config

    return ChunkPool.for_config(model_config(model_dir), chunk_size, kv_dtype, budget_bytes=budget, storage=False)


@dataclass
class TreeForecast:
    model_dir: Path | str
    chunk_size: int
    kv_dtype: torch.dtype
    kv_memory: int
    max_batch: int
    max_prefill_tokens: int
    bad_rows: int = 0
    names: list[str] = field(default_factory=list)  # per prompt in prefix order: its template
    prompts: list[list[int]] = field(default_factory=list)  # in prefix order, a run's default
    replays: dict[str, CacheReplay] = field(init=False)

    def __post_init__(self) -> None:
        self.replays = {order: CacheReplay(self._pool(self.kv_memory), self.max_batch) for order in ("input", "prefix")}

    def _pool(self, budget: int = 1 << 62) -> ChunkPool:
        return planning_pool(self.model_dir, self.chunk_size, self.kv_dtype, budget)

    def add_in_file_order(self, tokens: list[int]) -> None:
        self.replays["input"].add(tokens)

    def add_in_prefix_order(self, tokens: list[int], template: str) -> None:
        self.prompts.append(tokens)
        self.names.append(template)
        self.replays["prefix"].add(tokens)

    @property
    def too_long(self) -> int:
        """Prompts that do not fit the budget at all: a run refuses them."""
        return self.replays["input"].too_long

    def forest(self) -> tuple[PrefixTree, TreeStats, dict[int, set[str]]]:
        """Every prompt in one tree, inserted in prefill waves as a run forms them; its figures;
        and for each chunk (by id) the templates of the prompts that read it."""
        tree = plan_tree(self._pool(), self.prompts, self.max_prefill_tokens)
        templates_under: dict[int, set[str]] = {}
        for seq, path in tree.paths.items():
            for chunk in path:
                templates_under.setdefault(id(chunk), set()).add(self.names[seq])
        return tree, tree_stats(tree), templates_under

    def figures(self, st: TreeStats) -> dict[str, Any]:
        """The figures `inspect-tree --json` writes."""
        return {
            "sequences": st.sequences,
            "tokens": st.tokens,
            "chunks_shared": st.chunks_shared,
            "chunks_unshared": st.chunks_unshared,
            "bytes_shared": st.bytes_shared,
            "bytes_unshared": st.bytes_unshared,
            "sharing_ratio": st.sharing_ratio,
            "prefill_tokens_saved": st.cache_hit_tokens,
            "bad_lines": self.bad_rows,
            "kv_memory": self.kv_memory,
            "max_batch": self.max_batch,
            **{
                f"{name}_order": {
                    "prompt_tokens": r.prompt_tokens,
                    "cached_tokens": r.cached_tokens,
                    "prefilled_tokens": r.prompt_tokens - r.cached_tokens,
                    "cache_hit_rate": r.hit_rate,
                }
                for name, r in self.replays.items()
            },
        }
