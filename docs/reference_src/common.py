"""Helpers shared by the page builders: Markdown tables, number formatting, name-list merges."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["code", "merge_check", "num", "table"]


def _cell(text: str) -> str:
    """One table cell: pipes escaped (also inside code spans, as GitHub requires), one line."""
    return text.replace("|", "\\|").replace("\n", " ").strip() or "—"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def code(name: object) -> str:
    return f"`{name}`"


def num(value: Any) -> str:
    """A default or constant as a person writes it: 1.6, 0.01, 1e-08 → 1e-8, 20.0 → 20."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    text = f"{value:g}"
    mantissa, sep, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if sep else text


def merge_check(what: str, names: Sequence[str], entries: Mapping[str, Any], source: str) -> None:
    """Refuse a name without an entry and an entry without a name (ValueError naming both)."""
    missing = [n for n in names if n not in entries]
    unknown = [n for n in entries if n not in names]
    problems = []
    if missing:
        problems.append(f"{what} without an entry in {source}: {', '.join(missing)}")
    if unknown:
        problems.append(f"entries in {source} that name no {what}: {', '.join(unknown)}")
    if problems:
        raise ValueError("; ".join(problems))
