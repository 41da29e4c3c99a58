"""What more than one test module uses: the repository's paths, the tiny random-weight model, running the command line in-process, reading records, the
random trees and kernel paths of the attention tests, parity with transformers, the op log of a
decode step, and which pages of a tensor are in memory."""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import random
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from chunkgen._native import native
from chunkgen.cache import ChunkPool, PrefixTree
from chunkgen.cli import app
from chunkgen.jobs.requests import read_rows
from chunkgen.jobs.templates import load_template
from chunkgen.kernels.prefill import PrefillSpan

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "prompts"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(out: Path) -> None:
    import sentencepiece as spm

    # Templates and queries, without the templates' [output] tables (constraints, schema files):
    # the tokenizer, and so every tiny-model output the tests compare, stays as it was before
    # templates had them.
    files = [f for f in sorted(PROMPTS.iterdir()) if f.suffix in (".toml", ".jsonl")]
    texts = [f.read_text().split("\n[output]")[0] for f in files]
    lines = [l for t in texts for l in t.splitlines() if l.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(out / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "chat_template": CHAT_TEMPLATE,
                "add_bos_token": True,
            }
        )
    )


def build_tiny_model(out: Path, arch: str = "llama", seed: int = 0, **sizes: int) -> Path:
    """A random-weight model with a tokenizer trained on the shipped prompts; `sizes` override the
    config's (hidden_size, num_hidden_layers, ...)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(sizes)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0))
    else:  # Qwen2: attention bias, tied embeddings, linear rope scaling
        model = Qwen2ForCausalLM(
            Qwen2Config(**common, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0})
        )
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def tensors_of(args) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += tensors_of(a)
    return out


def cpu_paths() -> list[str]:
    """The paths a bf16 call can take here, best first: forcing each one through CHUNKGEN_CPU_ISA."""
    old = os.environ.pop("CHUNKGEN_CPU_ISA", None)
    try:
        best = native().cpu_kernel_isa()
        os.environ["CHUNKGEN_CPU_ISA"] = "fp32"
        fp32 = native().cpu_kernel_isa()
    finally:
        os.environ.pop("CHUNKGEN_CPU_ISA", None)
        if old is not None:
            os.environ["CHUNKGEN_CPU_ISA"] = old
    order = ["amx", "avx512_bf16"]
    return [p for p in order[order.index(best) :]] + [fp32] if best in order else [fp32]


# Ops that read a tensor's value back to the host (a sync; refused inside a CUDA graph capture).
HOST_READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal")


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


runner = CliRunner()


PAGE = 4096


def resident(t: torch.Tensor) -> float:
    """Share of the whole pages inside t that are in memory (Linux's mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    start = -(-t.data_ptr() // PAGE) * PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // PAGE * PAGE
    pages = (end - start) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / pages


def records(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def run_cli(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


# A tiny Llama config.json for random weights (--dummy-weights): shapes small enough for seconds.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 500,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


# What every in-process `chunkgen run` of the tests starts from: the tiny model's chunk size and a
# small KV budget, no progress output, short answers, fp32 (answers that compare across runs).
RUN_DEFAULTS = {"chunk_size": 16, "kv_memory": "64MiB", "quiet": True, "max_new_tokens": 12, "dtype": "fp32"}


def cli_args(command: list[str], **options) -> list[str]:
    """`command` (e.g. ["bench", "e2e"]) followed by `options`, each as its option:
    max_new_tokens=2 -> --max-new-tokens 2, True -> the flag alone, False or None -> left out, a
    list -> the option once per item."""
    argv = list(command)
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


def base_args(
    model,
    out,
    queries=PROMPTS / "arithmetic_cot.queries.jsonl",
    template=PROMPTS / "arithmetic_cot.toml",
    **options,
) -> list[str]:
    """The argv of `chunkgen run` (the one place the tests build it): template, queries, out and
    model (None: the embedded default; template None: no --template, as for OpenAI rows), then
    RUN_DEFAULTS updated by `options` (as cli_args writes them)."""
    argv = ["run"]
    if template is not None:
        argv += ["--template", str(template)]
    argv += ["--queries", str(queries), "--out", str(out)]
    if model is not None:
        argv += ["--model", str(model)]
    return cli_args(argv, **{**RUN_DEFAULTS, **options})


def rows_of(*lines: str | bytes) -> list:
    data = b"".join((l if isinstance(l, bytes) else l.encode()) + b"\n" for l in lines)
    return list(read_rows(io.BytesIO(data)))


def openai_row(body: dict, cid: str = "r") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


def build_tree(seed, n_seqs, shared_len, chunk, kv_heads, head_dim, dtype, max_private=100, decode_steps=0):
    """A random tree: most prompts extend one system prompt, some stop inside it, some repeat an
    earlier prompt exactly (so a partly filled chunk is shared). K/V are random where tokens are and
    NaN everywhere else, like uninitialised pool memory: a kernel that reads past a chunk's length
    fails loudly."""
    rnd = random.Random(seed)
    pool = ChunkPool(1, kv_heads, head_dim, chunk, dtype, budget_bytes=1 << 27)
    tree = PrefixTree(pool)
    system = [rnd.randrange(50) for _ in range(shared_len)]
    prompts = []
    for s in range(n_seqs):
        if prompts and rnd.random() < 0.2:
            toks = list(rnd.choice(prompts))
        else:
            cut = rnd.randrange(0, shared_len + 1) if rnd.random() < 0.3 else shared_len
            toks = system[:cut] + [rnd.randrange(50) for _ in range(rnd.randrange(0 if cut else 1, max_private + 1))]
        prompts.append(toks)
        tree.insert(s, toks)
        tree.mark_ready(s)
    for _ in range(decode_steps):
        for s in range(n_seqs):
            tree.append(s, rnd.randrange(50))
    gen = torch.Generator().manual_seed(seed)
    n = pool.capacity
    written = torch.zeros(n, chunk, dtype=torch.bool)
    for s in range(n_seqs):
        slots, offsets = tree.positions(s, 0, tree.lengths[s])
        written[torch.tensor(slots), torch.tensor(offsets)] = True
    k = torch.randn(pool.k[0, :n].shape, generator=gen)  # [slots, kv_heads, head_dim, chunk]
    v = torch.randn(pool.v[0, :n].shape, generator=gen)  # [slots, kv_heads, chunk, head_dim]
    k.masked_fill_(~written[:, None, None, :], float("nan"))
    v.masked_fill_(~written[:, None, :, None], float("nan"))
    pool.k[0, :n], pool.v[0, :n] = k.to(dtype), v.to(dtype)
    return pool, tree


PATHS = cpu_paths()


@contextlib.contextmanager
def forced(path: str):
    """Run the kernel on `path` (CHUNKGEN_CPU_ISA is read on every call)."""
    old = os.environ.get("CHUNKGEN_CPU_ISA")
    os.environ["CHUNKGEN_CPU_ISA"] = path
    try:
        assert native().cpu_kernel_isa() == path
        yield
    finally:
        if old is None:
            os.environ.pop("CHUNKGEN_CPU_ISA")
        else:
            os.environ["CHUNKGEN_CPU_ISA"] = old


def nan_outside_windows(pool: ChunkPool, tree: PrefixTree, order: list, window: int) -> None:
    """NaN into every chunk no row's window reaches: a kernel that reads one (instead of skipping
    it) turns its output NaN."""
    needed = set()
    for seq in order:
        if seq is None:
            continue
        n = tree.lengths[seq]
        slots, _ = tree.positions(seq, max(0, n - window), n)
        needed.update(slots)
    unused = [s for s in range(pool.capacity) if s not in needed]
    if unused:
        pool.k[0, torch.tensor(unused)] = float("nan")
        pool.v[0, torch.tensor(unused)] = float("nan")


# The questions template_prompts fills in (the engine tests' workload).
TEMPLATE_QUESTIONS = [f"question {i}: what is {i} plus {2 * i}?" for i in range(16)]


def template_prompts(name: str = "arithmetic_cot", n: int = 16):
    t = load_template(PROMPTS / f"{name}.toml")
    return [t.messages({t.fields[0]: q}) for q in TEMPLATE_QUESTIONS[:n]]


# transformers' reference attention: eager is the one every release computes Gemma 2's logit
# soft-capping in (5.17 picks sdpa for it, which leaves the soft-cap out).
HF_ATTENTION = "eager"


def hf_greedy(model_dir, prompts_ids, max_new_tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=HF_ATTENTION)
    outs = []
    for ids in prompts_ids:
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        outs.append(gen[0, len(ids) :].tolist())
    return hf, outs


def hf_greedy_after_shared_prefix(hf, prompts_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy answers, the prompts' common beginning computed once into a
    `DynamicCache` that each `generate` continues from a copy of (transformers' own prompt reuse):
    the same model and greedy search, without prefilling the shared part once a prompt."""
    import copy
    import inspect
    import os

    from transformers import DynamicCache

    shared = len(os.path.commonprefix(prompts_ids)) - 1  # each prompt keeps a token of its own
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"  # newer name
    prefix = DynamicCache()
    hf(torch.tensor([prompts_ids[0][:shared]]), use_cache=True, **{name: prefix})
    outs = []
    for ids in prompts_ids:
        gen = hf.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, **{name: copy.deepcopy(prefix)}
        )
        outs.append(gen[0, len(ids) :].tolist())
    return outs


# Answers of the default model equal to transformers' token for token, of the 16 parity questions,
# in each dtype. bf16 itself moves near ties, and which ones with the thread count and the kernels
# (the sums' order): on the Xeon, transformers in bf16 gave its own fp32 answers on 12-13 of these
# 16, and chunkgen's bf16 gave transformers' bf16 answers on 11 (1 thread) to 13 (2 threads); on an
# H200, chunkgen's bf16 on the GPU gave transformers' bf16 GPU answers on 12.
EXACT = {"fp32": 14, "bf16": 10}


def assert_parity(hf, prompt_ids, ours, theirs, top=3):
    """Equal token sequences, or at the first divergence both tokens are a near tie (each within the
    other side's top few), as vLLM's tests accept; never a gross mismatch."""
    if ours == theirs:
        return
    i = (
        next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        if any(a != b for a, b in zip(ours, theirs))
        else min(len(ours), len(theirs))
    )
    assert i < min(len(ours), len(theirs)), f"lengths differ without a divergence: {ours} vs {theirs}"
    device = next(hf.parameters()).device
    logits = hf(torch.tensor([prompt_ids + theirs[:i]], device=device)).logits[0, -1]
    topk = logits.topk(top).indices.tolist()
    assert ours[i] in topk and theirs[i] in topk, f"gross mismatch at {i}: {ours[i]} vs {theirs[i]}"


def host_work(calls: list[tuple]) -> dict[str, list[str]]:
    """The ops of a logged step that would wait for the device or give shapes that depend on the
    data: scalar reads, nonzero, boolean-mask indexing, tensors built from Python data."""
    names = [str(f) for f, _, _ in calls]
    return {
        "syncs": [n for n in names if "_local_scalar_dense" in n or n.startswith("aten.item")],
        "nonzero": [n for n in names if "nonzero" in n or "masked_select" in n or "unique" in n],
        "bool_index": [
            str(f)
            for f, a, k in calls
            if str(f).startswith(("aten.index.", "aten.index_put"))
            and any(t.dtype == torch.bool for t in tensors_of(a[1:2]))
        ],
        "from_python": [n for n in names if "lift_fresh" in n or "scalar_tensor" in n],
    }


def copies_into(calls: list[tuple], buf: torch.Tensor) -> int:
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
    return sum(1 for f, a, _ in calls if str(f).startswith("aten.copy_") and lo <= a[0].data_ptr() < hi)


TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}  # q and P round to T


QUESTIONS = [
    "How many people does the authority supply?",
    "What is the design capacity of the works?",
    "How often are reservoirs inspected?",
    "What was leakage in 2023?",
    "Who closes the incident log?",
    "How long are records kept?",
    "What is the chlorine target?",
    "How many pumping stations are there?",
    "When do the large pumps run?",
    "How big is the solar farm?",
    "What is the pressure range?",
    "How many sampling taps are there?",
    "What triggers an incident?",
    "Where do the boreholes lie?",
    "What is the largest reservoir?",
    "How much notice is given before an interruption?",
]


CHUNK = 16


def run(engine, requests) -> tuple[dict[int, list[int]], list[tuple[int, int]]]:
    """Token ids per request, and (padded rows, context layout) of every decode step."""
    out: dict[int, list[int]] = {}
    rows: list[int] = []
    engine.add(requests)
    while engine.has_work:
        steps = engine.stats.decode_steps
        for r in engine.step():
            out[r.id] = r.completions[0].token_ids
        if engine.stats.decode_steps > steps:
            rows.append((engine.runner.ctx.rows, engine.runner.ctx.layouts))
    return out, rows


def store_new_tokens(pool, spans, k: torch.Tensor, v: torch.Tensor) -> None:
    """A wave's new K/V into layer 0 of the pool along each sequence's path, as the model stores
    them before attention (a lone sequence's product reads them there)."""
    C = pool.chunk_size
    for sp in spans:
        pos = torch.arange(sp.start, sp.start + sp.count)
        slots = torch.tensor(sp.path_slots)[pos // C]
        pool.write(0, pool.write_indices(slots, pos % C), k[sp.row : sp.row + sp.count], v[sp.row : sp.row + sp.count])


def random_wave(seed: int, n_seqs: int, chunk: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """A pool holding a shared system prompt's chunks and each sequence's own cached chunks
    (random K/V, NaN where no token is), and a wave of new tokens per sequence. Most sequences
    have cached exactly the system's full chunks plus part of one own chunk (they group), some a
    random length (they stand alone or start from nothing)."""
    rnd = random.Random(seed)
    pool = ChunkPool(1, kv_heads, head_dim, chunk, dtype, budget_bytes=1 << 26)
    system = [pool.allocate() for _ in range(rnd.randrange(0, 5))]
    spans, row = [], 0
    for _ in range(n_seqs):
        if system and rnd.random() < 0.7:
            start = len(system) * chunk + rnd.randrange(0, chunk)
        else:
            start = rnd.randrange(0, (len(system) + 2) * chunk)
        count = rnd.randrange(1, 40)
        n_chunks = -(-(start + count) // chunk)
        path = system[: min(len(system), start // chunk)]
        path += [pool.allocate() for _ in range(n_chunks - len(path))]
        spans.append(PrefillSpan(start, path, row, count))
        row += count
    gen = torch.Generator().manual_seed(seed)
    written = torch.zeros(pool.capacity, chunk, dtype=torch.bool)
    for sp in spans:
        for p in range(sp.start):
            written[sp.path_slots[p // chunk], p % chunk] = True
    k = torch.randn(pool.k[0, : pool.capacity].shape, generator=gen)
    v = torch.randn(pool.v[0, : pool.capacity].shape, generator=gen)
    k.masked_fill_(~written[:, None, None, :], float("nan"))
    v.masked_fill_(~written[:, None, :, None], float("nan"))
    pool.k[0, : pool.capacity], pool.v[0, : pool.capacity] = k.to(dtype), v.to(dtype)
    return pool, spans, row


def prefill_reference(
    q, k, v, pool: ChunkPool, spans: list[PrefillSpan], scale: float, window: int = 0, softcap: float = 0.0
) -> torch.Tensor:
    """Prefill attention's naive reference: each sequence's new queries over its cached tokens (read one by one) and its new tokens,
    causally, in float64; window > 0: a token at position t over positions (t - window, t] only;
    softcap > 0: scaled scores s capped as softcap * tanh(s / softcap)."""
    C, group = pool.chunk_size, q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for sp in spans:
        slots = torch.tensor([sp.path_slots[p // C] for p in range(sp.start)], dtype=torch.long)
        offs = torch.tensor([p % C for p in range(sp.start)], dtype=torch.long)
        rows = slice(sp.row, sp.row + sp.count)
        keys = torch.cat([pool.k[0, slots, :, :, offs].double(), k[rows].double()])  # [n, Hk, d]
        values = torch.cat([pool.v[0, slots, :, offs].double(), v[rows].double()])
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        s = torch.einsum("thd,nhd->htn", q[rows].double(), keys) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        key_pos, q_pos = torch.arange(sp.start + sp.count)[None, :], sp.start + torch.arange(sp.count)[:, None]
        visible = (key_pos <= q_pos) & ((key_pos > q_pos - window) if window else True)
        s = s.masked_fill(~visible, float("-inf"))
        out[rows] = torch.einsum("htn,nhd->thd", s.softmax(-1), values)
    return out


def dense_lse_reference(q, k, v, scale, causal=False, mask=None):
    """(o, lse) in float64: q [B, Hq, T, d], k, v [B, Hk, S, d], causality aligned to the last rows."""
    group = q.shape[1] // k.shape[1]
    kd, vd = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("bhtd,bhsd->bhts", q.double(), kd) * scale
    T, S = s.shape[-2:]
    if causal:
        s = s.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(S - T + 1), float("-inf"))
    if mask is not None:
        s = s + mask.double()
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhts,bhsd->bhtd", torch.exp(s - lse[..., None]), vd), lse


WINDOW_KINDS = ("below_chunk", "one_chunk", "several_chunks", "none")


def draw_window(rnd, kind: str, chunk: int) -> int:
    """A sliding window of `kind` (WINDOW_KINDS) for chunks of `chunk` tokens: below a chunk, one
    chunk, across several, or none (0)."""
    return {
        "below_chunk": rnd.randrange(1, chunk),
        "one_chunk": chunk,
        "several_chunks": rnd.randrange(chunk + 1, 4 * chunk),
        "none": 0,
    }[kind]
