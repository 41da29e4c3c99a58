"""The CUDA kernels' own source, run on the CPU under a thread-level CUDA emulator
(tests/kernels/cuda_emu) against the same naive reference as the CPU kernel, on randomized trees: every
machine checks the CUDA path's indexing, masking, row splits, warp reductions and barriers, GPU or
not. Timing and real tensor cores still need a GPU (tests/kernels/test_cuda.py)."""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkgen.cache import ChunkPool, KernelContext, PrefixTree
from chunkgen.kernels.decode import SEQUENCE_SPLITS
from chunkgen.kernels.reference import reference_decode_attention
from tests.helpers import TOLERANCE, WINDOW_KINDS, build_tree, draw_window, nan_outside_windows

HERE = Path(__file__).parent / "cuda_emu"
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc/attention.h KVType

# Every emulated CUDA thread is an OS thread and a block's threads meet at barriers, so a launch
# waits for its slowest thread to be scheduled: beside another busy process on 2 cores a test ran
# 5-10x slower, where an engine test ran 1.3-1.5x slower (benchmarks/results/2026-12-04-test-workers-zen4.md).
pytestmark = pytest.mark.serial


# `make cuda-racecheck` and `make cuda-memcheck` run this file with the emulator under ThreadSanitizer
# or AddressSanitizer (CHUNKGEN_EMU_SANITIZE=thread or address, the runtime preloaded into Python):
# two threads of a launch, or two blocks run together, touching the same bytes without a barrier
# between them, or an access outside a buffer, fail the run whether or not this run's results came
# out right. Fewer hypothesis examples there: such defects are in the code's structure.
SANITIZED = os.environ.get("CHUNKGEN_EMU_SANITIZE", "")


