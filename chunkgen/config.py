"""One resolved configuration, from the command line (or `LLM(...)`) to the kernel.

`Config.resolve(...)` takes what the user asked (strings such as "auto" or "4GiB", numbers, flags),
checks every value and decides each `auto` once, against this machine: the device, the dtype, the
KV budget and the batch. The result records what was chosen and why (`why`), and is what the
engine, the jobs, inspect-tree, the benches and each Ray worker receive; nothing below it parses a
raw option again. Two values can only be known once the weights are loaded (the model's own dtype
and the free GPU memory for `kv_memory auto` on a GPU): `loaded(...)` fills them, with their reason.

The rules themselves live with what they are about (device.py: device, KV budget, batch;
model/precision.py: dtype); this module composes them and holds the defaults, each written once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from chunkgen.device import AUTO_MAX_BATCH, Accelerator, choose_device, choose_kv_memory, choose_max_batch, detect
from chunkgen.model.precision import DTYPE_NAMES, choose_dtype

# What each option is when not given, for the command line and `LLM(...)` alike.
DEFAULT_MODEL: str | None = None  # the embedded default model
DEFAULT_DEVICE = "auto"
DEFAULT_DTYPE = "auto"
DEFAULT_KV_MEMORY = "auto"
DEFAULT_MAX_BATCH = "auto"
DEFAULT_CHUNK_SIZE = 64
# auto: on (a row's answer does not depend on the rows beside it) on the CPU; off on the GPU, whose
# batch-invariant kernels' cost is still to be measured there (docs/batch-invariance.md)
DEFAULT_BATCH_INVARIANT = "auto"
# Linear weights as the file ships them: the embedded default model (a Q4_1 GGUF) runs quantized;
# models that are not GGUF run in floats (docs/quantized.md).
DEFAULT_QUANTIZE = "auto"
DEFAULT_MAX_PREFILL_TOKENS = 8192  # new tokens computed in one batched prefill wave
# New tokens a wave may carry into a decode step's forward (engine/scheduler.py, mixed steps): small
# enough that the running sequences' steps stay short, large enough that a job's refills (a few rows
# of a few dozen tokens as others finish) join the steps whole.
DEFAULT_MIXED_PREFILL_TOKENS = 256
ORDERS = ("prefix", "input")


class OptionError(ValueError):
    """A value that cannot be used, with the option it came from. `usage` is False where the value
    is well formed but this machine cannot honour it (a GPU that is not there)."""

    def __init__(self, option: str, message: str, usage: bool = True) -> None:
        super().__init__(message)
        self.option = option
        self.message = message
        self.usage = usage


def kv_dtype_for(device: str | torch.device, dtype: torch.dtype) -> torch.dtype:
    """The K/V dtype of a model running in `dtype`: its own, except fp16 on the CPU, whose kernels
    read fp32 or bf16 K/V (fp16 is a GPU format) and keep fp16 models' K/V in fp32."""
    if torch.device(device).type == "cpu" and dtype == torch.float16:
        return torch.float32
    return dtype


def _invariance(value: bool | str, device: str) -> bool:
    """--batch-invariant: on, off, or auto (on except on a GPU, where its cost is not yet measured)."""
    if isinstance(value, bool):
        return value
    if value in ("on", "off"):
        return value == "on"
    if _is_auto(value):
        return not device.startswith("cuda")
    raise OptionError("--batch-invariant", f"must be auto, on or off, not {value!r}")


def _quantize(value: str, device: str, dummy: bool) -> str:
    """--quantize checked: none, auto, int8, or (random weights only) a GGUF type the kernel runs."""
    from chunkgen.model.quant import GGUF_TYPES

    value = str(value).lower()
    if value in GGUF_TYPES and not dummy:
        raise OptionError("--quantize", f"{value} is for --dummy-weights; a GGUF file runs its own types (auto)")
    if value not in ("none", "auto", "int8", *GGUF_TYPES):
        raise OptionError("--quantize", f"must be auto, none or int8 (or {', '.join(GGUF_TYPES)}), not {value!r}")
    if value not in ("none", "auto") and device.startswith("cuda"):
        raise OptionError(
            "--quantize", f"{value} runs on the CPU; on a GPU quantized weights are dequantized to floats at load"
        )
    return value


def read_ahead_window(max_batch: int) -> int:
    """Rows a job reads, validates and tokenizes ahead of the engine: enough to refill the batch
    several times over between two reads, never so many that memory grows with the file."""
    return max(64, 4 * max_batch)


