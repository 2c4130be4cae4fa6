"""The page state of a run as the service tells a trainer: the ``Timwatch-Page`` header.

The service adds the header to every answer about a run (a batch POST, ``GET
/v1/runs/{run}/page``) while one of its page alerts fires, and leaves it out otherwise. Its value
is ``firing; alerts=A,B; since=T``: the firing alert names (sorted, each ``[A-Za-z0-9_:]``) and
the earliest time they started firing (Unix seconds). `format_page` and `parse_page` are inverse
on every `Page` with such names: ``parse_page(format_page(p)) == p``. `parse_page` never raises:
a value it cannot read is ``None`` (no page), so a proxy that mangles headers cannot stop a run.
Standard library only: the trainer tap reads it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["PAGE_HEADER", "Page", "format_page", "parse_page"]

#: response header carrying a run's page state (absent: not paged)
PAGE_HEADER = "Timwatch-Page"
_NAME = re.compile(r"^[A-Za-z0-9_:]{1,200}$")


@dataclass(frozen=True)
class Page:
    """A run's firing page alerts: `alerts` sorted and unique, `since` the earliest start."""

    alerts: tuple[str, ...]
    since: float | None = None


def format_page(page: Page) -> str:
    """The header value of `page` (names that are not ``[A-Za-z0-9_:]`` are left out)."""
    names = ",".join(a for a in page.alerts if _NAME.match(a))
    out = f"firing; alerts={names}"
    if page.since is not None and math.isfinite(page.since):
        out += f"; since={page.since:.3f}"
    return out


def parse_page(value: str | None) -> Page | None:
    """The `Page` a header value says, or None for no header or one that is not a page."""
    if not value:
        return None
    parts = [p.strip() for p in value.split(";")]
    if parts[0].lower() != "firing":
        return None
    alerts: tuple[str, ...] = ()
    since = None
    for part in parts[1:]:
        key, _, val = part.partition("=")
        if key.strip() == "alerts":
            alerts = tuple(sorted({a for a in val.strip().split(",") if _NAME.match(a)}))
        elif key.strip() == "since":
            try:
                since = float(val)
            except ValueError:
                since = None
            if since is not None and not math.isfinite(since):
                since = None
    return Page(alerts, since)
