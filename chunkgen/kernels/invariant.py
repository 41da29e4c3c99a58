"""Batch-invariant numerics: one switch, read by the CPU and CUDA kernels (csrc/invariant.h), the
model's linear layers (on a GPU they take `linear` below) and the prefill's attention plan. An engine
sets it before each step from its config's `--batch-invariant` (auto: on, except on a GPU; the
cost: docs/batch-invariance.md); a kernel called outside an engine (a bench, a test) runs its
fastest plan unless this is set.
On, a row's logits do not depend on the rows run beside it: each linear layer sums a row's products
in one order at any row count, attention folds one partial per chunk in the row's path order, and a
prefill wave attends each sequence over its own whole path."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from chunkgen._native import native, native_cpu_available, native_cuda_available

_on = False


def enabled() -> bool:
    return _on


def set_enabled(on: bool) -> None:
    """Set for the whole process (an engine sets its config's choice before each step)."""
    global _on
    if on != _on or (native_cpu_available() and native().batch_invariant() != on):
        _on = on
        if native_cpu_available():
            native().set_batch_invariant(on)


@contextlib.contextmanager
def numerics(on: bool) -> Iterator[None]:
    """Batch-invariant numerics on or off inside the block, as an engine with that choice runs its
    kernels (a bench times what the engine runs), and the process's own setting again after it."""
    was = enabled()
    set_enabled(on)
    try:
        yield
    finally:
        set_enabled(was)


def _register_fake() -> None:
    if not native_cpu_available():
        return

    @torch.library.register_fake("chunkgen::invariant_linear")
    def _(x, w, bias=None):
        return x.new_empty(x.shape[0], w.shape[0])


_register_fake()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] W^T (+ bias) on the GPU with every output one fp32 sum over `in` in one order at
    any row count (csrc/invariant_linear.h): cuBLAS picks its kernel and split of k by the shape."""
    if not native_cuda_available():
        raise RuntimeError("batch-invariant linear layers on the GPU need chunkgen built with its CUDA kernels")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return torch.ops.chunkgen.invariant_linear.default(x, weight, bias)
