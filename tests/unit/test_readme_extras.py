"""The README's install table names exactly the extras pyproject.toml defines, so neither can
drift from the other (``test`` is the suite's own extra, not a user's), and the README stays at
most 250 lines."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _readme_extras() -> list[str]:
    """The extra of each row of the table under README's ``## Install``, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows, "no install table under README's ## Install"
    names = []
    for row in rows:
        first = row.split("|")[1]
        if (m := re.fullmatch(r"\s*`timwatch\[([a-z0-9_-]+)\]`\s*", first)) is not None:
            names.append(m.group(1))
    return names


def test_readme_install_table_names_every_extra_once() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = _readme_extras()
    assert len(names) == len(set(names)), names
    assert set(names) == set(extras) - {"test"}


def test_readme_is_at_most_250_lines() -> None:
    """What it is, the two commands, a screen per use, links: the rest lives in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"
