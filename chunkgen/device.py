"""Which device a model runs on, how much K/V memory it gets there, how many sequences decode
together, and the guard that keeps a step's work on that device.

The choices are pure functions of what is passed in (is there a GPU, are the CUDA kernels built,
how much memory is free), so they are tested without a GPU; `detect()` and `free_bytes()` ask torch.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

CPU_KV_MEMORY = 4 << 30
# Share of the GPU memory still free once the weights are loaded that the KV pool takes; the rest
# is left for activations (a prefill wave of max_prefill_tokens), CUDA graphs and the allocator's
# slack, as vLLM leaves 1 - gpu_memory_utilization.
GPU_KV_FRACTION = 0.85
# The most sequences `max_batch auto` decodes together, vLLM's default max_num_seqs: a shared
# prefix's K/V is read once a step for all of them, so throughput grows with the batch until the
# linear layers are compute-bound; below this cap the KV budget decides.
AUTO_MAX_BATCH = 256

_DEVICE = re.compile(r"cpu|auto|cuda(:\d+)?")


@dataclass(frozen=True)
class DeviceChoice:
    device: str  # "cpu" or "cuda:N"
    reason: str


@dataclass(frozen=True)
class Accelerator:
    """What the machine offers: a CUDA GPU torch can use, chunkgen's CUDA kernels, the current GPU."""

    cuda: bool
    cuda_kernels: bool
    current: int = 0


def detect() -> Accelerator:
    from chunkgen._native import native_cuda_available

    cuda = torch.cuda.is_available()
    return Accelerator(cuda, native_cuda_available(), torch.cuda.current_device() if cuda else 0)


def check_device_name(name: str) -> None:
    if not _DEVICE.fullmatch(name):
        raise ValueError(f"must be auto, cpu, cuda or cuda:N, not {name!r}")


def choose_device(name: str, found: Accelerator) -> DeviceChoice:
    """`auto`: the GPU when torch sees one and chunkgen's CUDA kernels are built, else the CPU.
    `cuda` is the current GPU, named by its index so every later allocation names it too."""
    check_device_name(name)
    if name == "auto":
        if found.cuda and found.cuda_kernels:
            return DeviceChoice(f"cuda:{found.current}", "auto: a CUDA GPU and chunkgen's CUDA kernels")
        if found.cuda:
            return DeviceChoice(
                "cpu",
                "auto: torch sees a GPU but chunkgen was built without its CUDA kernels (CHUNKGEN_CUDA=1 at install)",
            )
        return DeviceChoice("cpu", "auto: no CUDA GPU")
    if name == "cpu":
        return DeviceChoice("cpu", "as asked")
    if not (found.cuda and found.cuda_kernels):
        raise ValueError(
            f"--device {name} needs a CUDA GPU, a CUDA build of torch and chunkgen built with its "
            "CUDA kernels (CHUNKGEN_CUDA=1 at install)"
        )
    return DeviceChoice(name if ":" in name else f"cuda:{found.current}", "as asked")


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """'4GiB', '512MB', '1e9' or an int, in bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (examples: 4GiB, 512MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class KVBudget:
    bytes: int
    reason: str


def choose_kv_memory(spec: str | int, device: str, free: int | None = None) -> KVBudget:
    """The KV pool's budget. `auto`: on a GPU, GPU_KV_FRACTION of the memory free once the weights
    are loaded (`free`), since the pool is reserved there at once; on the CPU CPU_KV_MEMORY, a cap
    rather than a reservation (pages are backed only as chunks fill). Any other value is a size."""
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        if device.startswith("cuda"):
            if free is None:
                raise ValueError("kv_memory auto on a GPU needs the free GPU memory")
            return KVBudget(
                int(free * GPU_KV_FRACTION),
                f"auto: {GPU_KV_FRACTION:.0%} of the {_gib(free)} GPU memory free after the weights",
            )
        return KVBudget(CPU_KV_MEMORY, f"auto: {_gib(CPU_KV_MEMORY)} on the CPU, used as chunks fill")
    return KVBudget(parse_bytes(spec), "as asked")


@dataclass(frozen=True)
class BatchChoice:
    rows: int  # the most sequences the scheduler runs together
    reason: str


def choose_max_batch(spec: str | int) -> BatchChoice:
    """Sequences decoded together. `auto`: up to AUTO_MAX_BATCH, as many as the KV budget holds as
    the run goes (the scheduler admits a sequence only while every running one keeps a free chunk
    for its next token, and preempts the youngest when decoding outgrows the pool), so the budget and
    the job's prompt lengths set the batch, not a fixed count. A number is a fixed cap."""
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "auto":
            return BatchChoice(AUTO_MAX_BATCH, "auto: as many as the KV budget holds")
        if not text.lstrip("-").isdigit():
            raise ValueError(f"must be a number of sequences or auto, not {spec!r}")
        spec = int(text)
    if isinstance(spec, bool) or not isinstance(spec, int):
        raise ValueError(f"must be a number of sequences or auto, not {spec!r}")
    if spec < 1:
        raise ValueError(f"must be at least 1 (or auto), not {spec}")
    return BatchChoice(spec, "as asked")


def free_bytes(device: str | torch.device) -> int:
    """Memory the device can still hand out: on a GPU what the driver reports free plus what torch's
    allocator holds unused (it would hand that out first)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        import psutil

        return psutil.virtual_memory().available
    free, _ = torch.cuda.mem_get_info(dev)
    return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def human_bytes(n: float) -> str:
    """A size the way every line chunkgen prints says it: 512 B, 3.2 MiB, 4.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def indexed(device: str | torch.device) -> torch.device:
    """The device with its index ("cuda" is the current GPU, cuda:N): torch tells cuda and cuda:0
    apart when it compares devices, though tensors always live on an indexed one."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def device_guard(device: str | torch.device) -> AbstractContextManager[Any]:
    """Makes `device` the current CUDA device while the block runs, so what reads the current device
    (new streams, graph capture, the kernels' launches) lands on it; nothing on the CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(dev.index if dev.index is not None else torch.cuda.current_device())


F = TypeVar("F", bound=Callable[..., Any])


def on_model_device(method: F) -> F:
    """Runs a method of an object that has `.model.device` under that device's guard."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        with device_guard(self.model.device):
            return method(self, *args, **kwargs)

    return guarded  # type: ignore[return-value]
