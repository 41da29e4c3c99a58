"""How chunkgen's memory is backed by the OS: the pool's huge pages, its pages populated ahead
of the first writes and given back when its free slots are not needed (requests to Linux:
madvise), and the pages of freed tensors kept for the next ones, until a large prefill wave's are
no longer needed (glibc's malloc). Elsewhere, or when refused, nothing changes."""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading

import torch

_PAGE = 4096
_HUGE_PAGE = 2 << 20
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_KEEP_BYTES = 1 << 30
_kept = False


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise


def _linux_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and sys.platform.startswith("linux")


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back a CPU tensor's untouched memory with 2 MiB pages (transparent huge
    pages, where the system allows them on request). The decode kernel reads each row's own
    chunks from slots anywhere in the pool: with 4 KiB pages every chunk of every layer costs
    TLB misses of its own. Only the whole 2 MiB pages inside the tensor's span are advised.
    CHUNKGEN_HUGE_PAGES=0 turns it off. Returns whether the advice was taken."""
    if not _linux_cpu(t) or os.environ.get("CHUNKGEN_HUGE_PAGES") == "0":
        return False
    start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (t.data_ptr() + _span_bytes(t)) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return False
    taken = _madvise()(start, end - start, _MADV_HUGEPAGE) == 0
    t._chunkgen_huge = taken  # how its pages are given back (page_size)
    return taken


def huge_page_slots(slots: int, slot_bytes: int) -> int:
    """The fewest slots, `slots` or more, of `slot_bytes` each that fill whole 2 MiB pages: a layer
    of the pool that many slots long ends where a huge page does, so every layer's slots start on
    one (huge_page_aligned) and the slots in use touch at most one huge page past their end per
    layer, not two."""
    step = _HUGE_PAGE // math.gcd(_HUGE_PAGE, slot_bytes)
    return -(-slots // step) * step


def huge_page_aligned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of `shape` that starts on a 2 MiB boundary (a view into a buffer
    2 MiB longer; the pages it does not use are never touched)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    skip = -buffer.data_ptr() % _HUGE_PAGE
    return buffer[skip : skip + nbytes].view(dtype).view(shape)


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from t's first element to past its last: its numel's for a contiguous tensor, more for
    a strided view (a pool's layers, each padded to whole huge pages)."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else -1
    return (last + 1) * t.element_size()


def page_size(t: torch.Tensor) -> int:
    """The granularity at which the OS backs t's memory, as far as giving pages back goes: 2 MiB
    where t was advised huge pages (a part of one given back splits it, and khugepaged may fill it
    again while neighbours stay resident), else 4 KiB."""
    return _HUGE_PAGE if getattr(t, "_chunkgen_huge", False) else _PAGE


def give_back(address: int, nbytes: int, page: int = _PAGE) -> tuple[int, int]:
    """Hand the OS the whole pages (of size `page`) inside a range of CPU memory whose contents
    nothing needs (MADV_DONTNEED: they read as zeros and are backed afresh when next written).
    Returns the (start, end) addresses given back: an empty range where there is no whole page,
    where not Linux, or where the OS refused."""
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    if end <= start or not sys.platform.startswith("linux") or _madvise()(start, end - start, _MADV_DONTNEED) != 0:
        return start, start
    return start, end


def populate_in_background(views: list[torch.Tensor]) -> threading.Thread | None:
    """Have the OS back the pages under `views` (contiguous CPU tensors) from a background thread,
    before anything writes them. A fresh process pays for every page of the pool it touches first
    (a fault, the page zeroed, on a virtual machine often the host backing it too: about 0.5 s for
    the K/V a 2,048-token prompt and 32 questions write, in bf16 on a 2-core VM); asked
    for while the weights load, which keeps one core busy, it costs the run nothing. The pages'
    contents are not changed (MADV_POPULATE_WRITE), so the thread may run while they are in use.
    CHUNKGEN_PREFAULT=0 turns it off; a kernel without the request (before Linux 5.14) ignores it.
    Returns the thread, or None when nothing was asked."""
    views = [v for v in views if v.numel() and _linux_cpu(v)]
    if not views or os.environ.get("CHUNKGEN_PREFAULT") == "0":
        return None
    # The thread holds addresses, never the tensors: a daemon thread that drops the last reference
    # to a tensor while the interpreter exits (a run interrupted during the load) is unwound inside
    # torch's C++ and aborts the process. Storage freed before the thread gets to it is harmless:
    # the request fails on an unmapped range, and on a range mapped anew it changes no contents.
    ranges = []
    for v in views:
        start = v.data_ptr() // _PAGE * _PAGE
        ranges.append((start, -(-(v.data_ptr() + v.numel() * v.element_size()) // _PAGE) * _PAGE - start))
    del views

    def run() -> None:
        madvise = _madvise()
        for start, length in ranges:
            if madvise(start, length, _MADV_POPULATE_WRITE) != 0:
                return  # not supported here (EINVAL), or memory the OS will not give: leave it to the writes

    thread = threading.Thread(target=run, name="chunkgen-prefault", daemon=True)
    thread.start()
    return thread


def keep_freed_pages() -> bool:
    """Have malloc keep the pages of freed tensors of up to 1 GiB for the next ones, instead of
    handing them back to the OS. A decode step and a prefill wave allocate the same large
    transient tensors every time (the default model's logits at 256 rows: 50 MB; a 5,120-token
    wave's MLP activations: 63 MB); above its own ceiling (32 MiB) glibc maps each one afresh and
    unmaps it when freed, so every step paid a page fault and a zeroed page for each 4 KiB it
    wrote: 12 of the 84 ms of that 256-row logits product on a 2-core Zen 4 VM. The cost: freed
    memory stays with the process, a few times the step's largest tensor (malloc settles after a
    few steps; about 350 MB in a loop of that logits product alone), never more than 1 GiB free
    at the heap's top. Process-wide, set once (the first CPU model load).
    CHUNKGEN_KEEP_FREED_PAGES=0 turns it off. Returns whether malloc took it (glibc only)."""
    global _kept
    if _kept:
        return True
    if not sys.platform.startswith("linux") or os.environ.get("CHUNKGEN_KEEP_FREED_PAGES") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    _kept = mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES) == 1
    return _kept


def release_freed_pages() -> bool:
    """Hand the OS the whole pages of freed tensors that malloc keeps (keep_freed_pages), wherever
    they lie in its heaps: for when a large prefill wave's (or many mixed steps') activations,
    freed, will not be needed again soon. A 7B model's 2,080-token wave left 0.34 GiB of them, and the K/V the decode steps
    after it wrote went on top (peak 7.64 GiB against 7.34 with them released); the call took
    24 ms. CHUNKGEN_KEEP_FREED_PAGES=0 (malloc's own trimming) makes it a no-op. Returns whether it
    ran (glibc only)."""
    if not _kept:
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
    return True
