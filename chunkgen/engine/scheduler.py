"""Iteration-level batching: who waits, who runs, who joins next, who is preempted."""
from __future__ import annotations

from collections import deque

from chunkgen.engine.sequence import Sequence


class Scheduler:
    def __init__(self, max_batch: int, group_prefix_tokens: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.group_prefix_tokens = group_prefix_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first

    def add(self, seqs: list[Sequence]) -> None:
        """Queue new sequences. Within one call, sequences with the same leading tokens are queued
        next to each other, so they are admitted together and share chunks while they run."""
        first_seen: dict[tuple[int, ...], int] = {}
        keyed = []
        for i, s in enumerate(seqs):
            key = tuple(s.tokens[: self.group_prefix_tokens])
            keyed.append((first_seen.setdefault(key, i), i, s))
        self.waiting.extend(s for _, _, s in sorted(keyed, key=lambda t: (t[0], t[1])))

    def next_to_admit(self) -> Sequence | None:
        if self.waiting and len(self.running) < self.max_batch:
            return self.waiting[0]
        return None

    def admitted(self, seq: Sequence) -> None:
        self.waiting.popleft()
        self.running.append(seq)

    def drop_waiting_head(self) -> Sequence:
        return self.waiting.popleft()

    def youngest(self) -> Sequence:
        return self.running[-1]

    def preempted(self, seq: Sequence) -> None:
        """Back to the front of the queue; it will recompute its K/V when memory allows."""
        self.running.remove(seq)
        seq.preempted = True
        self.waiting.appendleft(seq)

    def finished(self, seq: Sequence) -> None:
        self.running.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
