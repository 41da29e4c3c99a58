"""What `import chunkgen` sets up before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_threads_wait_asleep_unless_the_environment_says_otherwise(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    code = "import sys, os, chunkgen; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [expected, "False"]  # set before torch is imported, so OpenMP reads it
