"""Every bash and python snippet of the README and of docs/*.md runs as written, from a copy of the
repository's prompts/, on the tiny model (CHUNKGEN_MODEL stands for the default model); every
`chunkgen` synopsis (a `text` block) and `chunkgen` command in the text names only options its
command has. A comment just above a snippet may say
- `<!-- readme-test: skip: WHY -->`,
- `<!-- readme-test: stop after N s ... -->`: a run meant to be stopped; it must still be running
  then, and end cleanly on SIGTERM,
- `<!-- readme-test: setup: ... -->`: it writes files that the later snippets of its page read; it
  is run, as written, before each of them too."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import click
import pytest
import typer

from chunkgen.cli import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SYNOPSIS_PAGES = [*PAGES, ROOT / "benchmarks" / "README.md"]  # commands shown there are checked, not run
TIMEOUT_S = 300


@dataclass
class Snippet:
    page: Path
    line: int
    lang: str
    code: str
    skip: str | None = None
    stop_after_s: float | None = None
    setup: bool = False

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)} line {self.line}"


def page_snippets(page: Path) -> list[Snippet]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w+)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        note = lines[start - 1] if start else ""
        s = Snippet(page, start + 1, lang, "\n".join(lines[start + 1 : end]) + "\n")
        if (skip := re.match(r"<!-- readme-test: skip: (.+?) -->", note)) is not None:
            s.skip = skip.group(1)
        if (stop := re.match(r"<!-- readme-test: stop after (\d+) s", note)) is not None:
            s.stop_after_s = float(stop.group(1))
        s.setup = note.startswith("<!-- readme-test: setup:")
        found.append(s)
        i = end + 1
    return found


def snippets(langs: tuple[str, ...] = ("bash", "python")) -> list[Snippet]:
    return [s for page in PAGES for s in page_snippets(page) if s.lang in langs]


def synopses() -> list[Snippet]:
    """Usage lines, and the commands of snippets that are not run: their options are checked."""
    blocks = [s for page in SYNOPSIS_PAGES for s in page_snippets(page) if s.lang in ("text", "bash")]
    return [
        s
        for s in blocks
        if (s.lang == "text" or s.skip or s.page not in PAGES) and re.search(r"^chunkgen ", s.code, re.M)
    ]


def test_the_pages_have_snippets_and_mark_usage_lines_as_text():
    readme = [s for s in snippets() if s.page.name == "README.md"]
    assert sum(s.lang == "python" for s in readme) >= 1 and sum(s.lang == "bash" for s in readme) >= 3
    assert len(snippets()) >= 10 and len(synopses()) >= 4
    for s in snippets():  # a synopsis with [optional] parts is text, not a snippet that could run
        assert s.skip or not re.search(r" \[--", s.code), f"{s.where}: a synopsis tagged {s.lang}"


@cache
def command_options() -> dict[str, set[str]]:
    """Every command's path (`run`, `bench e2e`) and the flags it takes, from the app itself."""
    found: dict[str, set[str]] = {}

    def walk(cmd: click.Command, path: str) -> None:
        flags = {o for p in cmd.params for o in [*p.opts, *p.secondary_opts] if o.startswith("-")}
        found[path] = flags | {"--help"}
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}".strip())

    walk(typer.main.get_command(app), "")
    return found


@pytest.mark.parametrize("synopsis", synopses(), ids=lambda s: f"{s.page.name}:{s.line}:synopsis")
def test_a_synopsis_names_only_options_its_command_has(synopsis: Snippet):
    known = command_options()
    for line in synopsis.code.replace("\\\n", " ").splitlines():
        words = line.split("#")[0].split()
        if words[:1] != ["chunkgen"]:
            continue
        path = max((p for p in known if p and words[1 : 1 + len(p.split())] == p.split()), key=len, default=None)
        assert path, f"{synopsis.where}: no command `{' '.join(words[:3])}`"
        unknown = sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line.split("#")[0])) - known[path])
        assert not unknown, f"{synopsis.where}: `chunkgen {path}` has no option {', '.join(unknown)}"


def test_inline_chunkgen_commands_name_only_options_their_command_has():
    # `chunkgen run ... --regex '[0-9]+'` in a sentence is checked as a synopsis is
    known, wrong = command_options(), []
    for page in SYNOPSIS_PAGES:
        prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S).replace("\n", " ")
        for command in re.findall(r"`(chunkgen [^`]+)`", prose):
            words = command.split()
            path = max((p for p in known if p and words[1 : 1 + len(p.split())] == p.split()), key=len, default=None)
            unknown = sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", command)) - known.get(path, set()))
            if path is None or unknown:
                wrong.append(f"{page.relative_to(ROOT)}: `{command}`: {unknown or 'no such command'}")
    assert not wrong, "\n".join(wrong)


def _environment(tmp_path: Path, tiny_model) -> tuple[Path, dict[str, str]]:
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
    return work, env


def _argv(snippet: Snippet) -> list[str]:
    if snippet.lang == "bash":
        return ["bash", "-euo", "pipefail", "-c", snippet.code]
    return [sys.executable, "-c", snippet.code]


@pytest.mark.parametrize("snippet", snippets(), ids=lambda s: f"{s.page.name}:{s.line}:{s.lang}")
def test_snippet_runs_as_written(snippet: Snippet, tiny_model, tmp_path):
    if snippet.skip:
        pytest.skip(snippet.skip)
    work, env = _environment(tmp_path, tiny_model)
    for before in page_snippets(snippet.page):
        if before.setup and before.line < snippet.line:
            done = subprocess.run(_argv(before), cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
            assert done.returncode == 0, f"{before.where} (set-up of line {snippet.line}):\n{done.stdout}{done.stderr}"
    proc = subprocess.Popen(
        _argv(snippet),
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    if snippet.stop_after_s is not None:
        try:
            out, _ = proc.communicate(timeout=snippet.stop_after_s)
            pytest.fail(f"{snippet.where}: ended before it was to be stopped:\n{out[-3000:]}")
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
        pytest.fail(f"{snippet.where}: still running after {TIMEOUT_S} s:\n{out[-3000:]}")
    assert proc.returncode == 0, f"{snippet.where} exited {proc.returncode}:\n{out[-3000:]}"


def test_the_bash_snippets_are_valid_shell():
    # bash -n parses without running: a quoting slip in a snippet that is not run is caught too
    for s in snippets(("bash",)):
        done = subprocess.run(["bash", "-n", "-c", s.code], capture_output=True, text=True)
        assert done.returncode == 0, f"{s.where}: {done.stderr}"
