"""ChunkPool: K/V storage for every chunk of every layer, handed out in fixed-size slots."""

from __future__ import annotations

import heapq
import weakref
from collections import deque
from typing import NamedTuple

import torch

from chunkgen.cache.pages import (
    advise_huge_pages,
    give_back,
    huge_page_aligned,
    huge_page_slots,
    page_size,
    populate_in_background,
)
from chunkgen.device import indexed

# Steps whose peak use the pool keeps backed: free slots up to the largest of these peaks stay
# resident for the next steps (a prefill wave frees its rows' chunks and the next one takes them
# again), only what lies above them goes back to the OS.
RECENT_STEPS = 32
# The least a run of free slots gives back at once, across all layers: fewer, larger madvise calls,
# and a run too short to matter is not worth faulting in again later.
MIN_RUN_BYTES = 64 << 20


PREFAULT_BYTES = 512 << 20  # at most this much of the pool is backed ahead of use


class PoolExhausted(RuntimeError):
    """The memory budget has no free slot left; the caller decides (evict, wait, preempt)."""


class KVMemoryError(ValueError):
    """The device cannot give the K/V storage the budget asks for (a --kv-memory too large)."""


def language_config(config):
    """The language model's part of a Hugging Face config: the config itself, or the `text_config`
    a multimodal checkpoint (Gemma 3 4B and up) nests it in."""
    return getattr(config, "text_config", None) or config


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a Hugging Face decoder config: what one token's K (or V)
    spans, so every user of the cache sizes it the same way."""
    config = language_config(config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


class WriteIndices(NamedTuple):
    """Where a write's rows go: slot and offset (int32), checked against the pool and on its
    device (ChunkPool.write_indices)."""

    slots: torch.Tensor
    offsets: torch.Tensor


class ChunkPool:
    """Slots of `chunk_size` tokens of K and V for all layers, with a free list and a byte budget.

    Layout (what the kernels read): K `[layers, slots, kv_heads, head_dim, chunk]` (keys stored
    transposed so a chunk's scores are vertical FMAs), V `[layers, slots, kv_heads, chunk, head_dim]`.

    The budget's worth of slots is reserved once as uninitialised memory; slots are handed to the
    free list in slabs, and on the CPU the OS backs a slab's pages only when they are first written,
    so memory in use follows `capacity`, not the budget (the slots a batch of `ready_rows`
    sequences starts with are backed from the start, in the background: see
    `pages.populate_in_background`). One slot past the budget's, `scratch_slot`, is never handed
    out: padded rows of a decode batch write their K/V there.

    The lowest free slot is handed out first, so the slots in use stay packed at the bottom and the
    free ones gather in runs above them. `end_step` gives the pages of free slots back to the OS
    in runs (`give_back_pages`), sparing as many free slots as the recent steps' peak use needs
    again, so memory follows what the work holds, not what it once held.
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        chunk_size: int,
        dtype: torch.dtype,
        budget_bytes: int,
        device: torch.device | str = "cpu",
        slab_slots: int = 64,
        ready_rows: int = 0,
        storage: bool = True,
        tensors: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """storage=False keeps only the bookkeeping (for planning, e.g. `inspect-tree`). tensors:
        K and V storage of another pool of the same shape and dtype, with at least this budget's
        slots plus the scratch slot, to use instead of reserving new memory (see KVReservation).
        ready_rows: the batch the pool expects; the slots its first wave writes (a chunk a row past
        a shared prompt, two slabs at least) are backed ahead of use."""
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.chunk_size, self.dtype, self.device = chunk_size, dtype, indexed(device)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_slot = 2 * num_layers * kv_heads * head_dim * chunk_size * itemsize
        self.max_slots = int(budget_bytes) // self.bytes_per_slot
        if self.max_slots < 1:
            raise ValueError(
                f"KV memory budget of {budget_bytes} bytes holds no chunk "
                f"(one chunk of {chunk_size} tokens needs {self.bytes_per_slot} bytes)"
            )
        self.slab_slots = max(1, slab_slots)
        self.has_storage = storage
        self.scratch_slot = self.max_slots
        stored = self.max_slots + 1 if storage else 0
        shape_k = (num_layers, stored, kv_heads, head_dim, chunk_size)
        shape_v = (num_layers, stored, kv_heads, chunk_size, head_dim)
        self.prefault = None  # the thread backing the first wave's slots (CPU storage of its own)
        if tensors is None:
            try:
                if self.device.type == "cpu" and stored:
                    # Each layer starts on a huge page (its slots padded to whole huge pages; the
                    # padding, never handed out, is never backed): the slots a wave writes then
                    # touch at most one huge page past their end in each layer's K and V, where an
                    # unaligned layer touched up to two (a 7B model's 2,080-token wave: 0.13-0.15
                    # GiB of K/V pages past the 1.03 GiB it wrote). Each layer stays contiguous.
                    padded = huge_page_slots(stored, self.bytes_per_slot // (2 * num_layers))
                    self.k = huge_page_aligned((num_layers, padded, *shape_k[2:]), dtype)[:, :stored]
                    self.v = huge_page_aligned((num_layers, padded, *shape_v[2:]), dtype)[:, :stored]
                else:
                    self.k = torch.empty(shape_k, dtype=dtype, device=self.device)
                    self.v = torch.empty(shape_v, dtype=dtype, device=self.device)
            except (torch.cuda.OutOfMemoryError, MemoryError):
                from chunkgen.device import free_bytes, human_bytes

                raise KVMemoryError(
                    f"the KV memory budget ({human_bytes(budget_bytes)}) does not fit in what {self.device} has "
                    f"free ({human_bytes(free_bytes(self.device))}): give a smaller --kv-memory, or auto"
                ) from None
            for t in (self.k, self.v):
                advise_huge_pages(t)
            # The slots handed out first (lowest first, see _grow), backed ahead of use: a first
            # wave's private chunk a row and two slabs for what the rows share, in whole slabs, and
            # no more than PREFAULT_BYTES: a large model's slots are large (a 7B model's 64-token
            # chunk is 32 MiB in bf16, two slabs 4 GiB) and its prefill slow beside the faults.
            first = min(stored, -(-ready_rows // self.slab_slots) * self.slab_slots + 2 * self.slab_slots)
            first = min(first, max(1, PREFAULT_BYTES // self.bytes_per_slot))
            self.prefault = populate_in_background(
                [t[layer, :first] for t in (self.k, self.v) for layer in range(num_layers)]
            )
        else:
            self.k, self.v = tensors
            for name, t, shape in (("K", self.k, shape_k), ("V", self.v, shape_v)):
                fits = (
                    t.dim() == 5
                    and t.shape[0] == shape[0]
                    and t.shape[1] >= stored
                    and t.shape[2:] == shape[2:]
                    and t.dtype == dtype
                    and t.device == self.device
                )
                if not fits:
                    raise ValueError(
                        f"{name} storage {tuple(t.shape)} {t.dtype} on {t.device} cannot hold a pool "
                        f"of {tuple(shape)} {dtype} on {self.device}"
                    )
        self.capacity = 0  # slots handed to the free list so far
        self._free: list[int] = []  # a heap: the lowest free slot is handed out first
        self.used = 0
        self.peak = 0
        # Slots whose pages may be backed: handed out since they were last given back, or
        # populated ahead of use. `idle_resident` of them are not in use now.
        self._resident = bytearray()  # sized where pages are tracked (_track_pages): one byte a slot
        self.idle_resident = 0
        self._step_peak = 0  # the most slots in use at once since the last end_step
        self._recent: deque[int] = deque(maxlen=RECENT_STEPS)
        self.given_back_bytes = 0  # returned to the OS so far (bytes of pool storage)
        self.given_back_runs = 0
        self._frees = 0  # slots freed so far
        self._rescan_at = 0  # a scan that found no run waits for this many frees
        self._page = 0  # the page size pages are given back in; 0: never (not this pool's CPU storage)
        self.min_run_slots = 0
        self.ready_slots = 0  # slots populated ahead of use, for the batch the pool was made for
        if tensors is None and storage and self.device.type == "cpu":
            self.ready_slots = min(first, self.max_slots) if self.prefault is not None else 0
            resident = bytearray(self.max_slots)
            resident[: self.ready_slots] = b"\x01" * self.ready_slots
            self._track_pages(page_size(self.k), resident, self.ready_slots)

    def _track_pages(self, page: int, resident: bytearray, ready: int) -> None:
        """Give pages back in `page`s, `resident` saying which slots' pages may be backed (the
        storage's, shared by every pool over it); the `ready` slots backed for the expected batch
        count as a recent step's use, so they are not given back before that batch could use them."""
        self._page, self._resident = page, resident
        self.idle_resident = sum(resident[: self.max_slots])  # (before any slot is handed out)
        per_layer = self.k[0, 0].numel() * self.k.element_size()  # one slot of K (or V) in one layer
        # A run yields pages only if it spans a whole page in every layer: two pages' worth at least.
        self.min_run_slots = max(-(-MIN_RUN_BYTES // self.bytes_per_slot), -(-2 * page // per_layer))
        if ready:
            self._recent.append(ready)

    @classmethod
    def for_run(
        cls,
        shape: tuple[int, int, int],
        config,
        device: torch.device | str = "cpu",
        kv_dtype: torch.dtype | None = None,
    ) -> ChunkPool:
        """The pool a run's `Config` asks for, for a model's (layers, kv_heads, head_dim): its chunk
        size, K/V dtype (`kv_dtype` where the config has none yet) and budget, with the slots of
        the scheduler's first wave backed from the start."""
        from chunkgen.engine.scheduler import first_wave_rows  # here: the engine package imports this one

        return cls(
            *shape,
            config.chunk_size,
            config.kv_dtype or kv_dtype,
            config.kv_memory,
            device=device,
            ready_rows=first_wave_rows(config.max_batch, "max_batch" in config.auto),
        )

    @classmethod
    def for_config(
        cls,
        config,
        chunk_size: int,
        dtype: torch.dtype,
        budget_bytes: int,
        device: torch.device | str = "cpu",
        storage: bool = True,
    ) -> ChunkPool:
        """A pool shaped for a Hugging Face model config (see kv_shape)."""
        layers, kv_heads, head_dim = kv_shape(config)
        return cls(layers, kv_heads, head_dim, chunk_size, dtype, budget_bytes, device=device, storage=storage)

    def chunks_for(self, n_tokens: int) -> int:
        """Chunks a sequence of n_tokens occupies on its own."""
        return -(-n_tokens // self.chunk_size)

    # -- allocation -------------------------------------------------------------------------
    def allocate(self) -> int:
        if not self._free:
            self._grow()
        slot = heapq.heappop(self._free)
        if self._page:
            if self._resident[slot]:
                self.idle_resident -= 1
            else:
                self._resident[slot] = 1
        self.used += 1
        self.peak = max(self.peak, self.used)
        self._step_peak = max(self._step_peak, self.used)
        return slot

    def free(self, slot: int) -> None:
        heapq.heappush(self._free, slot)
        self.idle_resident += self._page > 0
        self.used -= 1
        self._frees += 1

    @property
    def free_slots(self) -> int:
        """Slots that can still be allocated without evicting anything."""
        return len(self._free) + self.max_slots - self.capacity

    def _grow(self) -> None:
        n = min(self.slab_slots, self.max_slots - self.capacity)
        if n <= 0:
            raise PoolExhausted(
                f"KV cache budget exhausted: all {self.max_slots} chunks "
                f"({self.max_slots * self.bytes_per_slot} bytes) are in use"
            )
        # Lower slot numbers are used first, which keeps touched pages dense. (Appending ascending
        # numbers above every free slot keeps the list a heap.)
        self._free.extend(range(self.capacity, self.capacity + n))
        self.capacity += n

    # -- pages --------------------------------------------------------------------------------
    def end_step(self) -> int:
        """A step is over: give back the pages of the free slots that the recent steps' peak use
        does not need, if they make runs worth it. Cheap when there is nothing to give (the
        usual case): a comparison. Returns the bytes given back."""
        self._recent.append(max(self._step_peak, self.used))
        self._step_peak = self.used
        if not self._page:
            return 0
        spare = max(0, max(self._recent) - self.used)  # free slots the next steps may take again
        if self.idle_resident - spare < self.min_run_slots or self._frees < self._rescan_at:
            return 0
        given = self.give_back_pages(spare)
        if not given:  # the free slots are scattered: look again once a run's worth more were freed
            self._rescan_at = self._frees + self.min_run_slots
        return given

    def give_back_pages(self, spare: int = 0) -> int:
        """Return to the OS the pages of free slots in runs of at least `min_run_slots` consecutive
        ones whose pages may be backed, leaving the `spare` lowest such free slots as they are (the
        next allocations take the lowest first). A slot's K and V of each layer are separate
        ranges, so a run is one madvise per layer and tensor. Returns the bytes given back."""
        if not self._page:
            return 0
        resident = self._resident
        beyond = resident.find(1, self.capacity, self.max_slots)  # slots never handed out by this pool
        idle = sorted(s for s in self._free if resident[s])
        if beyond >= 0:
            idle += [s for s in range(beyond, self.max_slots) if resident[s]]
        idle = idle[spare:]
        given = 0
        start = 0
        for i in range(1, len(idle) + 1):
            if i == len(idle) or idle[i] != idle[i - 1] + 1:
                if i - start >= self.min_run_slots:
                    given += self._give_back_run(idle[start], idle[i - 1] + 1)
                start = i
        return given

    def _give_back_run(self, first: int, end: int) -> int:
        """One run [first, end): the whole pages inside it in each layer's K and V. The slots wholly
        inside what went back in every one of them count as given back; those at the run's ends
        that share a page with a neighbour stay counted as backed (a later, longer run takes them)."""
        given = 0
        lo, hi = first, end
        for t in (self.k, self.v):
            per_slot = t[0, 0].numel() * t.element_size()
            for layer in range(self.num_layers):
                base = t[layer, first].data_ptr()
                start, stop = give_back(base, (end - first) * per_slot, self._page)
                given += stop - start
                lo = max(lo, first + -(-(start - base) // per_slot))
                hi = min(hi, first + (stop - base) // per_slot)
        for slot in range(lo, hi):
            self._resident[slot] = 0
        self.idle_resident -= max(0, hi - lo)
        if given:
            self.given_back_bytes += given
            self.given_back_runs += 1
        return given

    @property
    def resident_slots(self) -> int:
        """Slots whose pages may be backed now (in use, or free and not given back)."""
        return self.used + self.idle_resident

    # -- data movement ----------------------------------------------------------------------
    def copy_tokens(self, src: int, dst: int, n: int) -> None:
        """Copy the first n tokens of slot src into slot dst, in every layer."""
        if n > 0 and self.has_storage:
            self.k[:, dst, :, :, :n] = self.k[:, src, :, :, :n]
            self.v[:, dst, :, :n] = self.v[:, src, :, :n]

    def write_indices(self, slots: torch.Tensor, offsets: torch.Tensor) -> WriteIndices:
        """(slot, offset) of each row a write stores, checked on the host against the pool (a bad
        one is an error naming it, where indexing on a GPU would meet a device-side assert) and
        then put on the pool's device: made once for all of a wave's layers."""
        from chunkgen._native import native

        host = [t.to("cpu", torch.int32).contiguous() for t in (slots, offsets)]
        native().check_write_indices(*host, self.k.shape[1], self.chunk_size)
        if self.device.type == "cpu":
            return WriteIndices(*host)
        return WriteIndices(*(t.pin_memory().to(self.device, non_blocking=True) for t in host))

    def write(self, layer: int, at: WriteIndices, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v `[rows, kv_heads, head_dim]` at the positions `at` (write_indices) of one
        layer, in one native pass that converts to the pool's dtype as it goes (on a GPU, one
        kernel)."""
        from chunkgen._native import native

        native().write_kv(k, v, self.k[layer], self.v[layer], at.slots, at.offsets)

    def gather(self, layer: int, slots: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K, V `[kv_heads, n_tokens, head_dim]` of a path of slots (all full but the last)."""
        c = self.chunk_size
        if self.device.type == "cpu":  # one native pass instead of an index copy and a transposing copy
            from chunkgen._native import native

            n = int(n_tokens)
            k = torch.empty(self.kv_heads, n, self.head_dim, dtype=self.dtype)
            v = torch.empty_like(k)
            native().gather_kv(self.k[layer], self.v[layer], slots.to(torch.long).contiguous(), n, k, v)
            return k, v
        if not 0 <= n_tokens <= len(slots) * c:  # as the native gather says it
            raise ValueError(f"n = {n_tokens} tokens do not fit {len(slots)} chunks of {c}")
        slots = slots.to(self.device)
        k = self.k[layer, slots].permute(1, 0, 3, 2).reshape(self.kv_heads, -1, self.head_dim)
        v = self.v[layer, slots].permute(1, 0, 2, 3).reshape(self.kv_heads, -1, self.head_dim)
        return k[:, :n_tokens], v[:, :n_tokens]

    # -- accounting -------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self.used * self.bytes_per_slot

    @property
    def peak_bytes(self) -> int:
        return self.peak * self.bytes_per_slot

    def check(self) -> None:
        """Invariants for tests: every handed-out slot is free xor used, and the counts add up."""
        assert len(set(self._free)) == len(self._free), "a slot is on the free list twice"
        assert all(0 <= s < self.capacity for s in self._free)
        assert len(self._free) + self.used == self.capacity
        if not self._page:
            return
        idle = sum(self._resident[s] for s in self._free) + sum(self._resident[self.capacity : self.max_slots])
        assert self.idle_resident == idle, f"{self.idle_resident} resident slots not in use counted, {idle} are"


class KVReservation:
    """One K/V reservation that the engines of one LLM take turns on, so a second engine does not
    reserve the budget again (on a GPU the pool's memory is taken at once, not as chunks fill).

    An engine `lease`s a fresh pool (an empty free list) over the reserved storage; the lease
    fails while the engine holding it still has requests (their K/V live there). The engine that
    held it before loses its cached chunks and leases again when it is given new requests."""

    def __init__(self, pool: ChunkPool) -> None:
        self.base = pool
        self._holder: weakref.ref | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) the storage holds."""
        return self.base.num_layers, self.base.kv_heads, self.base.head_dim

    def fits(self, chunk_size: int, dtype: torch.dtype, budget_bytes: int) -> bool:
        base = self.base
        return (
            chunk_size == base.chunk_size
            and dtype == base.dtype
            and int(budget_bytes) // base.bytes_per_slot <= base.max_slots
        )

    @property
    def holder(self) -> object | None:
        return self._holder() if self._holder is not None else None

    def lease(self, engine: object, budget_bytes: int) -> ChunkPool:
        """A pool of `budget_bytes` (at most the reservation's) over the reserved storage, for
        `engine` (an Engine: its scheduler says whether sequences still need their K/V)."""
        current = self.holder
        if current is not None and current is not engine and current.scheduler.has_work:  # type: ignore[attr-defined]
            raise RuntimeError(
                "another engine of this LLM still has requests and holds its KV memory: finish them "
                "(or drop that engine) before giving requests to this one"
            )
        b = self.base
        pool = ChunkPool(
            b.num_layers,
            b.kv_heads,
            b.head_dim,
            b.chunk_size,
            b.dtype,
            budget_bytes,
            device=b.device,
            slab_slots=b.slab_slots,
            tensors=(b.k, b.v),
        )
        if b._page:  # the same pages: whoever held them before, their free ones can go back
            pool._track_pages(b._page, b._resident, b.ready_slots)
        self._holder = weakref.ref(engine)
        return pool
