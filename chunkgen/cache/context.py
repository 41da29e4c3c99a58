"""KernelContext: the prefix tree flattened into the index arrays the decode kernels read.

The arrays live at fixed capacity in one flat int32 buffer, so a captured graph or a compiled
forward sees the same shapes and addresses from step to step:
- rows are padded to a bucket (the smallest of `buckets` that holds the batch); a padded row writes
  its K/V to a scratch slot and reads no chunk, so its output is zero;
- shared-chunk entries past the live ones cover no rows; capacities only grow (rarely, doubling).

Rebuilt only when the tree's structure changes (a join, a leave, a copy-on-write), into the same
buffer; a step that only appends tokens updates token counts and, every chunk_size steps, one
private slot per sequence. The step's per-row inputs (token, position, where its K/V go) sit at the
head of the same buffer, so `upload` moves a whole step to the device in one copy.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from chunkgen.cache.tree import ENTER, ROWS, Chunk, PrefixTree, SeqId


def checks_enabled() -> bool:
    """CHUNKGEN_CHECK_CONTEXT=1: validate every context rebuild and step fully (tests, debugging)."""
    return os.environ.get("CHUNKGEN_CHECK_CONTEXT", "0") not in ("", "0")


class ContextArrays(NamedTuple):
    """What the decode op reads, as tensors on the model's device (views of one buffer)."""

    tokens: torch.Tensor  # [rows] the step's input tokens
    positions: torch.Tensor  # [rows]
    write_slot: torch.Tensor  # [rows] where each row's new K/V go
    write_offset: torch.Tensor  # [rows]
    shared_slot: torch.Tensor  # [shared capacity]
    shared_len: torch.Tensor
    shared_begin: torch.Tensor
    shared_end: torch.Tensor
    part_off: torch.Tensor  # [shared capacity + 1] prefix sums of the shared chunks' rows
    seq_shared_ptr: torch.Tensor  # [rows + 1]
    seq_shared_idx: torch.Tensor  # [index capacity]
    priv_slot: torch.Tensor  # [rows, private width]
    priv_count: torch.Tensor  # [rows]
    priv_last_len: torch.Tensor  # [rows]


# Buffer layout: the fields a step changes first (uploaded every step), the tree's structure after.
_HOT = ("tokens", "positions", "write_slot", "write_offset", "priv_count", "priv_last_len")


def _pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