@dataclass(frozen=True)
class Config:
    """What runs, decided. Plain values the engine reads directly; `why` says, for each choice that
    had an `auto` or a rule behind it (device, dtype, kv_memory, max_batch), why it is what it is."""

    model: str | None = None  # a model directory, .gguf or cached repo id; None: the embedded default
    dummy_weights: str | None = None  # a shipped config name or config.json: random weights (benchmarks)
    seed: int = 0  # of the random weights
    device: str = "cpu"  # "cpu" or "cuda:N"
    dtype: torch.dtype | None = torch.float32  # None: the model's own, until `loaded`
    kv_dtype: torch.dtype | None = None  # None: from dtype (kv_dtype_for), until `loaded`
    kv_memory: int | None = 4 << 30  # bytes; None: auto on a GPU, until `loaded` sees the free memory
    max_batch: int = AUTO_MAX_BATCH  # sequences run together at most; the KV budget may hold fewer
    chunk_size: int = DEFAULT_CHUNK_SIZE
    share_prefix: bool = True  # off: every sequence owns its chunks (no prefix caching)
    chunk_first: bool = True  # off: the paged baseline kernel
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    # while sequences decode, a wave runs in their step's forward, admitting rows until its new
    # tokens reach this many (on the CPU); 0: a wave runs alone, the decoding sequences waiting for it
    mixed_prefill_tokens: int = DEFAULT_MIXED_PREFILL_TOKENS
    enforce_eager: bool | None = None  # None: CUDA graphs on the GPU, plain eager steps on the CPU
    chat_template: bool = True  # off: chat messages joined by blank lines as plain text
    order: str = "prefix"  # a job's processing order: rows sharing a prompt prefix together, or file order
    # A row's numbers do not depend on the rows run beside it (docs/batch-invariance.md); off: each
    # kernel call's fastest plan.
    batch_invariant: bool = True
    # linear weights: none, auto (a GGUF's own types), int8, or a GGUF type (random weights)
    quantize: str = DEFAULT_QUANTIZE
    why: Mapping[str, str] = field(default_factory=dict)
    auto: frozenset[str] = frozenset()  # the options among device, dtype, kv_memory, max_batch asked as auto
    notes: tuple[str, ...] = ()  # warnings worth saying once (a slow choice)

    @classmethod
    def resolve(
        cls,
        model: str | None = None,
        *,
        device: str = DEFAULT_DEVICE,
        dtype: str | torch.dtype = DEFAULT_DTYPE,
        kv_memory: str | int = DEFAULT_KV_MEMORY,
        max_batch: str | int = DEFAULT_MAX_BATCH,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        kv_dtype: str | torch.dtype | None = None,
        share_prefix: bool = True,
        chunk_first: bool = True,
        enforce_eager: bool | None = None,
        chat_template: bool = True,
        order: str = "prefix",
        batch_invariant: bool | str = DEFAULT_BATCH_INVARIANT,
        dummy_weights: str | None = None,
        seed: int = 0,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        mixed_prefill_tokens: int = DEFAULT_MIXED_PREFILL_TOKENS,
        quantize: str = DEFAULT_QUANTIZE,
        found: Accelerator | None = None,
    ) -> Config:
        """Every option checked and every `auto` decided; raises OptionError naming the option."""
        if model is not None and dummy_weights is not None:
            raise OptionError("--dummy-weights", "replaces --model; give one of them")
        if order not in ORDERS:
            raise OptionError("--order", f"must be prefix or input, not {order!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 16 or chunk_size % 16:
            raise OptionError("--chunk-size", f"must be a multiple of 16 (16, 32, 64, ...), not {chunk_size}")
        if (
            isinstance(mixed_prefill_tokens, bool)
            or not isinstance(mixed_prefill_tokens, int)
            or mixed_prefill_tokens < 0
        ):
            raise OptionError(
                "--mixed-prefill-tokens", f"must be a whole number >= 0 (0: off), not {mixed_prefill_tokens}"
            )
        batch = _option("--max-batch", choose_max_batch, max_batch)
        dev = _device(device, found)
        invariant = _invariance(batch_invariant, dev.device)
        quantize = _quantize(quantize, dev.device, dummy_weights is not None)
        dtype_choice = _option("--dtype", choose_dtype, dtype, dev.device, suffix=" or auto")
        budget = _kv_budget(kv_memory, dev.device)
        notes = ()
        if not dev.device.startswith("cuda") and dtype_choice.dtype == torch.float16:
            notes = (
                "--dtype fp16 on the CPU runs its products in fp32 on widened weights (twice their memory; K/V in "
                "fp32), its activations rounded to fp16: fp32 or bf16 are the CPU's dtypes, fp16 is for --device cuda",
            )
        if invariant and dev.device.startswith("cuda"):
            notes += (
                "batch-invariant numerics on the GPU: chunkgen's own linear layers instead of cuBLAS, and every "
                "chunk through the decode kernel's chunk-first phase (docs/batch-invariance.md)",
            )
        explicit_kv = _option("--kv-dtype", choose_dtype, kv_dtype, dev.device).dtype if kv_dtype is not None else None
        resolved_kv = explicit_kv or (kv_dtype_for(dev.device, dtype_choice.dtype) if dtype_choice.dtype else None)
        return cls(
            model=model,
            dummy_weights=dummy_weights,
            seed=seed,
            device=dev.device,
            dtype=dtype_choice.dtype,
            kv_dtype=resolved_kv,
            kv_memory=budget.bytes if budget else None,
            max_batch=batch.rows,
            chunk_size=chunk_size,
            share_prefix=share_prefix,
            chunk_first=chunk_first,
            max_prefill_tokens=max_prefill_tokens,
            mixed_prefill_tokens=mixed_prefill_tokens,
            enforce_eager=enforce_eager,
            chat_template=chat_template,
            order=order,
            batch_invariant=invariant,
            quantize=quantize,
            notes=notes,
            auto=frozenset(
                k
                for k, v in (
                    ("device", device),
                    ("dtype", dtype),
                    ("kv_memory", kv_memory),
                    ("max_batch", max_batch),
                    ("batch_invariant", batch_invariant),
                )
                if _is_auto(v)
            ),
            why={
                "device": dev.reason,
                "dtype": dtype_choice.reason,
                "max_batch": batch.reason,
                **({"kv_memory": budget.reason} if budget else {}),
            },
        )

    def loaded(
        self, model_dtype: torch.dtype, free_bytes: int | None = None, dtype_reason: str | None = None
    ) -> Config:
        """The values only the loaded weights settle: the model's own dtype (auto on a GPU), its
        K/V dtype, and on a GPU `kv_memory auto` from the memory the weights left free."""
        changes: dict[str, Any] = {
            "dtype": model_dtype,
            "kv_dtype": self.kv_dtype or kv_dtype_for(self.device, model_dtype),
        }
        why = dict(self.why)
        if dtype_reason is not None:
            why["dtype"] = dtype_reason
        if self.kv_memory is None:
            budget = choose_kv_memory("auto", self.device, free_bytes)
            changes["kv_memory"] = budget.bytes
            why["kv_memory"] = budget.reason
        return dataclasses.replace(self, **changes, why=why)

    def replace(self, **options: Any) -> Config:
        """This configuration with some options asked anew: raw values (`max_batch="auto"`,
        `kv_memory="2GiB"`) go through the same checks and rules as in `resolve`."""
        why = dict(self.why)
        auto = set(self.auto)
        for name in ("max_batch", "kv_memory", "batch_invariant"):
            if name in options:
                auto.discard(name)
                if _is_auto(options[name]):
                    auto.add(name)
        if "max_batch" in options:
            batch = _option("--max-batch", choose_max_batch, options["max_batch"])
            options["max_batch"], why["max_batch"] = batch.rows, batch.reason
        if "kv_memory" in options:
            budget = _kv_budget(options["kv_memory"], self.device)
            if budget is None:  # auto on a GPU: the budget this configuration already holds
                options.pop("kv_memory")
            else:
                options["kv_memory"], why["kv_memory"] = budget.bytes, budget.reason
        if (
            "kv_dtype" in options
            and options["kv_dtype"] is not None
            and not isinstance(options["kv_dtype"], torch.dtype)
        ):
            options["kv_dtype"] = _option("--kv-dtype", choose_dtype, options["kv_dtype"], self.device).dtype
        if "batch_invariant" in options:
            options["batch_invariant"] = _invariance(options["batch_invariant"], self.device)
        return dataclasses.replace(self, **options, why=why, auto=frozenset(auto))

    @property
    def window(self) -> int:
        return read_ahead_window(self.max_batch)

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES.get(self.dtype, str(self.dtype)) if self.dtype is not None else "the model's own"


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _option(option: str, rule, value, *args, suffix: str = ""):
    try:
        return rule(value, *args)
    except ValueError as exc:
        raise OptionError(option, str(exc) + suffix) from None


def _device(name: str, found: Accelerator | None):
    from chunkgen.device import check_device_name

    _option("--device", check_device_name, name)
    try:
        return choose_device(name, found or detect())
    except ValueError as exc:
        raise OptionError("--device", str(exc), usage=False) from None


def _kv_budget(spec: str | int, device: str):
    """The budget in bytes with its reason; None for auto on a GPU (decided by `loaded`)."""
    if isinstance(spec, str) and spec.strip().lower() == "auto" and device.startswith("cuda"):
        return None
    budget = _option("--kv-memory", choose_kv_memory, spec, device, suffix=" or auto")
    if budget.bytes <= 0:
        raise OptionError("--kv-memory", f"must be positive, not {spec!r}")
    from chunkgen.device import human_bytes

    if device.startswith("cuda"):
        import torch

        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        if budget.bytes > total:
            raise OptionError(
                "--kv-memory",
                f"{human_bytes(budget.bytes)} is more than {device}'s memory ({human_bytes(total)}); "
                "the budget is reserved at load beside the weights, so give less, or auto",
            )
    else:
        import psutil

        total = psutil.virtual_memory().total
        if budget.bytes > total:
            raise OptionError(
                "--kv-memory",
                f"{human_bytes(budget.bytes)} is more than this machine's memory "
                f"({human_bytes(total)}); on the CPU the budget is a cap used as "
                "chunks fill, so give at most that",
            )
    return budget
