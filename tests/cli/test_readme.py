"""Every bash and python snippet of the README runs as written, from the repository's root, on the
tiny model (CHUNKGEN_MODEL stands for the default model). A comment just above a snippet may say
`<!-- readme-test: skip: WHY -->` or `<!-- readme-test: stop after N s ... -->` (a run meant to be
stopped: it must still be running then, and end cleanly on SIGTERM)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
TIMEOUT_S = 300


@dataclass
class Snippet:
    line: int
    lang: str
    code: str
    skip: str | None = None
    stop_after_s: float | None = None


def snippets() -> list[Snippet]:
    lines = README.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w+)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        note = lines[start - 1] if start else ""
        s = Snippet(start + 1, lang, "\n".join(lines[start + 1 : end]) + "\n")
        if (skip := re.match(r"<!-- readme-test: skip: (.+?) -->", note)) is not None:
            s.skip = skip.group(1)
        if (stop := re.match(r"<!-- readme-test: stop after (\d+) s", note)) is not None:
            s.stop_after_s = float(stop.group(1))
        if lang in ("bash", "python"):
            found.append(s)
        i = end + 1
    return found


def test_the_readme_has_snippets_and_marks_usage_lines_as_text():
    found = snippets()
    assert sum(s.lang == "python" for s in found) >= 2 and sum(s.lang == "bash" for s in found) >= 3
    for s in found:  # a synopsis with [optional] parts is text, not a snippet that could run
        assert s.skip or not re.search(r" \[--", s.code), f"README line {s.line}: a synopsis tagged {s.lang}"


@pytest.mark.parametrize("snippet", snippets(), ids=lambda s: f"README:{s.line}:{s.lang}")
def test_snippet_runs_as_written(snippet: Snippet, tiny_model, tmp_path):
    if snippet.skip:
        pytest.skip(snippet.skip)
    work = tmp_path / "repo"  # a copy of what the snippets read, so their outputs land in tmp
    work.mkdir()
    shutil.copytree(ROOT / "prompts", work / "prompts")
    bin_dir = tmp_path / "bin"  # `chunkgen` and `python` as an installed environment has them
    bin_dir.mkdir()
    (bin_dir / "chunkgen").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m chunkgen "$@"\n')
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "CHUNKGEN_MODEL": str(tiny_model),
    }
    argv = (
        ["bash", "-euo", "pipefail", "-c", snippet.code]
        if snippet.lang == "bash"
        else [sys.executable, "-c", snippet.code]
    )
    proc = subprocess.Popen(
        argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    if snippet.stop_after_s is not None:
        try:
            out, _ = proc.communicate(timeout=snippet.stop_after_s)
            pytest.fail(f"README line {snippet.line}: ended before it was to be stopped:\n{out[-3000:]}")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            out, _ = proc.communicate(timeout=60)
        assert "--resume to continue" in out, out[-3000:]  # the run stopped cleanly and said so
        return
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"README line {snippet.line}: still running after {TIMEOUT_S} s:\n{out[-3000:]}")
    assert proc.returncode == 0, f"README line {snippet.line} exited {proc.returncode}:\n{out[-3000:]}"