class KernelContext:
    def __init__(
        self,
        tree: PrefixTree,
        chunk_first: bool = True,
        buckets: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
        scratch_slot: int | None = None,
        mirror: bool | None = None,
    ) -> None:
        """buckets: padded batch sizes (None: rows = batch size exactly). device: where the op
        reads the arrays; mirror: keep a separate device buffer filled by `upload` (default: on any
        device but the CPU; tests turn it on for the CPU to count copies)."""
        self.tree = tree
        self.chunk_first = chunk_first
        self.buckets = sorted(set(buckets)) if buckets else None
        self.device = torch.device(device)
        self.scratch_slot = scratch_slot
        self.mirror = self.device.type != "cpu" if mirror is None else mirror
        self.version = -1
        self.order: list[SeqId] = []
        self.row_of: dict[SeqId, int] = {}
        self.excluded: frozenset[SeqId] = frozenset()  # live sequences left out of the rows (refresh)
        self.rows = 0
        self.rebuilds = 0
        self.layouts = 0  # bumped when capacities grow: shapes change (recompile, recapture)
        self.uploads = 0  # host->device copies issued
        self._caps = (0, 0, 0, 0)  # rows, private width, shared entries, index entries
        self._cold_dirty = True
        self.refresh()

    @property
    def batch_size(self) -> int:
        return len(self.order)

    @property
    def row_capacity(self) -> int:
        """Rows the current layout holds (the largest bucket): what buffers sized once per layout
        must cover."""
        return self._caps[0]

    @property
    def private_capacity(self) -> int:
        """Private chunks a row of the current layout holds (priv_slot's width)."""
        return self._caps[1]

    # -- layout -------------------------------------------------------------------------------
    def _allocate(self, rows: int, width: int, shared: int, index: int) -> None:
        sizes = {name: rows for name in _HOT}
        sizes.update(
            seq_shared_ptr=rows + 1,
            priv_slot=rows * width,
            shared_slot=shared,
            shared_len=shared,
            shared_begin=shared,
            shared_end=shared,
            part_off=shared + 1,
            seq_shared_idx=index,
        )
        total = sum(sizes.values())
        pin = self.mirror and self.device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=pin)
        self.dev = torch.zeros(total, dtype=torch.int32, device=self.device) if self.mirror else self.host
        self._np = self.host.numpy()
        self._offsets: dict[str, tuple[int, int]] = {}
        at = 0
        for name, n in sizes.items():
            self._offsets[name] = (at, n)
            at += n
        self._hot_len = sum(sizes[n] for n in _HOT)
        self._caps = (rows, width, shared, index)
        self.layouts += 1
        self._device_views: tuple[int, ContextArrays] | None = None

    def _np_view(self, name: str) -> np.ndarray:
        at, n = self._offsets[name]
        return self._np[at : at + n]

    def _view(self, buf: torch.Tensor, name: str, rows: int) -> torch.Tensor:
        at, n = self._offsets[name]
        if name == "priv_slot":
            width = self._caps[1]
            return buf[at : at + rows * width].view(rows, width)
        if name == "seq_shared_ptr":
            return buf[at : at + rows + 1]
        return buf[at : at + (rows if name in _HOT else n)]

    def __getattr__(self, name: str) -> torch.Tensor:
        # Host views of the arrays, sized for the current rows (tests and the reference read them).
        if name in ContextArrays._fields:
            return self._view(self.host, name, self.rows)
        raise AttributeError(name)

    def arrays(self) -> ContextArrays:
        """The op's arguments on the device: the same tensors while rows and layout stay."""
        key = (self.rows, self.layouts)
        if self._device_views is None or self._device_views[0] != key:
            self._device_views = (
                key,
                ContextArrays(*(self._view(self.dev, n, self.rows) for n in ContextArrays._fields)),
            )
        return self._device_views[1]

    def arrays_on(self, device: torch.device | str) -> ContextArrays:
        """The op's arguments on another device than the context's (a host context driving a GPU
        kernel in tests): the whole buffer in one copy, not one copy per array. Code that calls
        the op repeatedly (the engine, the benches) builds its context on the device instead."""
        buf = self.host.to(device)
        return ContextArrays(*(self._view(buf, n, self.rows) for n in ContextArrays._fields))

    def _rows_for(self, batch: int) -> int:
        if self.buckets is None:
            return batch
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"a batch of {batch} sequences exceeds the largest bucket ({self.buckets[-1]})")

    # -- keeping up with the tree ---------------------------------------------------------------
    def refresh(self, exclude: frozenset[SeqId] = frozenset()) -> None:
        """Bring the arrays up to date with the tree, as cheaply as its changes allow. `exclude`:
        live sequences that are not rows of this step (a prefill wave run in the same step: its
        sequences are in the tree, and decode only from the next step on)."""
        if self.version != self.tree.version or exclude != self.excluded:
            self.excluded = exclude
            self.rebuild()
            return
        paths = self.tree.paths
        slot = self._np_view("priv_slot")
        count = self._np_view("priv_count")
        width = self._caps[1]
        for row, seq in enumerate(self.order):
            tail = paths[seq][-1]
            if tail is not self._tails[row]:  # the tail filled up and a new private chunk began
                n = int(count[row])
                if n == width or tail.parent is not self._tails[row]:  # no room, or several chunks
                    self.rebuild()
                    return
                slot[row * width + n] = tail.slot
                count[row] = n + 1
                self._tails[row] = tail
                self._cold_dirty = True
        self._np_view("priv_last_len")[: len(self.order)] = [len(t.tokens) if t.ref == 1 else 0 for t in self._tails]

    def rebuild(self) -> None:
        """Recompute every array from the tree (what a structure change needs), in place. One walk
        over the live forest (tree.live_forest: its shared chunks and each row's private tail), so
        Python touches each live chunk once; the rows' lists of shared chunks, the bulk of the
        arrays (rows x shared depth), are laid out by numpy from each chunk's run of rows."""
        excluded = self.excluded
        order: list[SeqId] = []
        privates: list[list[Chunk]] = []  # per row, its private chunks
        shared: list[Chunk] = []
        begin: list[int] = []
        end: list[int] = []
        depth: list[int] = []  # a shared chunk's place in its rows' lists (shared ancestors above it)
        opened: list[int] = []  # the walk's shared chunks that some row reads: their indices
        pending: list[Chunk] = []  # the walk's shared chunks under which no row was read yet
        for kind, item in self.tree.live_forest().walk():
            if kind is ROWS:
                if excluded:
                    item = [r for r in item if r[0] not in excluded]
                    if not item:
                        continue
                if pending:  # the first row under them: their runs start here
                    row = len(order)
                    for chunk in pending:
                        depth.append(len(opened))
                        opened.append(len(shared))
                        shared.append(chunk)
                        begin.append(row)
                        end.append(row)
                    pending.clear()
                order.extend(seq for seq, _ in item)
                privates.extend(mine for _, mine in item)
            elif kind is ENTER:
                pending.append(item)
            elif pending:
                pending.pop()  # no row of this step reads it
            else:
                end[opened.pop()] = len(order)
        self.order = order
        self.row_of = {seq: i for i, seq in enumerate(order)}
        paths = self.tree.paths
        tails = [paths[seq][-1] for seq in order]
        n_private = [len(m) for m in privates]
        private = [c.slot for m in privates for c in m]
        B, S = len(order), len(shared)
        b = np.asarray(begin, dtype=np.int64)
        runs = np.asarray(end, dtype=np.int64) - b  # rows each shared chunk covers
        run_end = np.cumsum(runs)
        pairs = int(run_end[-1]) if S else 0  # (row, shared chunk) entries of seq_shared_idx
        self.rows = self._rows_for(B)
        rows_cap, width_cap, shared_cap, index_cap = self._caps
        need_width = max(n_private, default=0) + 4  # room to grow before a rebuild
        caps = (
            max(rows_cap, self.rows if self.buckets is None else self.buckets[-1]),
            max(width_cap, _pow2(need_width, 8)),
            max(shared_cap, _pow2(S, 8)),
            max(index_cap, _pow2(pairs, 16)),
        )
        if caps != self._caps:
            self._allocate(*caps)
        else:
            self._np[self._hot_len :] = 0
        rows, width = self.rows, self._caps[1]
        pad = self.scratch_slot if self.scratch_slot is not None else 0
        self._np_view("write_slot")[B:] = pad
        self._np_view("write_offset")[B:] = 0
        self._np_view("tokens")[B:] = 0
        self._np_view("positions")[B:] = 0
        self._np_view("shared_slot")[:S] = [c.slot for c in shared]
        self._np_view("shared_len")[:S] = [len(c.tokens) for c in shared]
        self._np_view("shared_begin")[:S] = begin
        self._np_view("shared_end")[:S] = end
        part_off = self._np_view("part_off")
        part_off[1 : S + 1] = run_end
        part_off[S + 1 :] = pairs
        ptr = self._np_view("seq_shared_ptr")
        ptr[0] = 0
        # a row's shared chunks: those whose runs have begun by it, less those that have ended
        edges = np.bincount(b, minlength=B + 1) - np.bincount(b + runs, minlength=B + 1)
        ptr[1 : B + 1] = np.cumsum(np.cumsum(edges[:B]))
        ptr[B + 1 : rows + 1] = pairs  # padded rows list no shared chunk
        if pairs:
            # Chunk c lists itself for rows begin[c].. at depth[c] of each row's list.
            chunk_of = np.repeat(np.arange(S, dtype=np.int32), runs)
            row_of = np.repeat(b - (run_end - runs), runs) + np.arange(pairs)
            at = ptr[:B][row_of] + np.repeat(np.asarray(depth, dtype=np.int64), runs)
            self._np_view("seq_shared_idx")[at] = chunk_of
        count = self._np_view("priv_count")
        count[:] = 0
        count[:B] = n_private
        if private:
            n = np.asarray(n_private, dtype=np.int64)
            first = np.cumsum(n) - n  # where each row's slots start in `private`
            row_of = np.repeat(np.arange(B, dtype=np.int64), n)
            at = row_of * width + np.arange(len(private)) - np.repeat(first, n)
            self._np_view("priv_slot")[at] = private
        self._np_view("priv_last_len")[:] = 0
        self._np_view("priv_last_len")[:B] = [len(t.tokens) if n else 0 for t, n in zip(tails, n_private)]
        self.shared_chunks = shared
        self._tails = tails
        self.version = self.tree.version
        self.rebuilds += 1
        self._cold_dirty = True
        if checks_enabled():
            self.validate()

    # -- the step -----------------------------------------------------------------------------
    def set_step(self, tokens: Sequence[int], positions: Sequence[int], write_rows: Sequence[tuple[int, int]]) -> None:
        """The step's per-row inputs, in `order`: token, position and (slot, offset) of its K/V
        (padded rows keep their scratch values). Whole columns at once: one numpy conversion per
        field, no Python loop over the rows."""
        n = len(tokens)
        self._np_view("tokens")[:n] = tokens
        self._np_view("positions")[:n] = positions
        if n:
            rows = np.asarray(write_rows, dtype=np.int32).reshape(n, 2)
            self._np_view("write_slot")[:n] = rows[:, 0]
            self._np_view("write_offset")[:n] = rows[:, 1]

    def upload(self) -> None:
        """One host->device copy: the step's fields, plus the tree's structure when it changed."""
        if checks_enabled():
            self.validate()
        if self.mirror:
            n = self.host.numel() if self._cold_dirty else self._hot_len
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
            self.uploads += 1
        self._cold_dirty = False

    def validate(self) -> None:
        """The full check of every index against the pool (also done by the op's debug mode)."""
        from chunkgen._native import native

        pool = self.tree.pool
        slots = pool.max_slots + 1  # the scratch slot too
        native().check_context(
            slots,
            pool.chunk_size,
            self.shared_slot,
            self.shared_len,
            self.shared_begin,
            self.shared_end,
            self.part_off,
            self.seq_shared_ptr,
            self.seq_shared_idx,
            self.priv_slot,
            self.priv_count,
            self.priv_last_len,
        )
        ws, wo = self._np_view("write_slot")[: self.rows], self._np_view("write_offset")[: self.rows]
        bad = np.flatnonzero((ws < 0) | (ws >= slots) | (wo < 0) | (wo >= pool.chunk_size))
        if bad.size:
            r = int(bad[0])
            raise ValueError(
                f"row {r} writes its K/V at slot {int(ws[r])}, offset {int(wo[r])}: outside "
                f"the pool ({slots} slots of {pool.chunk_size} tokens)"
            )

    def check(self) -> None:
        """Every shared chunk covers exactly the rows whose path holds it, and they are contiguous."""
        for c, chunk in enumerate(self.shared_chunks):
            rows = sorted(
                self.row_of[s] for s, p in self.tree.paths.items() if s in self.row_of and any(x is chunk for x in p)
            )
            assert rows == list(range(int(self.shared_begin[c]), int(self.shared_end[c]))), (
                f"shared chunk {c} covers rows {rows}, context says "
                f"[{int(self.shared_begin[c])}, {int(self.shared_end[c])})"
            )
