"""Batch-invariant numerics: one switch, read by the CPU kernels (csrc/invariant.h), the model's
linear layers and the prefill's attention plan. An engine turns it on before each step unless its
config says `--batch-invariant off` (the cost: docs/batch-invariance.md); a kernel called outside an
engine (a bench, a test) runs its fastest plan unless this is set.
On, a row's logits do not depend on the rows run beside it: each linear layer sums a row's products
in one order at any row count, attention folds one partial per chunk in the row's path order, and a
prefill wave attends each sequence over its own whole path."""

from __future__ import annotations

from chunkgen._native import native, native_cpu_available

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
