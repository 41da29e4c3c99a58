"""`--shard i/N` for SLURM arrays and the like: a plan over the whole query file, made the same way
by every shard, that keeps each prompt-prefix group on one shard where it can and balances rows.

Groups are placed largest first on the lightest shard. A group that would bring that shard past
the limit (1.25x the mean rows, or on a small file the largest group up to WHOLE_GROUP_ROWS rows)
is split: the lightest shard is topped up to the mean and the rest is placed again. So no shard
holds more than max(1.25 x mean, ceil(mean), the largest group) rows, and at most N groups are
split: a split fills a shard, which then takes no more rows.
"""

from __future__ import annotations

import heapq
import math
import re
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from chunkgen.jobs.groups import group_digest
from chunkgen.jobs.requests import ErrorRecord, Job

WHOLE_GROUP_ROWS = 64  # a small file's groups stay whole up to this many rows where the bound allows
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
            raise ValueError(f"--shard takes i/N with 0 <= i < N, e.g. 0/4; got {text!r}")
        return cls(int(m.group(1)), int(m.group(2)))


@dataclass
class ShardPlan:
    """Where every row goes: per group, the shards of its consecutive pieces, in file order."""

    count: int
    pieces: dict  # group -> [(rows before this piece ends, shard), ...]
    loads: list[int]
    split_groups: int = 0

    def rows(self, shard: int) -> int:
        return self.loads[shard]

    def select(self, items: Iterable[Job | ErrorRecord], shard: int) -> Iterator[Job | ErrorRecord]:
        """The items of one shard, from the same rows the plan was made from."""
        seen: Counter = Counter()
        for item in items:
            key = group_digest(item)
            n = seen[key]
            seen[key] += 1
            if next(s for end, s in self.pieces[key] if n < end) == shard:
                yield item


def plan_items(items: Iterable[Job | ErrorRecord], count: int) -> ShardPlan:
    sizes: Counter = Counter(group_digest(item) for item in items)
    return plan_groups(sizes, count)


def plan_groups(sizes: dict[K, int], count: int) -> ShardPlan:
    """The plan for groups of these sizes (a dict in first-seen order: ties go to the earlier group)."""
    total = sum(sizes.values())
    mean = total / count
    largest = max(sizes.values(), default=0)
    fill = max(math.ceil(mean), min(largest, WHOLE_GROUP_ROWS))  # what a split tops a shard up to
    limit = max(fill, math.floor(1.25 * mean))  # what a whole group may bring a shard to
    loads = [0] * count
    lightest = [(0, s) for s in range(count)]  # a heap of (load, shard)
    pieces: dict[K, list[tuple[int, int]]] = {}
    split = 0
    for key in sorted(sizes, key=lambda k: -sizes[k]):  # stable: equal sizes keep file order
        left, placed, parts = sizes[key], 0, []
        while left:
            load, s = heapq.heappop(lightest)
            # The lightest shard is below the mean while rows remain, so `take` is at least 1.
            take = left if load + left <= limit else fill - load
            placed, left = placed + take, left - take
            loads[s] = load + take
            parts.append((placed, s))
            heapq.heappush(lightest, (loads[s], s))
        pieces[key] = parts
        split += len(parts) > 1
    return ShardPlan(count, pieces, loads, split)
