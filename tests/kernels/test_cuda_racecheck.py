"""The race check's own test: `make cuda-racecheck` runs the CUDA kernels under the emulator built
with ThreadSanitizer and passes when it reports nothing, which only means something if it reports
the races it should. Small kernels (cuda_emu/race_canary.cpp) with a barrier missing across warps or
within a warp, and two blocks of one launch writing the same word, must each be reported at their
line; their synchronised twins must not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.test_cuda_emulated import HERE, build_emulated


def tsan_runtime() -> str | None:
    """The compiler's ThreadSanitizer runtime, which Python must preload to load a sanitized library."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return None
    path = subprocess.run([cxx, "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.fixture(scope="module")
def canary(tmp_path_factory) -> Path:
    if tsan_runtime() is None:
        pytest.skip("the C++ compiler has no ThreadSanitizer runtime (libtsan), which the race check needs")
    lib = tmp_path_factory.mktemp("race_canary") / "race_canary.so"
    build_emulated(HERE / "race_canary.cpp", lib, sanitize=True)
    return lib


def line_of(code: str) -> str:
    """`race_canary.cpp:N`, N the line holding `code`, as a report names it."""
    lines = (HERE / "race_canary.cpp").read_text().splitlines()
    return f"race_canary.cpp:{next(i for i, text in enumerate(lines, 1) if code in text)}"


CASES = {  # kind in race_canary.cpp: (what it does, the code a report must name, or None)
    0: ("neighbours across warps, __syncthreads", None),
    1: ("neighbours across warps, no barrier", "words[t] ="),
    2: ("neighbours within a warp, __syncwarp", None),
    3: ("neighbours within a warp, no barrier", "words[t] ="),
    4: ("each block writes its own word", None),
    5: ("every block writes one word", "+= 1.f"),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_race_check_reports_exactly_the_races(canary, kind):
    what, code_line = CASES[kind]
    code = (
        "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); out = (ctypes.c_float * 128)();"
        "sys.exit(lib.emu_canary(int(sys.argv[2]), out))"
    )
    env = dict(os.environ, LD_PRELOAD=tsan_runtime(), TSAN_OPTIONS="exitcode=66")
    run = subprocess.run(
        [sys.executable, "-c", code, str(canary), str(kind)], env=env, capture_output=True, text=True, timeout=120
    )
    reported = "WARNING: ThreadSanitizer: data race" in run.stderr
    if code_line is None:
        assert run.returncode == 0 and not reported, f"{what}: {run.stderr[-3000:]}"
    else:
        assert run.returncode == 66 and reported, f"{what}: no race reported ({run.returncode})"
        assert line_of(code_line) in run.stderr, f"{what}: the report does not name {line_of(code_line)}"
