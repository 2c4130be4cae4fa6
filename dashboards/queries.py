"""List every panel's PromQL with Grafana's template variables substituted.

Grafana expands ``$run``, ``$__rate_interval`` and friends before a query reaches Prometheus;
tests that run panel queries against a real Prometheus need the same expansion. This module
reads only the dashboard JSON (no grafana-foundation-sdk), so it works wherever the committed
files are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "DASHBOARD_DIR",
    "dashboard_files",
    "iter_panel_queries",
    "load_dashboards",
    "queries",
    "substitute",
]

DASHBOARD_DIR = Path(__file__).resolve().parent

_VAR = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def dashboard_files(directory: Path | None = None) -> list[Path]:
    """The committed dashboard JSON files, sorted by name."""
    return sorted((directory or DASHBOARD_DIR).glob("*.json"))


def load_dashboards(directory: Path | None = None) -> list[dict[str, Any]]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in dashboard_files(directory)]


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """Replace ``$name`` / ``${name}`` with ``values[name]``; unknown variables are an error."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"no value for template variable ${name} in {expr!r}")
        return values[name]

    return _VAR.sub(repl, expr)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows nest their panels


def iter_panel_queries(
    dashboard: Mapping[str, Any],
    run: str = ".*",
    policy: str = "estr",
    rate_interval: str = "1m",
    interval: str = "15s",
    range_: str = "1h",
) -> list[tuple[str, str, str]]:
    """``(dashboard_uid, panel_title, expr)`` for every target of every panel.

    ``run`` and ``policy`` are regexes as Grafana renders multi-value variables; the interval
    arguments stand in for ``$__rate_interval``, ``$__interval`` and ``$__range``.
    """
    values = {
        "run": run,
        "policy": policy,
        "__rate_interval": rate_interval,
        "__interval": interval,
        "__range": range_,
    }
    out = []
    for panel in _panels(list(dashboard.get("panels", []))):
        for target in panel.get("targets", []):
            expr = target.get("expr")
            if expr:
                out.append((dashboard["uid"], panel["title"], substitute(expr, values)))
    return out


def queries(directory: Path | None = None, **kwargs: str) -> list[tuple[str, str, str]]:
    """Every panel query of every committed dashboard (see :func:`iter_panel_queries`)."""
    return [q for d in load_dashboards(directory) for q in iter_panel_queries(d, **kwargs)]
