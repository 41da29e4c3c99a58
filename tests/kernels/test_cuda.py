"""The CUDA path, on a GPU only: the kernel against the same naive reference as the CPU tests, and
the engine's greedy output against transformers. Skipped where there is no GPU or no CUDA build."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkgen import native_cuda_available
from tests.helpers import TOLERANCE

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and native_cuda_available()),
        reason="needs a CUDA GPU and chunkgen built with CUDA kernels",
    ),
]


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(1, 24),
    shared_len=st.integers(0, 400),
    chunk=st.sampled_from([32, 64, 128]),
    heads=st.sampled_from([(8, 8), (8, 2), (9, 3), (32, 32)]),
    head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    chunk_first=st.booleans(),
)
def test_cuda_kernel_matches_reference(seed, n_seqs, shared_len, chunk, heads, head_dim, dtype, chunk_first):
    from chunkgen.cache import KernelContext
    from chunkgen.kernels import decode_attention
    from chunkgen.kernels.reference import reference_decode_attention
    from tests.helpers import build_tree

    q_heads, kv_heads = heads
    pool, tree = build_tree(seed, n_seqs, shared_len, chunk, kv_heads, head_dim, dtype, decode_steps=2)
    ctx = KernelContext(tree, chunk_first=chunk_first)
    q = torch.randn(ctx.batch_size, q_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    out = decode_attention(q.cuda(), pool.k[0].cuda(), pool.v[0].cuda(), ctx, head_dim**-0.5).cpu()
    ref = reference_decode_attention(q, pool, tree, 0, ctx.order, head_dim**-0.5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_engine_greedy_matches_transformers(default_model_dir, dtype):
    """As the CPU parity test: 16 answers of the default model, as many equal token for token as
    there (EXACT: bf16 moves near ties), each divergence a near tie."""
    from transformers import AutoModelForCausalLM

    from chunkgen.engine import SamplingParams
    from chunkgen.jobs.templates import load_template
    from chunkgen.llm import LLM
    from tests.helpers import EXACT, PROMPTS, QUESTIONS, assert_parity

    llm = LLM(model=str(default_model_dir), dtype=dtype, device="cuda", kv_memory="1GiB")
    t = load_template(PROMPTS / "document_qa.toml")
    prompts = [t.messages({"question": q}) for q in QUESTIONS]
    results = llm.generate(prompts, SamplingParams(max_new_tokens=12))
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch_dtype).cuda()
    exact = 0
    with torch.inference_mode():
        for p, r in zip(prompts, results):
            ids = llm.encode(p)
            ref = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=12, do_sample=False)[
                0, len(ids) :
            ].tolist()
            assert_parity(hf, ids, r.token_ids, ref)
            exact += r.token_ids == ref
    assert exact >= EXACT[dtype], f"only {exact}/16 answers equal token for token ({dtype})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_write_and_gather_on_the_gpu(dtype):
    """Prefill's K/V write (the K/V write kernel) and gather on a GPU pool, and their index errors."""
    from tests.cache.test_cache import check_pool_write_and_gather

    check_pool_write_and_gather(dtype, "cuda")


@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_rotary_stores_the_steps_kv_on_the_gpu(dtype, pool_dtype, norms):
    """The decode step's K/V write fused into the rotary kernel: the bits of rotary, then the pool's
    write kernel."""
    from tests.kernels.test_elementwise import check_rotary_kv_write

    check_rotary_kv_write(dtype, pool_dtype, norms, "cuda")


