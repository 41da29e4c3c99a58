"""The GPU guard's requirements stage: pyproject's requirements read, the unmet ones named, and a
carried wheel installed into a folder of its own when this python lacks its package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

from chunkgen.bench import gpu_deps

FAKE = "chunkgen_guard_probe"  # a distribution no index has


def test_requirements_are_pyprojects_runtime_and_test_ones():
    names = {r.name for r in gpu_deps.requirements()}
    assert {"torch", "transformers", "gguf", "llguidance", "typer", "pytest", "hypothesis"} <= names


def test_unmet_names_what_is_absent_or_out_of_range():
    have = {"torch": "2.11.0+cu130", "typer": "0.31.0", "llguidance": "1.6.1", "rich": "15.0.0"}
    reqs = [Requirement(r) for r in ("torch>=2.4", "typer>=0.12,<0.30", "llguidance>=1.7", "gguf>=0.10", "rich")]
    assert gpu_deps.unmet(reqs, have.get) == [
        "typer 0.31.0 (needs <0.30,>=0.12)",
        "llguidance 1.6.1 (needs >=1.7)",
        "gguf (absent)",
    ]  # torch's local label (+cu130) is no reason to refuse it


def _wheel(folder: Path, version: str) -> Path:
    """A minimal pure-Python wheel of FAKE at `version`."""
    dist = f"{FAKE}-{version}.dist-info"
    path = folder / f"{FAKE}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{FAKE}/__init__.py", f"VERSION = {version!r}\n")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {FAKE}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


def test_a_carried_wheel_meets_what_this_python_lacks(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts the site folder first
    monkeypatch.setattr(gpu_deps, "requirements", lambda: [Requirement(f"{FAKE}>=1.0")])
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setattr(gpu_deps, "WHEELS", wheels)

    assert gpu_deps.main([str(tmp_path / "none")]) == 1  # nothing carried: named, with the fix
    out = capsys.readouterr().out
    assert f"still not met: {FAKE} (absent)" in out and "make gpu-wheels" in out

    _wheel(wheels, "0.9")
    assert gpu_deps.main([str(tmp_path / "old")]) == 1  # carried, but outside the range
    assert f"{FAKE} 0.9 (needs >=1.0)" in capsys.readouterr().out

    (wheels / f"{FAKE}-0.9-py3-none-any.whl").unlink()
    _wheel(wheels, "1.2")
    site = tmp_path / "site"
    assert gpu_deps.main([str(site)]) == 0
    assert "every requirement" in capsys.readouterr().out
    # A stage run after it, with the folder on its path as the guard sets it, imports the package.
    probe = subprocess.run([sys.executable, "-c", f"import {FAKE}; print({FAKE}.VERSION)"], capture_output=True,
                           text=True, env={"PYTHONPATH": str(site)})  # fmt: skip
    assert probe.stdout.strip() == "1.2"
