"""The links between README.md and docs/ resolve: pages moved out of the README stay found."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_between_readme_and_docs_resolve() -> None:
    """Every relative link of README.md and docs/*.md names a file that exists, and an anchor
    into a Markdown file names one of its headings (pages moved out of the README stay found)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
                continue
            if anchor and dest.suffix == ".md":
                heads = re.findall(r"^#+ (.+)$", dest.read_text(), re.M)
                if anchor not in {_slug(h) for h in heads}:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []
