"""KernelContext: the prefix tree flattened into the index arrays the decode kernels read.

Rebuilt only when the tree's structure changes (a join, a leave, a copy-on-write); a step that only
appends tokens updates token counts and, every chunk_size steps, one private slot per sequence.
"""
from __future__ import annotations

import itertools

import torch

from chunkgen.cache.tree import Chunk, PrefixTree, SeqId

_stamps = itertools.count()  # unique across contexts: the GPU copy is keyed by it


class KernelContext:
    def __init__(self, tree: PrefixTree, chunk_first: bool = True) -> None:
        self.tree = tree
        self.chunk_first = chunk_first
        self.version = -1
        self.order: list[SeqId] = []
        self.row_of: dict[SeqId, int] = {}
        self.rebuilds = 0
        self.stamp = -1  # changes whenever any array changes; the device copy follows it
        self.refresh()

    @property
    def batch_size(self) -> int:
        return len(self.order)

    def refresh(self) -> None:
        """Bring the arrays up to date with the tree, as cheaply as its changes allow."""
        if self.version != self.tree.version:
            self.rebuild()
            return
        paths = self.tree.paths
        for row, seq in enumerate(self.order):
            tail = paths[seq][-1]
            if tail is not self._tails[row]:  # the tail filled up and a new private chunk began
                count = int(self.priv_count[row])
                if count == self.priv_slot.shape[1]:
                    self.rebuild()
                    return
                self.priv_slot[row, count] = tail.slot
                self.priv_count[row] = count + 1
                self._tails[row] = tail
        self.priv_last_len.copy_(
            torch.tensor([len(t.tokens) if t.ref == 1 else 0 for t in self._tails], dtype=torch.int32)
        )
        self.stamp = next(_stamps)

    def rebuild(self) -> None:
        """Recompute every array from the tree (what a structure change needs)."""
        tree = self.tree
        self.order = tree.batch_order()
        self.row_of = {seq: i for i, seq in enumerate(self.order)}
        shared_index: dict[int, int] = {}
        shared: list[Chunk] = []
        begin: list[int] = []
        end: list[int] = []
        seq_ptr = [0]
        seq_idx: list[int] = []
        private: list[list[int]] = []
        tails: list[Chunk] = []
        for row, seq in enumerate(self.order):
            path = tree.paths[seq]
            mine: list[int] = []
            for chunk in path:
                if chunk.ref > 1:
                    c = shared_index.get(id(chunk))
                    if c is None:
                        c = shared_index[id(chunk)] = len(shared)
                        shared.append(chunk)
                        begin.append(row)
                        end.append(row)
                    end[c] = row + 1
                    seq_idx.append(c)
                else:
                    mine.append(chunk.slot)
            seq_ptr.append(len(seq_idx))
            private.append(mine)
            tails.append(path[-1])
        width = max((len(p) for p in private), default=0) + 4  # room to grow before a rebuild
        i32 = torch.int32
        self.shared_chunks = shared
        self.shared_slot = torch.tensor([c.slot for c in shared], dtype=i32)
        self.shared_len = torch.tensor([len(c.tokens) for c in shared], dtype=i32)
        self.shared_begin = torch.tensor(begin, dtype=i32)
        self.shared_end = torch.tensor(end, dtype=i32)
        self.seq_shared_ptr = torch.tensor(seq_ptr, dtype=i32)
        self.seq_shared_idx = torch.tensor(seq_idx, dtype=i32)
        self.priv_slot = torch.zeros(len(self.order), width, dtype=i32)
        for row, mine in enumerate(private):
            self.priv_slot[row, : len(mine)] = torch.tensor(mine, dtype=i32)
        self.priv_count = torch.tensor([len(p) for p in private], dtype=i32)
        self.priv_last_len = torch.tensor(
            [len(t.tokens) if p else 0 for t, p in zip(tails, private)], dtype=i32
        )
        self._tails = tails
        self.version = tree.version
        self.rebuilds += 1
        self.stamp = next(_stamps)

    def check(self) -> None:
        """Every shared chunk covers exactly the rows whose path holds it, and they are contiguous."""
        for c, chunk in enumerate(self.shared_chunks):
            rows = sorted(self.row_of[s] for s, p in self.tree.paths.items() if any(x is chunk for x in p))
            assert rows == list(range(int(self.shared_begin[c]), int(self.shared_end[c]))), (
                f"shared chunk {c} covers rows {rows}, context says "
                f"[{int(self.shared_begin[c])}, {int(self.shared_end[c])})"
            )