def test_cuda_graph_replay_equals_eager_with_joins_leaves_and_preemption(tiny_model):
    """CUDA graphs (one per bucket, replayed every step) against eager steps on the same workload
    as the CPU replay test: a KV budget that forces preemption, sequences joining and leaving.
    Batch-invariant numerics: eager steps run their rows as they are and captured ones a padded
    bucket, which without them may take other kernel plans (cuBLAS, the sequence-first splits)."""
    from chunkgen.engine import Request, SamplingParams
    from chunkgen.llm import LLM
    from tests.helpers import CHUNK, run, template_prompts

    llm = LLM(
        model=str(tiny_model),
        dtype="fp32",
        device="cuda",
        chunk_size=CHUNK,
        kv_memory="64MiB",
        max_batch=8,
        batch_invariant="on",
    )
    prompts = [llm.encode(p) for p in template_prompts("tool_dispatcher", 12)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    chunks = -(-max(map(len, prompts)) // CHUNK) + 4 * (-(-(20 + CHUNK) // CHUNK) + 1)
    tight = chunks * llm.new_engine().pool.bytes_per_slot
    requests = lambda: [Request(i, p, params) for i, p in enumerate(prompts)]  # noqa: E731
    eager, _ = run(llm.new_engine(kv_memory=tight, enforce_eager=True), requests())
    graphs = llm.new_engine(kv_memory=tight, enforce_eager=False)
    got, rows = run(graphs, requests())
    assert graphs.stats.preemptions > 0
    assert graphs.runner.captures == len(set(rows)) > 0
    assert graphs.runner.ctx.uploads == graphs.stats.decode_steps  # one host->device copy a step
    assert got == eager


def test_a_capture_survives_another_thread_allocating_pinned_memory(tiny_model, monkeypatch):
    """The constraint worker fills the next step's masks, and may allocate a pinned buffer for
    them, while the main thread captures a new bucket's graph: that must not invalidate it."""
    import threading

    from chunkgen.engine import SamplingParams
    from chunkgen.llm import LLM
    from tests.helpers import template_prompts

    llm = LLM(model=str(tiny_model), dtype="fp32", device="cuda", chunk_size=16, kv_memory="64MiB", max_batch=8)
    decode, beside = llm.model.decode, []

    def decode_beside_a_pinned_allocation(*args):
        if torch.cuda.is_current_stream_capturing():
            thread = threading.Thread(target=lambda: beside.append(torch.empty(1 << 20, pin_memory=True)))
            thread.start()
            thread.join()
        return decode(*args)

    monkeypatch.setattr(llm.model, "decode", decode_beside_a_pinned_allocation)
    params = SamplingParams(max_new_tokens=8, regex="[0-9]{1,3}")
    answers = llm.generate(template_prompts("document_qa", 6), params)
    assert len(beside) == llm.engine.runner.captures > 0
    assert all(r.text.isdigit() for r in answers), [r.text for r in answers]


def test_device_auto_picks_the_gpu_and_its_kv_budget_from_free_memory(tiny_model):
    from chunkgen.device import GPU_KV_FRACTION
    from chunkgen.llm import LLM

    llm = LLM(model=str(tiny_model), dtype="fp32", chunk_size=16)  # device and kv_memory: auto
    assert llm.device == f"cuda:{torch.cuda.current_device()}" and "CUDA GPU" in llm.config.why["device"]
    assert llm.model.device.type == "cuda" and llm.engine.pool.k.device.type == "cuda"
    total = torch.cuda.get_device_properties(llm.model.device).total_memory
    assert (
        llm.config.why["kv_memory"].startswith("auto: ")
        and 0.5 * total < llm.config.kv_memory <= GPU_KV_FRACTION * total
    )
    reserved = torch.cuda.memory_allocated()
    engines = [llm.new_engine() for _ in range(3)]  # one reservation: no engine reserves the budget again
    assert torch.cuda.memory_allocated() - reserved < 0.01 * llm.config.kv_memory
    assert len({e.pool.k.data_ptr() for e in engines + [llm.engine]}) == 1
    del llm, engines
    import gc

    gc.collect()
    torch.cuda.empty_cache()  # the other tests' LLMs find the memory free again


def test_cuda_0_named_explicitly_gives_the_cpu_engines_answers(tiny_model):
    """On cuda:0 by name (the guard makes it the current device for every step), greedy fp32
    answers equal the CPU engine's, but for a near tie."""
    from chunkgen.engine import SamplingParams
    from chunkgen.llm import LLM
    from tests.helpers import template_prompts

    options = dict(dtype="fp32", chunk_size=16, kv_memory="64MiB", max_batch=16)
    llm = LLM(model=str(tiny_model), device="cuda:0", **options)
    assert llm.device == "cuda:0" and llm.config.why["device"] == "as asked"
    prompts = template_prompts("document_qa", 8)
    params = SamplingParams(max_new_tokens=12)
    gpu = [r.token_ids for r in llm.generate(prompts, params)]
    cpu = [r.token_ids for r in LLM(model=str(tiny_model), device="cpu", **options).generate(prompts, params)]
    assert sum(a == b for a, b in zip(gpu, cpu)) >= 7


def test_bench_e2e_dummy_weights_on_the_gpu(tmp_path):
    import json

    from typer.testing import CliRunner

    from chunkgen.cli import app

    out = tmp_path / "rows.json"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "e2e",
            "--dummy-weights",
            "smollm2-135m",
            "--n-shared",
            "256",
            "--n-queries",
            "8",
            "--max-new-tokens",
            "8",
            "--json",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert "device cuda:" in res.output
    rows = {r["system"]: r for r in json.loads(out.read_text())}
    assert rows["chunkgen"]["dtype"] == "bf16"  # the config's own dtype: --dtype auto on a GPU
    assert all(r["gen_tokens_per_s"] > 0 for r in rows.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_elementwise_ops_equal_the_cpu_ones(dtype):
    """Every fused elementwise op on the GPU against the same op on the CPU (itself bitwise the torch
    composition): within one rounding, since the GPU's sum of squares is a block reduction."""
    from chunkgen.kernels.elementwise import add_rms_norm, gelu_tanh_mul, rotary, silu_mul

    g = torch.Generator().manual_seed(7)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    rows, hidden, hq, hk, d, table = 9, 640, 8, 2, 128, 300
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    y = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (torch.randn(hidden, generator=g) * 0.2).to(dtype)
    for offset in (False, True):
        outs = []
        for device in ("cpu", "cuda"):
            res, out = x.clone().to(device), torch.empty_like(x, device=device)
            add_rms_norm(res, y.to(device), w.to(device), 1e-6, out, offset)
            outs.append((res.cpu(), out.cpu()))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
        torch.testing.assert_close(outs[1][1], outs[0][1], **tol)
    qkv = (torch.randn(rows, (hq + 2 * hk) * d, generator=g) * 3).to(dtype)
    angles = torch.rand(table, 1, d, generator=g) * 40
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, table, (rows,), generator=g)
    norms = (torch.randn(d, generator=g) * 0.3 + 1).to(dtype), (torch.randn(d, generator=g) * 0.3).to(dtype)
    for q_norm, k_norm, offset in ((None, None, False), (*norms, False), (*norms, True)):
        outs = []
        for device in ("cpu", "cuda"):
            mine, q = qkv.clone().to(device), torch.empty(rows, hq, d, dtype=dtype, device=device)

            def on(t, device=device):
                return None if t is None else t.to(device)

            rotary(
                mine,
                positions.to(device),
                cos.to(device),
                sin.to(device),
                hq,
                hk,
                q,
                on(q_norm),
                on(k_norm),
                1e-6,
                offset,
            )
            outs.append((mine.cpu(), q.cpu()))
        torch.testing.assert_close(outs[1][0], outs[0][0], **tol)
        torch.testing.assert_close(outs[1][1], outs[0][1], **tol)
    gate_up = (torch.randn(rows, 2 * hidden, generator=g) * 4).to(dtype)
    for op in (silu_mul, gelu_tanh_mul):
        outs = []
        for device in ("cpu", "cuda"):
            out = torch.empty(rows, hidden, dtype=dtype, device=device)
            op(gate_up.to(device), out)
            outs.append(out.cpu())
        torch.testing.assert_close(outs[1], outs[0], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["prefix", "causal", "causal_longer_keys", "mask"])
def test_cuda_fused_attention_lse_matches_float64(dtype, kind):
    """The GPU prefill's products through torch's memory-efficient kernel (its LSE padded to 32 rows,
    a 16-aligned bias), against float64 on the same inputs: GQA folded, expanded, masked, causal."""
    from chunkgen.kernels.prefill import fused_attention_lse
    from tests.helpers import dense_lse_reference

    gen = torch.Generator().manual_seed(7)
    hq, hk, t, d = 9, 3, 45, 64
    s = t if kind == "causal" else t + 83
    q, k, v = (torch.randn(2, h, n, d, generator=gen).to(dtype) for h, n in ((hq, t), (hk, s), (hk, s)))
    mask = None
    if kind == "mask":
        limit = torch.randint(0, s, (2, 1, t, 1), generator=gen)
        mask = torch.zeros(2, 1, t, s, dtype=dtype).masked_fill_(torch.arange(s) > limit, float("-inf"))
    causal = kind.startswith("causal")
    o, lse = fused_attention_lse(
        q.cuda(), k.cuda(), v.cuda(), d**-0.5, causal=causal, mask=None if mask is None else mask.cuda()
    )
    want_o, want_lse = dense_lse_reference(q, k, v, d**-0.5, causal, mask)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    assert o.dtype == dtype and lse.shape == (2, hq, t)
    torch.testing.assert_close(o.cpu().double(), want_o, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu().double(), want_lse, atol=tol, rtol=tol)


def _cuda_wave(seed: int, dtype: torch.dtype):
    """A randomized wave (tests.helpers.random_wave: 6 sequences, chunks of 16, 9 query heads on 3
    KV heads of 64) with its new K/V stored, its pool copied to the GPU: (cpu_pool, GPU pool, spans,
    q, k, v on the host)."""
    from chunkgen.cache import ChunkPool
    from tests.helpers import random_wave, store_new_tokens

    cpu_pool, spans, rows = random_wave(seed, 6, 16, 3, 64, dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    q, k, v = (torch.randn(rows, h, 64, generator=gen).to(dtype) for h in (9, 3, 3))
    store_new_tokens(cpu_pool, spans, k, v)
    pool = ChunkPool(1, 3, 64, 16, dtype, budget_bytes=1 << 26, device="cuda",
                     tensors=(cpu_pool.k.cuda(), cpu_pool.v.cuda()))  # fmt: skip
    return cpu_pool, pool, spans, q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_prefill_wave_matches_naive(dtype):
    """A randomized wave (shared prefixes, own chunks, lone sequences) prefilled on the GPU: the
    prefix gathered from a GPU pool, every product fused, parts merged by their LSE."""
    from chunkgen.kernels.prefill import plan_groups, prefill_attention
    from tests.helpers import prefill_reference

    for seed in range(4):
        cpu_pool, pool, spans, q, k, v = _cuda_wave(seed, dtype)
        out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
        groups = plan_groups(spans, 16, dtype, torch.device("cuda"))
        prefill_attention(groups, 0, q.cuda(), k.cuda(), v.cuda(), pool, 64**-0.5, out)
        want = prefill_reference(q, k, v, cpu_pool, spans, 64**-0.5)
        tol = 1e-3 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("alone", [True, False], ids=["every-sequence", "groups-too"])
def test_cuda_wave_as_variable_length_products(dtype, alone):
    """A wave on a GPU pool as the engine plans it there (varlen.plan_wave): lone sequences in one
    variable-length causal product (torch's flash kernel in fp16 and bf16, its memory-efficient
    one in fp32), groups in two more where flash takes them: against naive attention, and each
    lone sequence's rows bit for bit the same when it is batched alone."""
    from chunkgen.kernels.prefill import plan_groups, prefill_attention
    from chunkgen.kernels.varlen import flash_takes, plan_wave
    from tests.helpers import prefill_reference

    cuda = torch.device("cuda")
    with_groups = flash_takes(dtype, 64, cuda)
    assert with_groups == (dtype != torch.float32)  # an H100 or H200 takes both 16-bit types
    for seed in range(4):
        cpu_pool, pool, spans, q, k, v = _cuda_wave(seed, dtype)
        qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
        out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
        groups = plan_groups(spans, 16, dtype, cuda, alone=alone)
        prefill_attention(groups, 0, qc, kc, vc, pool, 64**-0.5, out, varlen=plan_wave(groups, 16, cuda, with_groups))
        want = prefill_reference(q, k, v, cpu_pool, spans, 64**-0.5)
        tol = 1e-3 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)
        for g in (g for g in groups if g.key_idx is None):
            a, b = g.contiguous
            each = torch.full_like(out, float("nan"))
            prefill_attention([g], 0, qc, kc, vc, pool, 64**-0.5, each, varlen=plan_wave([g], 16, cuda, with_groups))
            assert torch.equal(each[a:b], out[a:b]), f"seed {seed}: rows {a}-{b} depend on the batch"


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_cuda_kv_write_matches_indexing(pool_dtype, src_dtype):
    """The binding's K/V write on the GPU (one kernel, csrc/cuda/kv_write.cu): rows from strided
    views of one qkv product, bit for bit what torch's indexing stores."""
    from chunkgen._native import native

    gen = torch.Generator().manual_seed(3)
    rows, heads, d, chunk, slots = 37, 3, 64, 64, 80
    k_layer = torch.randn(slots, heads, d, chunk, generator=gen).to(pool_dtype).cuda()
    v_layer = torch.randn(slots, heads, chunk, d, generator=gen).to(pool_dtype).cuda()
    qkv = torch.randn(rows, 9 + 2 * heads, d, generator=gen).to(src_dtype).cuda()
    k, v = qkv[:, 9 : 9 + heads], qkv[:, 9 + heads :]
    slot = torch.randperm(slots, generator=gen)[:rows].to(torch.int32).cuda()
    offset = torch.randint(0, chunk, (rows,), generator=gen, dtype=torch.int32).cuda()
    want_k, want_v = k_layer.clone(), v_layer.clone()
    want_k[slot.long(), :, :, offset.long()] = k.to(pool_dtype)
    want_v[slot.long(), :, offset.long()] = v.to(pool_dtype)
    native().write_kv(k, v, k_layer, v_layer, slot, offset)
    assert torch.equal(k_layer, want_k) and torch.equal(v_layer, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_invariant_linear_matches_and_keeps_a_rows_bits(dtype):
    """The batch-invariant linear layer on the GPU: x W^T + b within the dtype's rounding of an fp64
    product, and each row's output bits the same at 1, 7, 64 and 300 rows and at another place."""
    from chunkgen.kernels import invariant

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 576, device="cuda", generator=gen).to(dtype)
    w = torch.randn(1000, 576, device="cuda", generator=gen).to(dtype)
    b = torch.randn(1000, device="cuda", generator=gen).to(dtype)
    y = invariant.linear(x, w, b)
    ref = x.double() @ w.double().T + b.double()
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.double(), ref, atol=tol * 24, rtol=tol)
    for rows in (1, 7, 64):
        assert torch.equal(invariant.linear(x[-rows:], w, b), y[-rows:]), rows
    perm = torch.randperm(300, device="cuda", generator=gen)
    assert torch.equal(invariant.linear(x[perm], w, b), y[perm])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_batch_invariant_answers_do_not_depend_on_the_batch(tiny_model, dtype):
    """--batch-invariant on, on the GPU: the same rows' answers and logprobs at --max-batch 16 and 1
    (in reverse order), and with their system prompt cached."""
    import random

    from chunkgen.engine.params import SamplingParams
    from chunkgen.llm import LLM

    words = ["alpha", "beta", "gamma", "delta", "tool", "call", "answer", "with", "the", "json"]
    rnd = random.Random(3)
    system = " ".join(rnd.choice(words) for _ in range(60))
    prompts = [system + " " + " ".join(rnd.choice(words) for _ in range(rnd.randrange(1, 25))) for _ in range(12)]
    params = SamplingParams(max_new_tokens=6, logprobs=1)
    llm = LLM(model=str(tiny_model), device="cuda", dtype=dtype, chunk_size=16, max_batch=16, batch_invariant="on")

    def rows(outs):
        return [(r.token_ids, [t.logprob for t in r.completions[0].logprobs]) for r in outs]

    fresh = rows(llm.generate(prompts, params))
    warm = rows(llm.generate(prompts, params))
    llm.engine = llm.new_engine(max_batch=1)
    alone = [rows(llm.generate([p], params))[0] for p in prompts[::-1]][::-1]
    assert warm == fresh
    assert alone == fresh
