"""A model with random weights built from a Hugging Face config, for benchmarks of shapes whose
weights are not at hand: `chunkgen bench e2e --dummy-weights llama-2-7b`.

The weights are drawn with a seed (the same seed, device and dtype give the same model, so a
benchmark can build a second copy for transformers' side), directly in the asked dtype on the
asked device: nothing larger is ever materialised. Shapes of eight models ship with chunkgen
(SHIPPED); any other config.json can be named by its path.

The tokenizer is the default model's when every one of its ids is a valid id of the config's
vocabulary; otherwise there is none that fits, and `IdsTokenizer` stands in: prompts are given as
token ids (the benchmark makes them), and text is only a rendering of the ids.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHIPPED = (
    "smollm2-135m",
    "llama-3.2-1b",
    "llama-2-7b",
    "llama-3.1-8b",
    "qwen3-0.6b",
    "qwen3-4b",
    "gemma-3-1b",
    "phi-3-mini",
)

# A GPU build's peak per byte of weights: transformers' model while LlamaModel fuses q/k/v and
# gate/up into new tensors (not measured again since the weights are released as they are fused).
GPU_PEAK_PER_WEIGHT_BYTE = 2.0
# A CPU build's peak over the layouts it keeps (see build_bytes), measured on random models of five
# shapes in bf16, fp32 and fp16 with batch-invariant numerics on and off: within the bound below.
BUILD_SLACK = 0.10  # of the weights: pack_linear's and oneDNN's scratch, the allocator's own
# transformers' modeling code and the tokenizer as they load (about 0.2 GiB), rotary tables, the
# K/V pool's first pages
BUILD_FIXED = 448 << 20


def linear_layouts(dtype: torch.dtype, invariant: bool) -> tuple[float, bool]:
    """(bytes a CPU load keeps per byte of a linear weight, whether the weight is widened) for
    model/llama.py's Linear, held once: the one packed copy chunkgen's product reads with
    batch-invariant numerics, without them oneDNN's packed copy beside it; fp16 weights widened to
    an fp32 copy (twice their bytes)."""
    from chunkgen._native import native_cpu_available
    from chunkgen.model.llama import decode_product_available

    own = os.environ.get("CHUNKGEN_DECODE_LINEAR", "1") != "0" and (
        dtype in (torch.float16, torch.float32)
        and native_cpu_available()
        or dtype == torch.bfloat16
        and decode_product_available()
    )
    if own and dtype == torch.float16:
        return 2.0, True
    onednn = torch.backends.mkldnn.is_available() and os.environ.get("CHUNKGEN_ONEDNN", "1") != "0"
    return (2.0 if own and onednn and not invariant else 1.0), False


def build_bytes(config, dtype: torch.dtype, device: str, invariant: bool = True) -> int:
    """Peak memory of building chunkgen's model of `config` in `dtype` (an upper bound). On the
    CPU a load converts transformers' model a product at a time and releases each product's
    weights once packed, so it holds what is not a linear weight (norms; the embedding, which a
    tied output layer's packed copy does not replace), every linear weight in the layouts kept
    (linear_layouts), and while one product is packed, two more of its size (its weights or their
    fused copy, and the packing's own; a widened weight's fp32 copy besides)."""
    if device.startswith("cuda"):
        return int(weight_bytes(config, dtype) * GPU_PEAK_PER_WEIGHT_BYTE)
    itemsize = torch.empty((), dtype=dtype).element_size()
    model = _skeleton(config, dtype)
    total = sum(p.numel() for p in model.parameters())  # a tied weight once
    linear = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    embeddings = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    tied = sum(w.numel() for w in embeddings if id(w) in linear)
    largest = max((sum(m.weight.numel() for m in group) for group in _products(model)), default=0)
    per_byte, widened = linear_layouts(dtype, invariant)
    held = total - sum(linear.values()) + tied + sum(linear.values()) * per_byte
    transient = largest * (4 if widened else 2)
    return int((held + transient + BUILD_SLACK * total) * itemsize + BUILD_FIXED)


def _products(model) -> list[list]:
    """The linear modules each product of LlamaModel fuses (q/k/v, gate/up; the others alone)."""
    fused = {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")}
    groups: list[list] = []
    for parent in model.modules():
        children = {name: m for name, m in parent.named_children() if isinstance(m, torch.nn.Linear)}
        for names in fused:
            if all(n in children for n in names):
                groups.append([children.pop(n) for n in names])
        groups.extend([m] for m in children.values())
    return groups


class DummyWeightsError(ValueError):
    """The config cannot be read or the model would not fit; the message says which and why."""


def config_path(spec: str | Path) -> Path:
    """A shipped name (SHIPPED), a config.json, or a folder holding one."""
    if str(spec) in SHIPPED:
        return CONFIGS / f"{spec}.json"
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise DummyWeightsError(
            f"--dummy-weights {spec}: not a shipped config ({', '.join(SHIPPED)}) "
            "nor a Hugging Face config.json (or a folder holding one)"
        )
    return path


def load_config(spec: str | Path):
    """The config a shipped name or a path stands for (see config_path)."""
    from chunkgen.model.loading import read_config

    return read_config(config_path(spec), DummyWeightsError)


def config_dtype(config) -> torch.dtype:
    """The dtype the config says its weights are in (fp32 when it says none)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _skeleton(config, dtype: torch.dtype):
    """The transformers model on the meta device: shapes only, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def weight_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of the model's weights in `dtype` (tied embeddings counted once)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in _skeleton(config, dtype).parameters()) * itemsize


# Bytes a quantized weight takes once repacked, at most (Q8_0, Q6_K: a byte a value plus fp32 scales).
QUANT_BYTES_PER_WEIGHT = 1.125


def quantized_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of the model with its linear layers quantized (model/skeleton.py: nothing else is
    made), every other parameter in `dtype`; an upper bound over the quantized types."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    model = _skeleton(config, dtype)
    linear = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    total = sum(p.numel() for p in model.parameters())
    return int(sum(linear.values()) * QUANT_BYTES_PER_WEIGHT + (total - sum(linear.values())) * itemsize)


def check_fits(
    config,
    dtype: torch.dtype,
    device: str,
    available: int,
    copies: int = 1,
    quantized: bool = False,
    invariant: bool = True,
) -> int:
    """Raises DummyWeightsError when building `copies` models of this config (chunkgen's, built
    with batch-invariant numerics or not, then transformers' own) would take more than `available`
    bytes; returns the estimate. quantized: linear layers drawn quantized (one copy)."""
    from chunkgen.model.precision import DTYPE_NAMES

    if quantized:
        weights = quantized_bytes(config, dtype)
        if weights > available:
            raise DummyWeightsError(
                f"random quantized weights of this config take about {weights / 2**30:.1f} GiB, more than "
                f"the {available / 2**30:.1f} GiB memory available"
            )
        return weights
    weights = weight_bytes(config, dtype)
    need = build_bytes(config, dtype, device, invariant) + (copies - 1) * weights
    if need > available:
        where = "GPU memory free" if device.startswith("cuda") else "memory available"
        smaller = "" if dtype != torch.float32 else " (--dtype bf16 halves it)"
        raise DummyWeightsError(
            f"random weights of this config in {DTYPE_NAMES.get(dtype, dtype)} are {weights / 2**30:.1f} GiB; "
            f"building them here takes about {need / 2**30:.1f} GiB"
            + (" with transformers' copy for the hf system" if copies > 1 else "")
            + f", more than the {available / 2**30:.1f} GiB {where}{smaller}"
        )
    return need


def random_model(config, dtype: torch.dtype, device: str, seed: int = 0, **kwargs):
    """The transformers model of `config` with weights drawn from `seed`, built in `dtype` on
    `device` (transformers' own initialisation: normal(0, initializer_range), norms at 1); kwargs
    go to from_config (attn_implementation)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from chunkgen.model.loading import _quiet_transformers

    _quiet_transformers()
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):  # the caller's RNG untouched
        torch.manual_seed(seed)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    model.generation_config = GenerationConfig.from_model_config(config)
    return model.eval()


class IdsTokenizer:
    """Stands in for a tokenizer when none fits the vocabulary: prompts come as token ids, and a
    text is the ids written out ("17 4 99")."""

    ids_only = True
    chat_template = None
    pad_token_id = None
    all_special_tokens: list[str] = []
    added_tokens_decoder: dict = {}

    def __init__(self, vocab_size: int, eos_token_id: int | list[int] | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text, **_):
        raise TypeError(
            "this model has random weights and no tokenizer that fits its vocabulary: give prompts as token ids"
        )

    def decode(self, ids, skip_special_tokens: bool = False, **_) -> str:
        return " ".join(str(int(i)) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [str(int(i)) for i in ids] if isinstance(ids, (list, tuple)) else str(int(ids))

    def convert_tokens_to_ids(self, tokens):
        return [int(t) for t in tokens] if isinstance(tokens, (list, tuple)) else int(tokens)

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self.vocab_size)}


def tokenizer_for(config):
    """The default model's tokenizer when all its ids are valid in this vocabulary, else IdsTokenizer."""
    from chunkgen.model.loading import ModelNotFound, load_tokenizer, resolve_model

    try:
        tok = load_tokenizer(resolve_model(None))
    except (ModelNotFound, OSError, ValueError):  # no default model installed: ids only
        tok = None
    if tok is not None and len(tok) <= config.vocab_size:
        return tok
    return IdsTokenizer(config.vocab_size, getattr(config, "eos_token_id", None))
