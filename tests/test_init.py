"""What `import chunkgen` sets up before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "given, expected",
    [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"), ({"GOMP_SPINCOUNT": "1000"}, "unset")],
)
def test_openmp_threads_wait_asleep_unless_the_environment_says_otherwise(given, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | given
    code = "import sys, os, chunkgen; print(os.environ.get('OMP_WAIT_POLICY', 'unset'), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [expected, "False"]  # set before torch is imported, so OpenMP reads it
