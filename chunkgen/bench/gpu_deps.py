"""The packages `make gpu-check` needs on a GPU machine that is not ours to install into.

Such a machine has its own python with a CUDA torch in it, and often no package index. The
project's runtime and test requirements (pyproject.toml) are read there: each one that is absent or
outside its version range is installed from the wheels carried beside the checkout (`make
gpu-wheels` downloads them into `.whl/`) into a folder of its own, which the guard puts first on
every stage's PYTHONPATH. A requirement still unmet then fails the guard's first stage with its name
and the fix, instead of every later stage failing on an import.

Run as `python -m chunkgen.bench.gpu_deps SITE`: exit status 0 when every requirement is met.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".whl"
EXTRAS = ("test",)  # the guard runs tests/kernels/test_cuda.py too


def requirements(pyproject: Path = ROOT / "pyproject.toml", extras: tuple[str, ...] = EXTRAS) -> list[Requirement]:
    """The project's runtime requirements and those of `extras`."""
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def unmet(reqs: list[Requirement], version_of: Callable[[str], str | None] = installed_version) -> list[str]:
    """Each requirement not met here, said as "name (absent)" or "name X (needs SPEC)". A local
    version label (torch's "+cu130") does not count against a range."""
    out = []
    for req in reqs:
        have = version_of(req.name)
        if have is None:
            out.append(f"{req.name} (absent)")
        elif req.specifier and not req.specifier.contains(have.split("+")[0], prereleases=True):
            out.append(f"{req.name} {have} (needs {req.specifier})")
    return out


def install_wheels(wheels: Path, site: Path) -> list[str]:
    """Install every wheel in `wheels` into `site` (no index, no dependencies: each one needed is
    carried); returns the wheels' file names, none when there are none or pip refused them."""
    files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not files:
        return []
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--disable-pip-version-check", "--upgrade", "--target", str(site), *map(str, files)],
    )  # fmt: skip
    if proc.returncode != 0:  # pip said why (a wheel for another python, say): nothing was installed
        return []
    return [f.name for f in files]


def main(argv: list[str] | None = None) -> int:
    site = Path((argv if argv is not None else sys.argv[1:])[0])
    reqs = requirements()
    missing = unmet(reqs)
    if missing:
        print("not met by this python:", "; ".join(missing))
        carried = install_wheels(WHEELS, site)
        print(
            f"installed from {WHEELS.name}/ into {site}: {', '.join(carried)}"
            if carried
            else f"no wheels installed from {WHEELS.name}/"
        )
        sys.path.insert(0, str(site))
        importlib.invalidate_caches()
        missing = unmet(reqs)
    if missing:
        print(
            "still not met: " + "; ".join(missing) + ". On a machine with a package index run `make gpu-wheels` "
            "(wheels for the GPU machine's python into .whl/), carry .whl with the checkout, and run again."
        )
        return 1
    print(f"every requirement of pyproject.toml (with {', '.join(EXTRAS)}) is met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
