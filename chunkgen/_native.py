"""The compiled kernels (chunkgen._C), imported once with a message that says how to fix a miss."""

from __future__ import annotations

from types import ModuleType

import torch  # noqa: F401  (loads libc10/libtorch that the extension links against)

try:
    import chunkgen._C as _compiled
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    _compiled = None
    _import_error: ImportError | None = exc
else:
    _import_error = None


def native() -> ModuleType:
    """The native module; raises a clear error when the package was installed without building it."""
    if _compiled is None:
        raise ImportError(
            "chunkgen's native kernels (chunkgen._C) are not built. Reinstall from the source tree "
            "with `pip install --no-build-isolation -e .` (see README) so they compile against the "
            f"installed torch. Import error: {_import_error}"
        )
    return _compiled


def native_cpu_available() -> bool:
    return _compiled is not None


def native_cuda_available() -> bool:
    return _compiled is not None and bool(getattr(_compiled, "with_cuda", False))
