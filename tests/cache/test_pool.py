"""ChunkPool's slots and pages: the lowest free slot first, and free slots' pages handed back to
the OS in runs, sparing what the recent steps used, never touching a slot in use."""

from __future__ import annotations

import sys

import pytest
import torch

from chunkgen.cache import ChunkPool, KVReservation
from chunkgen.cache import pool as pool_module
from tests.helpers import resident

LAYERS, KVH, D, C = 2, 2, 64, 64  # 32 KiB of K (and of V) a slot and layer
PER_SLOT = 2 * LAYERS * KVH * D * C * 4
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and mincore are Linux's")


@pytest.fixture
def small_runs(monkeypatch):
    """Runs of 8 MiB (64 slots) are worth giving back, so the pools here stay small."""
    monkeypatch.setattr(pool_module, "MIN_RUN_BYTES", 8 << 20)
    monkeypatch.setenv("CHUNKGEN_PREFAULT", "0")


def make_pool(slots: int = 1024, **kwargs) -> ChunkPool:
    return ChunkPool(LAYERS, KVH, D, C, torch.float32, budget_bytes=slots * PER_SLOT, slab_slots=64, **kwargs)


def fill(pool: ChunkPool, slots: list[int]) -> None:
    for s in slots:
        pool.k[:, s] = float(s)
        pool.v[:, s] = -float(s)


def test_the_lowest_free_slot_is_handed_out_first():
    pool = make_pool(storage=False)
    slots = [pool.allocate() for _ in range(100)]
    assert slots == list(range(100))
    for s in (70, 3, 50):
        pool.free(s)
    assert [pool.allocate() for _ in range(4)] == [3, 50, 70, 100]
    pool.check()


@linux
def test_free_runs_go_back_to_the_os_and_slots_in_use_keep_their_contents(small_runs):
    pool = make_pool()
    assert pool.min_run_slots >= 64
    slots = [pool.allocate() for _ in range(800)]
    fill(pool, slots)
    keep = list(range(0, 10)) + list(range(600, 610))  # in use; between them a run of 590 free slots
    for s in slots:
        if s not in keep:
            pool.free(s)
    assert pool.idle_resident == 780
    given = pool.give_back_pages()
    pool.check()
    # The 590 free slots between the kept ones and the 190 above them: two runs, one madvise per
    # layer and tensor each; only whole pages inside the runs go (a page at most at each end stays).
    assert pool.given_back_runs == 2 and 0 < given <= 780 * PER_SLOT
    assert given >= (780 - 2 * 2 * pool.min_run_slots // 2) * PER_SLOT
    assert pool.idle_resident <= 2 * 2 * pool.min_run_slots // 2
    assert pool.given_back_bytes == given and pool.resident_slots == pool.used + pool.idle_resident
    for layer in range(LAYERS):
        assert resident(pool.k[layer, 100:500]) == 0.0 and resident(pool.v[layer, 100:500]) == 0.0
        for s in keep:
            assert torch.equal(pool.k[layer, s], torch.full_like(pool.k[layer, s], float(s)))
            assert torch.equal(pool.v[layer, s], torch.full_like(pool.v[layer, s], -float(s)))
    assert pool.give_back_pages() == 0  # nothing left to give: the runs are not given twice
    again = [pool.allocate() for _ in range(780)]  # handed out again: backed afresh when written
    fill(pool, again)
    assert resident(pool.k[0, 100:500]) == 1.0
    pool.check()


@linux
def test_short_runs_and_the_slots_recent_steps_used_stay_backed(small_runs):
    pool = make_pool()
    slots = [pool.allocate() for _ in range(400)]
    fill(pool, slots)
    for s in slots[1::2]:  # every other slot: many free slots, no run
        pool.free(s)
    assert pool.give_back_pages() == 0
    for s in slots[0::2]:
        pool.free(s)
    # 400 slots were in use in this step: the steps right after may need them again.
    assert pool.end_step() == 0
    for _ in range(pool_module.RECENT_STEPS - 1):
        assert pool.end_step() == 0
    assert pool.end_step() > 0  # no step has needed them for a while
    assert pool.idle_resident < pool.min_run_slots
    pool.check()


@linux
def test_spare_slots_are_the_lowest_ones(small_runs):
    pool = make_pool()
    slots = [pool.allocate() for _ in range(512)]
    fill(pool, slots)
    for s in slots:
        pool.free(s)
    pool.give_back_pages(spare=128)
    assert resident(pool.k[0, :128]) == 1.0 and resident(pool.k[0, 200:440]) == 0.0
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]


@linux
def test_a_lease_gives_back_the_reservations_pages_and_shares_what_is_backed(small_runs):
    reservation = KVReservation(make_pool())
    holder = type("Holder", (), {"scheduler": type("S", (), {"has_work": False})()})()
    first = reservation.lease(holder, 1024 * PER_SLOT)
    slots = [first.allocate() for _ in range(300)]
    fill(first, slots)
    second = reservation.lease(holder, 1024 * PER_SLOT)  # the first one's slots are all free garbage now
    assert second.give_back_pages() > 0
    assert resident(second.k[0, 70:230]) == 0.0  # (a page at each end may stay)
    assert first._resident is second._resident is reservation.base._resident


def test_a_pool_without_its_own_cpu_storage_gives_nothing_back(small_runs):
    for pool in (make_pool(storage=False), ChunkPool(1, 1, 4, 16, torch.float32, 1 << 20, tensors=None, storage=False)):
        for s in [pool.allocate() for _ in range(200)]:
            pool.free(s)
        assert pool.end_step() == 0 and pool.give_back_pages() == 0 and pool.given_back_bytes == 0
