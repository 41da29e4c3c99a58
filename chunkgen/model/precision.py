"""Which dtype the weights, activations and K/V use when the user says `auto`, and why."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype | None  # None: the model's own dtype, known once it is loaded
    reason: str


def cpu_bf16_native() -> str | None:
    """The CPU's native bf16 arithmetic ("AMX", "AVX512_BF16"), or None. Without it, bf16 is
    emulated in fp32 and runs several times slower than fp32 (about 5x, measured on an AVX2 CPU)."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if caps.get("amx_bf16"):
        return "AMX"
    if caps.get("avx512_bf16"):
        return "AVX512_BF16"
    return None


def choose_dtype(name: str | torch.dtype, device: str) -> DtypeChoice:
    """`auto`: bf16 on a CPU with native bf16 arithmetic, fp32 on other CPUs, the model's own
    dtype on a GPU. Any other name is taken as given."""
    from chunkgen.model.loading import parse_dtype

    if isinstance(name, str) and name.lower() == "auto":
        if device.startswith("cuda"):
            return DtypeChoice(None, "auto: the model's own dtype on a GPU")
        native = cpu_bf16_native()
        if native:
            return DtypeChoice(torch.bfloat16, f"auto: the CPU has native bf16 arithmetic ({native})")
        return DtypeChoice(torch.float32, "auto: the CPU has no native bf16 arithmetic (AVX512_BF16 or AMX)")
    return DtypeChoice(parse_dtype(name), "as asked")
