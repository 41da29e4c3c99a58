"""What `import chunkgen` sets up before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "given, expected",
    [
        ({}, ("unset", "10000")),
        ({"CHUNKGEN_THREADS": "fixed"}, ("unset", "2000")),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, ("PASSIVE", "unset")),
        ({"GOMP_SPINCOUNT": "300000"}, ("unset", "300000")),
    ],
)
def test_openmp_threads_spin_briefly_and_less_with_a_fixed_count_unless_the_environment_says_otherwise(given, expected):
    env = {
        k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "CHUNKGEN_THREADS")
    } | given
    code = (
        "import sys, os, chunkgen; e = os.environ; "
        "print(e.get('OMP_WAIT_POLICY', 'unset'), e.get('GOMP_SPINCOUNT', 'unset'), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [*expected, "False"]  # set before torch is imported, so OpenMP reads it
