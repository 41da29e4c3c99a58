"""The documentation's links hold: every relative link of README.md, docs/ and benchmarks/ reaches a
file (and a heading, when it names one), every page of docs/ is linked from the README, and no
page of docs/ holds a dated measurement. No network: links with a scheme (https:, mailto:) are not
followed. `make lint` runs this file."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose(text: str) -> str:
    """The text without fenced blocks and inline code, where brackets are not links."""
    text = re.sub(r"^(```|~~~).*?^\1\s*$", "", text, flags=re.M | re.S)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text, flags=re.S)


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to dashes."""
    found = set()
    for heading in re.findall(
        r"^#{1,6}\s+(.+?)\s*#*\s*$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S), re.M
    ):
        found.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return found


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text()))


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ... not followed
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / unquote(path)).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
            elif ROOT not in dest.parents and dest != ROOT:
                broken.append(f"{page.relative_to(ROOT)}: {target} (outside the repository)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    readme = ROOT / "README.md"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for t in links(readme)}
    unlinked = [p.relative_to(ROOT) for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_the_checker_finds_a_broken_link(tmp_path):
    # The checker's own parts, on a page made to break: a missing file, a missing heading, and code
    # that only looks like a link.
    page = tmp_path / "page.md"
    page.write_text(
        "# A title\n\n[ok](#a-title) [gone](missing.md) [bad](#nope)\n\n`[not](a-link.md)`\n```\n[x](y.md)\n```\n"
    )
    assert links(page) == ["#a-title", "missing.md", "#nope"]
    assert anchors(page) == {"a-title"}


def test_the_docs_pages_hold_no_dated_measurement():
    # Dated figures live in benchmarks/results/ (one file per sitting, never edited); a page of docs/
    # may link to them, and the README dates its headline tables, but a page holds no date itself.
    dated = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = re.sub(r"\[[^\]]*\]\([^)]*benchmarks/results/[^)]*\)", "", page.read_text())
        text = re.sub(r"benchmarks/results/[\w.-]+", "", text)  # a result's name, linked or not
        dated += [
            f"{page.relative_to(ROOT)}: {m.group(0)!r}" for m in re.finditer(r".{0,40}\b20\d\d-\d\d-\d\d\b", text)
        ]
    assert not dated, "dates in docs/ (move the measurement to benchmarks/results/ and link it):\n" + "\n".join(dated)