def examples(n: int) -> int:
    return max(4, n // 4) if SANITIZED else n


def build_emulated(sources: list[Path], lib: Path, sanitize: str) -> Path:
    """Compiles emulator harnesses (CUDA source included) into the shared library `lib`; sanitized,
    it loads only into a process that preloaded the sanitizer's runtime."""
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed to build the extension, and so for this test too"
    flags = {
        "thread": ["-fsanitize=thread", "-g", "-DCHUNKGEN_EMU_BLOCKS_AT_ONCE=4"],
        "address": ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"],
        "": [],
    }[sanitize]
    subprocess.run(
        [cxx, "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-w", "-DCHUNKGEN_CUDA_EMULATION", *flags]
        + [str(source) for source in sources]
        + ["-o", str(lib)],
        check=True,
    )
    return lib


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    lib = tmp_path_factory.mktemp("cuda_emu") / "tpp_cuda_emu.so"
    return ctypes.CDLL(str(build_emulated([HERE / "harness.cpp", HERE / "harness_elementwise.cpp"], lib, SANITIZED)))


@pytest.fixture(scope="session")
def emulated(emulator):
    fn = emulator.emu_decode_attention
    fn.restype = ctypes.c_int
    return fn


def run_emulated(
    fn,
    q,
    k,
    v,
    ctx: KernelContext,
    scale: float,
    chunk_first: bool,
    sms: int,
    window: int = 0,
    softcap: float = 0.0,
    split_cap: int = SEQUENCE_SPLITS,
    invariant: bool = False,
) -> torch.Tensor:
    """split_cap: sequence-first blocks a row the workspace has room for (the engine's
    workspace_for gives SEQUENCE_SPLITS; batch-invariant, at least the context's private width)."""
    out = torch.full_like(q, float("nan"))

    def ptr(t):
        return ctypes.c_void_p(t.data_ptr())

    err = ctypes.create_string_buffer(4096)
    rc = fn(
        ptr(q),
        ptr(out),
        KV_TYPES[q.dtype],
        ptr(k),
        ptr(v),
        KV_TYPES[k.dtype],
        q.shape[0],
        q.shape[1],
        k.shape[1],
        q.shape[2],
        k.shape[3],
        ctypes.c_float(scale),
        ctx.shared_slot.numel(),
        ptr(ctx.shared_slot),
        ptr(ctx.shared_len),
        ptr(ctx.shared_begin),
        ptr(ctx.shared_end),
        ptr(ctx.seq_shared_ptr),
        ptr(ctx.seq_shared_idx),
        ptr(ctx.priv_slot),
        ctx.priv_slot.shape[1],
        ptr(ctx.priv_count),
        ptr(ctx.priv_last_len),
        int(chunk_first),
        window,
        ctypes.c_float(softcap),
        sms,
        split_cap,
        int(invariant),
        err,
        len(err),
    )
    assert rc == 0, err.value.decode()
    return out


@settings(max_examples=examples(24), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(1, 10),
    shared_len=st.integers(0, 300),
    chunk=st.sampled_from([32, 64, 128]),
    heads=st.sampled_from([(8, 8), (8, 2), (9, 3), (4, 1)]),
    head_dim=st.sampled_from([64, 128, 80]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    decode_steps=st.integers(0, 3),
    chunk_first=st.booleans(),
    sms=st.sampled_from([1, 8, 132]),
    q_in_pool_dtype=st.booleans(),
)
def test_emulated_cuda_kernel_matches_reference(
    emulated, seed, n_seqs, shared_len, chunk, heads, head_dim, dtype, decode_steps, chunk_first, sms, q_in_pool_dtype
):
    """q and out fp32, or in the pool's dtype (the model's), as the op takes them."""
    q_heads, kv_heads = heads
    pool, tree = build_tree(
        seed, n_seqs, shared_len, chunk, kv_heads, head_dim, dtype, max_private=150, decode_steps=decode_steps
    )
    ctx = KernelContext(tree, chunk_first=chunk_first)
    q = torch.randn(ctx.batch_size, q_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(dtype) if q_in_pool_dtype else q
    scale = head_dim**-0.5
    out = run_emulated(emulated, q, pool.k[0], pool.v[0], ctx, scale, chunk_first, sms)
    assert out.dtype == q.dtype
    ref = reference_decode_attention(q, pool, tree, 0, ctx.order, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@settings(max_examples=examples(24), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(1, 10),
    shared_len=st.integers(0, 300),
    chunk=st.sampled_from([32, 64]),
    heads=st.sampled_from([(8, 2), (9, 3), (4, 1)]),
    head_dim=st.sampled_from([64, 80]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    window_kind=st.sampled_from(WINDOW_KINDS),
    softcap=st.sampled_from([0.0, 3.0, 30.0]),
    decode_steps=st.integers(0, 2),
    chunk_first=st.booleans(),
    sms=st.sampled_from([1, 8, 132]),
)
def test_emulated_cuda_kernel_windows_and_softcap(
    emulated,
    seed,
    n_seqs,
    shared_len,
    chunk,
    heads,
    head_dim,
    dtype,
    window_kind,
    softcap,
    decode_steps,
    chunk_first,
    sms,
):
    """Sliding windows below, at and across a chunk, on shared and private chunks, with and
    without soft-capping; chunks no window reaches are NaN, partials nobody writes are NaN."""
    import random

    rnd = random.Random(seed)
    window = draw_window(rnd, window_kind, chunk)
    q_heads, kv_heads = heads
    pool, tree = build_tree(
        seed, n_seqs, shared_len, chunk, kv_heads, head_dim, dtype, max_private=150, decode_steps=decode_steps
    )
    ctx = KernelContext(tree, chunk_first=chunk_first)
    q = torch.randn(ctx.batch_size, q_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)) * 3
    scale = head_dim**-0.5
    ref = reference_decode_attention(q, pool, tree, 0, ctx.order, scale, window=window, softcap=softcap)
    if window:
        nan_outside_windows(pool, tree, ctx.order, window)
    out = run_emulated(emulated, q, pool.k[0], pool.v[0], ctx, scale, chunk_first, sms, window, softcap)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(2, 8),
    shared_len=st.integers(0, 200),
    chunk=st.sampled_from([32, 64]),
    heads=st.sampled_from([(8, 2), (9, 3), (4, 1), (34, 2)]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    decode_steps=st.integers(0, 3),
    masked=st.sampled_from([None, "window", "softcap"]),
    sms=st.sampled_from([1, 2, 8, 132]),
    q_in_pool_dtype=st.booleans(),
)
def test_emulated_cuda_kernel_is_batch_invariant(
    emulated, seed, n_seqs, shared_len, chunk, heads, dtype, decode_steps, masked, sms, q_in_pool_dtype
):
    """Batch-invariant: a row's output bits do not depend on the other rows of the call (how many,
    which, whether they share its chunks), nor on the SM count (segments and splits follow the grid);
    still equal to the naive attention within tolerance. Removing rows turns shared chunks into
    private ones, so both ways of reaching a chunk are held against each other. GQA groups of 17
    (34 / 2) take two row tiles a private chunk."""
    import random

    rnd = random.Random(seed)
    q_heads, kv_heads = heads
    d = 64
    window = rnd.choice([chunk // 2, chunk + 5, 3 * chunk]) if masked == "window" else 0
    softcap = 5.0 if masked == "softcap" else 0.0
    pool, tree = build_tree(
        seed, n_seqs, shared_len, chunk, kv_heads, d, dtype, max_private=100, decode_steps=decode_steps
    )
    gen = torch.Generator().manual_seed(seed + 1)
    queries = {s: torch.randn(q_heads, d, generator=gen) * 2 for s in range(n_seqs)}
    queries = {s: x.to(dtype) if q_in_pool_dtype else x for s, x in queries.items()}

    def rows(sm_count: int) -> dict:
        ctx = KernelContext(tree)
        q = torch.stack([queries[s] for s in ctx.order])
        cap = max(SEQUENCE_SPLITS, ctx.priv_slot.shape[1])
        out = run_emulated(emulated, q, pool.k[0], pool.v[0], ctx, d**-0.5, True, sm_count, window, softcap, cap, True)
        return {s: out[i] for i, s in enumerate(ctx.order)}

    full = rows(sms)
    ctx = KernelContext(tree)
    q = torch.stack([queries[s] for s in ctx.order])
    ref = reference_decode_attention(q, pool, tree, 0, ctx.order, d**-0.5, window=window, softcap=softcap)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(torch.stack([full[s] for s in ctx.order]).double(), ref, atol=tol, rtol=tol)
    for s, o in rows(rnd.choice([1, 3, 64, 132])).items():
        assert torch.equal(o, full[s]), s
    for s in rnd.sample(range(n_seqs), rnd.randrange(1, n_seqs)):
        tree.remove(s)
    for s, o in rows(sms).items():
        assert torch.equal(o, full[s]), s


def test_emulated_cuda_kernel_refuses_invariance_without_room(emulated):
    """Batch-invariant with a workspace that has no room for the private partials: a clear error."""
    pool, tree = _tree_of([list(range(300)), list(range(10))], 64, 2, 64, torch.bfloat16)
    ctx = KernelContext(tree)
    q = torch.randn(ctx.batch_size, 8, 64)
    with pytest.raises(AssertionError, match="batch-invariant decode attention needs room for"):
        run_emulated(emulated, q, pool.k[0], pool.v[0], ctx, 1 / 8, True, 8, split_cap=0, invariant=True)


def _tree_of(prompts: list[list[int]], chunk: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    pool = ChunkPool(1, kv_heads, head_dim, chunk, dtype, budget_bytes=1 << 27)
    tree = PrefixTree(pool)
    for s, toks in enumerate(prompts):
        tree.insert(s, toks)
        tree.mark_ready(s)
    gen = torch.Generator().manual_seed(0)
    n = pool.capacity
    pool.k[0, :n] = torch.randn(pool.k[0, :n].shape, generator=gen).to(dtype)
    pool.v[0, :n] = torch.randn(pool.v[0, :n].shape, generator=gen).to(dtype)
    return pool, tree


@pytest.mark.parametrize(
    ("case", "switch", "split_cap"),
    [
        ("one_long_sequence", None, SEQUENCE_SPLITS),
        ("identical_prompts", None, SEQUENCE_SPLITS),
        ("large_shared_memory", None, SEQUENCE_SPLITS),
        ("run_in_segments", None, SEQUENCE_SPLITS),
        ("one_stage", None, SEQUENCE_SPLITS),
        ("two_long_sequences", None, SEQUENCE_SPLITS),
        # no room for split sums in the workspace: one sequence-first block a row and head
        ("one_long_sequence", None, 0),
        # the paths bench kernel times beside the default: a partial every chunk, the
        # sequence-first loops reading global memory, one sequence-first block a row and head
        ("run_in_segments", "CHUNKGEN_CUDA_SEGMENTS", SEQUENCE_SPLITS),
        ("one_long_sequence", "CHUNKGEN_CUDA_STAGE", SEQUENCE_SPLITS),
        ("two_long_sequences", "CHUNKGEN_CUDA_SPLITS", SEQUENCE_SPLITS),
    ],
)
def test_emulated_cuda_kernel_edge_trees(emulated, case, switch, split_cap, monkeypatch):
    if switch:
        monkeypatch.setenv(switch, "off")
    sms = 8
    if case == "one_long_sequence":  # 41 private chunks shared out over the warps of 6 blocks
        heads, d, chunk, dtype = (9, 3), 64, 64, torch.float16
        prompts = [list(range(64 * 40 + 17))]
    elif case == "two_long_sequences":  # a shared run, then long private parts: 2 x 2 (row, head)
        # blocks under 64 SMs want 32 splits and take 8, more warps than one row has items
        heads, d, chunk, dtype, sms = (8, 2), 64, 32, torch.bfloat16, 64
        prompts = [list(range(70)) + [1000 + s] * (32 * 9 + 5 * s) for s in range(2)]
    elif case == "run_in_segments":  # 13 chunks of one run (the last partly filled) under 2 SMs:
        # blocks fold segments of several chunks, row groups of 4 tiles, a last group of 2
        heads, d, chunk, dtype, sms = (9, 3), 64, 64, torch.bfloat16, 2
        prompts = [list(range(64 * 12 + 40)) + [1000 + s] for s in range(30)]
    elif case == "identical_prompts":  # everything shared, a partly filled tail chunk included
        heads, d, chunk, dtype = (8, 2), 128, 64, torch.bfloat16
        prompts = [list(range(300))] * 16
    elif case == "one_stage":  # d 256 x chunk 128: two chunks' K/V and the row tiles do not fit in
        # 227 KiB, so one stage (a segment's next chunk loads after this one), and the
        # sequence-first phase reads global memory (four staged chunks do not fit either)
        heads, d, chunk, dtype, sms = (8, 2), 256, 128, torch.float16, 1
        prompts = [list(range(400)) + [1000 + s] * (s + 1) for s in range(6)]
    else:  # d 128 x chunk 128: the tensor-core kernel needs the opt-in beyond 48 KiB
        heads, d, chunk, dtype = (32, 4), 128, 128, torch.float16
        prompts = [list(range(400)) + [1000 + s] * (s + 1) for s in range(6)]
    pool, tree = _tree_of(prompts, chunk, heads[1], d, dtype)
    for chunk_first in (True, False):
        ctx = KernelContext(tree, chunk_first=chunk_first)
        q = torch.randn(ctx.batch_size, heads[0], d, generator=torch.Generator().manual_seed(1))
        out = run_emulated(emulated, q, pool.k[0], pool.v[0], ctx, d**-0.5, chunk_first, sms=sms, split_cap=split_cap)
        ref = reference_decode_attention(q, pool, tree, 0, ctx.order, d**-0.5)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_emulated_cuda_kernel_refuses_what_does_not_fit(emulated):
    """A GQA group too large for one block's shared memory is a clear error, not a bad launch."""
    pool, tree = _tree_of([list(range(100))] * 2, 256, 1, 256, torch.float16)
    ctx = KernelContext(tree)
    q = torch.randn(ctx.batch_size, 64, 256)
    with pytest.raises(AssertionError, match="needs .* bytes of shared memory; this GPU allows"):
        run_emulated(emulated, q, pool.k[0], pool.v[0], ctx, 1 / 16, True, sms=8)


@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 9),
    heads=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([16, 64]),
    chunk=st.sampled_from([16, 64]),
    pool_dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    src_dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    fused_qkv=st.booleans(),
)
def test_emulated_kv_write_matches_indexing(
    emulator, seed, rows, heads, head_dim, chunk, pool_dtype, src_dtype, fused_qkv
):
    """The GPU's one-launch K/V write: each row's k, v (views of one qkv product, or contiguous; any
    of the three dtypes) at its (slot, offset), converted to the pool's dtype, bit for bit what
    torch's indexing stores; nothing else in the pool changes."""
    gen = torch.Generator().manual_seed(seed)
    slots = 2 * rows + 1
    k_layer = torch.randn(slots, heads, head_dim, chunk, generator=gen).to(pool_dtype)
    v_layer = torch.randn(slots, heads, chunk, head_dim, generator=gen).to(pool_dtype)
    if fused_qkv:  # k and v as strided views of one [rows, (2 + heads) * ... ] product
        qkv = torch.randn(rows, 2 + 2 * heads, head_dim, generator=gen).to(src_dtype)
        k, v = qkv[:, 2 : 2 + heads], qkv[:, 2 + heads :]
    else:
        k, v = (torch.randn(rows, heads, head_dim, generator=gen).to(src_dtype) for _ in range(2))
    slot = torch.randperm(slots, generator=gen)[:rows].to(torch.int32)  # distinct rows: no write races
    offset = torch.randint(0, chunk, (rows,), generator=gen, dtype=torch.int32)
    want_k, want_v = k_layer.clone(), v_layer.clone()
    want_k[slot.long(), :, :, offset.long()] = k.to(pool_dtype)
    want_v[slot.long(), :, offset.long()] = v.to(pool_dtype)

    def ptr(t):
        return ctypes.c_void_p(t.data_ptr())

    def strides(t):
        return (ctypes.c_int64 * 3)(*t.stride())

    err = ctypes.create_string_buffer(4096)
    rc = emulator.emu_write_kv(
        ptr(k), ptr(v), KV_TYPES[src_dtype], strides(k), strides(v), ptr(k_layer), ptr(v_layer),
        KV_TYPES[pool_dtype], ptr(slot), ptr(offset), rows, heads, head_dim, chunk, err, len(err),
    )  # fmt: skip
    assert rc == 0, err.value.decode()
    assert torch.equal(k_layer.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_layer.view(torch.uint8), want_v.view(torch.uint8))


def run_linear(emulator, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, sms: int = 132) -> torch.Tensor:
    """csrc/cuda/invariant_linear.cu under the emulator: x [m, k] (any row stride), w [n, k], on a
    GPU of `sms` SMs (a grid below two waves of them takes a deeper copy ring)."""
    fn = emulator.emu_invariant_linear
    fn.restype = ctypes.c_int
    m, n = x.shape[0], w.shape[0]
    y = torch.full((m, n), float("nan"), dtype=x.dtype)
    err = ctypes.create_string_buffer(4096)
    rc = fn(
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_int64(x.stride(0)),
        ctypes.c_void_p(w.data_ptr()),
        ctypes.c_void_p(bias.data_ptr() if bias is not None else 0),
        ctypes.c_void_p(y.data_ptr()),
        ctypes.c_int64(y.stride(0)),
        m,
        n,
        x.shape[1],
        KV_TYPES[x.dtype],
        sms,
        err,
        len(err),
    )
    assert rc == 0, err.value.decode()
    return y


@settings(max_examples=examples(16), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    m=st.integers(1, 140),
    n=st.integers(1, 150),
    k=st.integers(1, 330),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    bias=st.booleans(),
    strided=st.booleans(),
)
def test_emulated_invariant_linear_is_the_same_for_a_row_in_any_batch(emulator, seed, m, n, k, dtype, bias, strided):
    """The GPU's batch-invariant linear layer: x W^T (+ bias) within the dtype's rounding of an fp64
    product, and a row's output bits the same alone, among other rows, at another place in the
    batch, and whatever grid and copy ring the launch chooses (on 132 SMs these sizes take blocks 16
    columns wide and a ring of up to eight stages; on 1 SM, 64 wide and two stages, or a deep ring for
    a one-block grid). Sizes off the tiles' multiples (edges element by element),
    x as a strided slice (rows not 16-byte aligned), k not a multiple of the 32-wide steps and up to
    11 of them (more than the deepest ring)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(m, k + (3 if strided else 0), generator=gen).to(dtype)
    x = wide[:, :k]
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = run_linear(emulator, x, w, b)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.double(), ref, atol=tol * (k**0.5), rtol=tol)
    row = seed % m
    assert torch.equal(run_linear(emulator, x[row : row + 1].contiguous(), w, b)[0], y[row])
    perm = torch.randperm(m, generator=gen)
    shuffled = run_linear(emulator, x[perm].contiguous(), w, b)
    assert torch.equal(shuffled, y[perm])
    assert torch.equal(run_linear(emulator, x, w, b, sms=1), y)  # wide blocks


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def _check(rc: int, err) -> None:
    assert rc == 0, err.value.decode()


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 5),
    hidden=st.sampled_from([64, 576, 640]),
    heads=st.sampled_from([(9, 3), (8, 2), (4, 4)]),
    d=st.sampled_from([64, 128]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    q_dtype=st.sampled_from([None, torch.float32]),
    pos64=st.booleans(),
)
def test_emulated_elementwise_ops_equal_the_cpu_ones(emulator, seed, rows, hidden, heads, d, dtype, q_dtype, pos64):
    """The decode step's CUDA elementwise ops (csrc/cuda/elementwise.cu) against the same ops on the CPU,
    themselves bitwise the torch compositions (tests/kernels/test_elementwise.py): the residual add and
    rotary bit for bit; the RMSNorms within one rounding, since the GPU sums squares as a block (or
    warp) reduction, and SiLU and GELU too, since expf and the CPU's exp may differ in the last bit.
    Every output starts as NaN. q into its own buffer in qkv's dtype or fp32; positions int32 or
    int64; Llama's and Gemma's (1 + weight) norms; rows of 64 to 640 values over 256 threads."""
    from chunkgen.kernels.elementwise import KVWrite, add_rms_norm, gelu_tanh_mul, rotary, silu_mul

    g = torch.Generator().manual_seed(seed)
    code = KV_TYPES[dtype]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    err = ctypes.create_string_buffer(4096)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (torch.randn(hidden, generator=g) * 0.2).to(dtype)
    for offset in (False, True):
        for with_delta in (True, False):
            d_in = delta if with_delta else None
            res_cpu, out_cpu = x.clone(), torch.empty_like(x)
            add_rms_norm(res_cpu, d_in, w, 1e-6, out_cpu, offset)
            res, out = x.clone(), torch.full_like(x, float("nan"))
            _check(
                emulator.emu_add_rms_norm(
                    _ptr(res), _ptr(d_in), _ptr(w), _ptr(out), ctypes.c_int64(rows), ctypes.c_int64(hidden),
                    ctypes.c_int64(hidden), ctypes.c_int64(hidden), ctypes.c_int64(hidden), ctypes.c_float(1e-6),
                    int(offset), code, err, len(err),
                ),
                err,
            )  # fmt: skip
            assert torch.equal(res, res_cpu)
            torch.testing.assert_close(out, out_cpu, **tol)

    hq, hk = heads
    table = 50
    qkv = (torch.randn(rows, (hq + 2 * hk) * d, generator=g) * 3).to(dtype)
    angles = torch.rand(table, 1, d, generator=g) * 40
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, table, (rows,), generator=g, dtype=torch.int64 if pos64 else torch.int32)
    norms = (torch.randn(d, generator=g) * 0.3 + 1).to(dtype), (torch.randn(d, generator=g) * 0.3).to(dtype)
    q_type = q_dtype or dtype
    # With the step's K/V write fused in: the first write_rows rows (all, or all but the last, as a
    # mixed step's decode rows before its wave's) into a NaN pool of the model's dtype or fp32.
    chunk, slots = 16, 2 * rows + 1
    pool_type = dtype if seed % 2 else torch.float32
    write_rows = rows - (seed // 2) % 2 if rows > 1 else rows
    slot = torch.randperm(slots, generator=g)[:write_rows].to(torch.int32)
    offset = torch.randint(0, chunk, (write_rows,), generator=g, dtype=torch.int32)
    layer = 1
    for (q_norm, k_norm, offset_norm), write in itertools.product(
        ((None, None, False), (*norms, False), (*norms, True)), (False, True)
    ):
        k_cache = torch.full((2, slots, hk, d, chunk), float("nan"), dtype=pool_type)
        v_cache = torch.full((2, slots, hk, chunk, d), float("nan"), dtype=pool_type)
        mine_cpu, q_cpu = qkv.clone(), torch.empty(rows, hq, d, dtype=q_type)
        k_cpu, v_cpu = k_cache.clone(), v_cache.clone()
        kv = KVWrite(k_cpu, v_cpu, layer, slot, offset) if write else None
        rotary(mine_cpu, positions, cos, sin, hq, hk, q_cpu, q_norm, k_norm, 1e-6, offset_norm, kv)
        mine, q = qkv.clone(), torch.full((rows, hq, d), float("nan"), dtype=q_type)
        _check(
            emulator.emu_rotary(
                _ptr(mine), ctypes.c_int64(qkv.stride(0)), _ptr(positions), int(pos64), _ptr(cos), _ptr(sin),
                ctypes.c_int64(cos.stride(0)), ctypes.c_int64(rows), ctypes.c_int64(hq), ctypes.c_int64(hk),
                ctypes.c_int64(d), _ptr(q), KV_TYPES[q_type], _ptr(q_norm), _ptr(k_norm), ctypes.c_float(1e-6),
                int(offset_norm), code, _ptr(k_cache[layer]), _ptr(v_cache[layer]), KV_TYPES[pool_type],
                _ptr(slot), _ptr(offset), write_rows if write else 0, chunk, err, len(err),
            ),
            err,
        )  # fmt: skip
        if q_norm is None:  # the same roundings, in the same order: the same bits
            assert torch.equal(mine, mine_cpu) and torch.equal(q, q_cpu)
            torch.testing.assert_close(k_cache, k_cpu, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(v_cache, v_cpu, rtol=0, atol=0, equal_nan=True)
        else:
            torch.testing.assert_close(mine, mine_cpu, **tol)
            torch.testing.assert_close(q, q_cpu, **tol)
            torch.testing.assert_close(k_cache, k_cpu, equal_nan=True, **tol)
            torch.testing.assert_close(v_cache, v_cpu, equal_nan=True, **tol)
        if write:  # the pool holds exactly the written rows' rotated k (as qkv holds it) and v
            k_rows = mine[:write_rows, hq * d : (hq + hk) * d].view(write_rows, hk, d).to(pool_type)
            v_rows = mine[:write_rows, (hq + hk) * d :].view(write_rows, hk, d).to(pool_type)
            s_, o_ = slot.long(), offset.long()
            assert torch.equal(k_cache[layer, s_, :, :, o_], k_rows) and torch.equal(v_cache[layer, s_, :, o_], v_rows)
            assert int(k_cache.isnan().logical_not().sum()) == write_rows * hk * d
        else:
            assert bool(k_cache.isnan().all() and v_cache.isnan().all())

    gate_up = (torch.randn(rows, 2 * hidden, generator=g) * 4).to(dtype)
    for gelu, op in ((0, silu_mul), (1, gelu_tanh_mul)):
        out_cpu = torch.empty(rows, hidden, dtype=dtype)
        op(gate_up, out_cpu)
        out = torch.full((rows, hidden), float("nan"), dtype=dtype)
        _check(
            emulator.emu_gated(
                gelu, _ptr(gate_up), ctypes.c_int64(2 * hidden), _ptr(out), ctypes.c_int64(hidden),
                ctypes.c_int64(rows), ctypes.c_int64(hidden), code, err, len(err),
            ),
            err,
        )  # fmt: skip
        torch.testing.assert_close(out, out_cpu, **tol)
