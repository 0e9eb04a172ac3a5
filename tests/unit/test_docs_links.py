"""Every relative link of the README and of docs/*.md names a file of the repository, and
every ``#anchor`` into a Markdown file names one of its headings (GitHub's slugs)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _slug(heading: str) -> str:
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^a-z0-9 -]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.MULTILINE)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in _LINK.findall(_FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue                                   # http(s), mailto
        name, _, anchor = target.partition("#")
        path = (doc.parent / name).resolve() if name else doc
        missing = not path.exists() or (anchor != "" and path.suffix == ".md"
                                        and anchor not in _anchors(path))
        if missing:
            broken.append(target)
    assert broken == [], f"{doc.relative_to(ROOT)}: links that lead nowhere: {broken}"


def test_the_readme_is_a_first_screen() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
