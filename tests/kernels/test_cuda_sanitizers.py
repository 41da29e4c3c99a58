"""The sanitizer checks' own test. `make cuda-racecheck` and `make cuda-memcheck` run the CUDA kernels
under the emulator built with ThreadSanitizer or AddressSanitizer and pass when it reports nothing,
which only means something if it reports the defects it should. Small kernels
(cuda_emu/sanitizer_canary.cpp) with a barrier missing across warps or within a warp, two blocks of
one launch writing the same word, and a read one element past a buffer must each be reported at
their line; their correct twins must not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.kernels.test_cuda_emulated import HERE, build_emulated

SOURCE = HERE / "sanitizer_canary.cpp"
pytestmark = pytest.mark.serial  # the emulator's threads meet at barriers (test_cuda_emulated.py)


def runtime(sanitizer: str) -> str | None:
    """The compiler's runtime of a sanitizer (`thread`: libtsan, `address`: libasan), which Python
    must preload to load a library built with it."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return None
    name = {"thread": "libtsan.so", "address": "libasan.so"}[sanitizer]
    path = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def preload(sanitizer: str) -> str:
    """LD_PRELOAD for Python: the sanitizer's runtime, and for AddressSanitizer libstdc++ too (its
    interceptor of C++ throws finds nothing to wrap in a Python that loads libstdc++ only later)."""
    libs = [runtime(sanitizer)]
    if sanitizer == "address":
        cxx = shutil.which("g++") or shutil.which("c++")
        libs.append(
            subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True).stdout.strip()
        )
    return " ".join(libs)


@pytest.fixture(scope="module")
def canaries(tmp_path_factory) -> dict:
    built = {}
    for sanitizer in ("thread", "address"):
        if runtime(sanitizer) is None:
            pytest.skip(f"the C++ compiler has no {sanitizer} sanitizer runtime, which the checks need")
        lib = tmp_path_factory.mktemp(f"canary_{sanitizer}") / "canary.so"
        built[sanitizer] = build_emulated([SOURCE], lib, sanitize=sanitizer)
    return built


def line_of(code: str) -> str:
    """`sanitizer_canary.cpp:N`, N the line holding `code`, as a report names it."""
    lines = SOURCE.read_text().splitlines()
    return f"{SOURCE.name}:{next(i for i, text in enumerate(lines, 1) if code in text)}"


CASES = {  # kind in the canary: (sanitizer, what it does, the code a report must name, or None)
    0: ("thread", "neighbours across warps, __syncthreads", None),
    1: ("thread", "neighbours across warps, no barrier", "words[t] ="),
    2: ("thread", "neighbours within a warp, __syncwarp", None),
    3: ("thread", "neighbours within a warp, no barrier", "words[t] ="),
    4: ("thread", "each block writes its own word", None),
    5: ("thread", "every block writes one word", "+= 1.f"),
    6: ("address", "a copy within the buffer", None),
    7: ("address", "a read one past the buffer", "out[i] = in[i]"),
    8: ("thread", "the warp at one shuffle", None),
    9: ("thread", "the warp's halves at two shuffles", "emulator: __shfl_down_sync(0xffffffffu, v, 1)"),
}
REPORTS = {"thread": "WARNING: ThreadSanitizer: data race", "address": "ERROR: AddressSanitizer: heap-buffer-overflow"}
EMULATOR = "emulator: "  # a CASES code the emulator's own check reports (exit 2, its message on stderr)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_sanitizers_report_exactly_the_defects(canaries, kind):
    sanitizer, what, code_line = CASES[kind]
    code = (
        "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); libc = ctypes.CDLL(None); n = 100;"
        "libc.malloc.restype = ctypes.c_void_p; src = ctypes.c_void_p(libc.malloc(4 * n));"  # exactly n floats
        "out = (ctypes.c_float * 128)(); sys.exit(lib.emu_canary(int(sys.argv[2]), src, n, out))"
    )
    env = dict(
        os.environ,
        LD_PRELOAD=preload(sanitizer),
        TSAN_OPTIONS="exitcode=66",
        ASAN_OPTIONS="detect_leaks=0:exitcode=66",
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(canaries[sanitizer]), str(kind)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if code_line is not None and code_line.startswith(EMULATOR):
        line = line_of(code_line.removeprefix(EMULATOR)).split(":")[1]
        assert run.returncode == 2 and f"is at the shuffle of line {line}" in run.stderr, (
            f"{what}: {run.stderr[-2000:]}"
        )
        return
    reported = REPORTS[sanitizer] in run.stderr
    if code_line is None:
        assert run.returncode == 0 and not reported, f"{what}: {run.stderr[-3000:]}"
    else:
        assert run.returncode == 66 and reported, f"{what}: not reported ({run.returncode}): {run.stderr[-2000:]}"
        assert line_of(code_line) in run.stderr, f"{what}: the report does not name {line_of(code_line)}"
