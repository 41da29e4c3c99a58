"""The pool's pages: backed ahead of the first writes, in the background, contents untouched."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest
import torch

from chunkgen.cache import ChunkPool
from chunkgen.cache import pool as pool_module
from chunkgen.cache.pages import huge_page_slots, populate_in_background
from tests.helpers import PAGE, resident

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and mincore are Linux's")


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


@pytest.fixture(autouse=True)
def fresh_mappings():
    """Large tensors mapped afresh, as in a process that has not loaded a CPU model yet: after one
    has (an earlier test's), malloc keeps freed pages (keep_freed_pages) and would hand these tests
    memory that is already resident."""
    from chunkgen.cache import pages

    if not pages._kept:
        yield
        return
    libc = ctypes.CDLL(None)
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    for param in (pages._M_MMAP_THRESHOLD, pages._M_TRIM_THRESHOLD):
        libc.mallopt(param, 128 << 10)  # glibc's initial thresholds
    libc.malloc_trim(0)  # and the heap's kept top handed back: a large tensor could be cut from it
    try:
        yield
    finally:
        for param in (pages._M_MMAP_THRESHOLD, pages._M_TRIM_THRESHOLD):
            libc.mallopt(param, pages._KEEP_BYTES)


@pytest.fixture
def populate_supported():
    buf = torch.empty(4 * PAGE, dtype=torch.uint8)
    start = -(-buf.data_ptr() // PAGE) * PAGE
    if _libc().madvise(start, PAGE, 23) != 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")


def test_populating_backs_the_pages_and_keeps_what_they_hold(populate_supported, monkeypatch):
    monkeypatch.delenv("CHUNKGEN_PREFAULT", raising=False)
    t = torch.empty(48 << 20, dtype=torch.uint8)  # fresh anonymous memory: not backed yet
    t[: 1 << 20] = torch.arange(1 << 20, dtype=torch.int64).remainder(251).to(torch.uint8)
    before = resident(t)
    thread = populate_in_background([t])
    assert thread is not None
    thread.join(timeout=60)
    assert before < 0.5 and resident(t) == 1.0
    assert torch.equal(t[: 1 << 20], torch.arange(1 << 20, dtype=torch.int64).remainder(251).to(torch.uint8))


def test_a_pool_backs_its_first_two_slabs_and_only_its_own_storage(populate_supported, monkeypatch):
    monkeypatch.delenv("CHUNKGEN_PREFAULT", raising=False)
    pool = ChunkPool(3, 2, 64, 64, torch.float32, budget_bytes=256 << 20, slab_slots=16)  # 96 KiB a slot and layer
    pool.prefault.join(timeout=60)
    for layer in (0, 2):
        assert resident(pool.k[layer, :32]) == 1.0 and resident(pool.v[layer, :32]) == 1.0
        assert resident(pool.k[layer, 64:]) < 0.5  # the rest is backed when written
    # A pool expecting a batch of 20 rows: their first chunks too, in whole slabs (32 + 2 x 16 slots).
    pool = ChunkPool(3, 2, 64, 64, torch.float32, budget_bytes=256 << 20, slab_slots=16, ready_rows=20)
    pool.prefault.join(timeout=60)
    for layer in (0, 2):
        assert resident(pool.k[layer, :64]) == 1.0 and resident(pool.v[layer, :64]) == 1.0
        assert resident(pool.k[layer, 96:]) < 0.5
    # What is backed ahead stops at PREFAULT_BYTES (here 64 slots, not the 144 of 100 rows). The
    # pool asks for huge pages: the 2 MiB page holding slot 63 (32 KiB a slot and layer) may back
    # up to 63 slots past it, so the slots checked untouched are 128-143, beyond its reach.
    monkeypatch.setattr(pool_module, "PREFAULT_BYTES", 64 * pool.bytes_per_slot)
    capped = ChunkPool(3, 2, 64, 64, torch.float32, budget_bytes=256 << 20, slab_slots=16, ready_rows=100)
    capped.prefault.join(timeout=60)
    for layer in (0, 2):
        assert resident(capped.k[layer, :64]) == 1.0 and resident(capped.v[layer, :64]) == 1.0
        assert resident(capped.k[layer, 128:144]) < 0.5 and resident(capped.v[layer, 128:144]) < 0.5
    lease = ChunkPool(3, 2, 64, 64, torch.float32, budget_bytes=128 << 20, tensors=(pool.k, pool.v))
    assert lease.prefault is None
    monkeypatch.setenv("CHUNKGEN_PREFAULT", "0")
    assert ChunkPool(3, 2, 64, 64, torch.float32, budget_bytes=1 << 20).prefault is None


def test_an_llm_on_the_cpu_reserves_its_kv_memory_before_the_weights(tiny_model):
    """The reservation made from the model's config (before the weights load) is the one its
    engines use: its pages were being backed while the weights loaded."""
    from chunkgen.llm import LLM

    llm = LLM(model=str(tiny_model), dtype="fp32", device="cpu", chunk_size=16, kv_memory="8MiB", max_batch=4)
    base = llm._kv.base
    assert base.prefault is not None
    assert llm._kv.shape == (llm.model.num_layers, llm.model.kv_heads, llm.model.head_dim)
    out = llm.generate(["hello there"])
    assert out[0].token_ids
    assert llm.engine.pool.k.data_ptr() == base.k.data_ptr()


_FAULTS_OF_A_FRESH_TENSOR = """
import resource, sys, torch
from chunkgen.cache.pages import keep_freed_pages
if sys.argv[1] == "keep":
    assert keep_freed_pages()
def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
per_step = []
for _ in range(12):  # a step's large tensor, again and again
    before = faults()
    t = torch.empty(64 << 20, dtype=torch.uint8)
    t.fill_(1)
    del t
    per_step.append(faults() - before)
print(sum(per_step[-4:]))
"""


@pytest.mark.parametrize("keep", [True, False])
def test_a_freed_large_tensor_leaves_its_pages_to_the_next_one(keep):
    """With keep_freed_pages, a 64 MiB tensor allocated, written and freed step after step stops
    costing page faults once malloc has settled (within a few steps: each aligned allocation asks
    for a little more than the last one freed, until freed neighbours have merged); without it,
    malloc maps fresh pages every time and every 4 KiB faults."""
    import subprocess

    from tests.helpers import ROOT

    out = subprocess.run(
        [sys.executable, "-c", _FAULTS_OF_A_FRESH_TENSOR, "keep" if keep else "default"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    faults, pages = int(out.stdout.split()[-1]), (64 << 20) // PAGE  # faults of the last 4 steps
    if keep:
        assert faults < pages // 10, faults
    else:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
        if thp.exists() and "[always]" in thp.read_text():
            pytest.skip("every large mapping on huge pages here: a fresh one faults once per 2 MiB")
        assert faults > 2 * pages, faults  # what the setting is for


_A_WAVES_FREED_PAGES = """
import sys, torch
from chunkgen.cache.pages import keep_freed_pages, release_freed_pages
def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096
assert keep_freed_pages()
wave, held = [], []
for _ in range(24):  # a wave's activations at its peak, with tensors that outlive it between them
    wave.append(torch.ones(6 << 20, dtype=torch.uint8))
    held.append(torch.ones(64 << 10, dtype=torch.uint8))
del wave
before = rss()
print(release_freed_pages(), before - rss())
"""


def test_a_large_waves_freed_pages_go_back_to_the_os():
    """What malloc kept of a wave's freed activations (keep_freed_pages: the heap's free chunks,
    between live ones too) is handed back."""
    import subprocess

    from tests.helpers import ROOT

    out = subprocess.run(
        [sys.executable, "-c", _A_WAVES_FREED_PAGES], capture_output=True, text=True, cwd=ROOT, check=True
    )
    ran, released = out.stdout.split()
    assert ran == "True"
    assert int(released) > 120 << 20, released  # of the 24 x 6 MiB freed


@pytest.mark.parametrize(
    "kv_heads, head_dim, dtype", [(3, 64, torch.bfloat16), (8, 128, torch.float32), (2, 16, torch.float32)]
)
def test_every_layer_of_a_cpu_pool_starts_on_a_huge_page(kv_heads, head_dim, dtype):
    """The slots a wave writes touch at most one huge page past their end in each layer: each
    layer's K and V start on a 2 MiB boundary and stay contiguous, the pool's slots as the budget
    gives them (the padding to whole huge pages is never handed out)."""
    pool = ChunkPool(3, kv_heads, head_dim, 64, dtype, budget_bytes=96 << 20)
    for t in (pool.k, pool.v):
        assert t.shape[1] == pool.max_slots + 1
        for layer in range(3):
            assert t[layer].is_contiguous() and t[layer].data_ptr() % (2 << 20) == 0
        if getattr(t, "_chunkgen_huge", False):  # advised: the last layer's slots too, past the padding
            assert _advised_huge(t[-1].data_ptr() + (2 << 20), t[-1, -1].data_ptr() // (2 << 20) * (2 << 20))
    slots = [pool.allocate() for _ in range(pool.max_slots)]
    assert sorted(slots) == list(range(pool.max_slots))


def _advised_huge(start: int, end: int) -> bool:
    """Whether every mapping over [start, end) carries MADV_HUGEPAGE's flag (smaps' `hg`)."""
    covered, lo, hi = 0, 0, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
        elif head == "VmFlags:" and lo < end and hi > start:
            if "hg" not in line.split()[1:]:
                return False
            covered += min(hi, end) - max(lo, start)
    return covered == end - start


def test_huge_page_slots_fill_whole_huge_pages():
    for slots, slot_bytes in ((1, 512 << 10), (129, 512 << 10), (1000, 24 << 10), (7, 3 << 20), (5, 2 << 20)):
        padded = huge_page_slots(slots, slot_bytes)
        assert padded >= slots and padded * slot_bytes % (2 << 20) == 0
        assert padded == next(n for n in range(slots, padded + 1) if n * slot_bytes % (2 << 20) == 0)  # the fewest
    assert huge_page_slots(129, 512 << 10) == 132 and huge_page_slots(1000, 24 << 10) == 1024
