"""Markers of metrics.md: `dataclasses.fields(MetricRow)` merged with tables.METRICS, and the
histogram and heatmap constants of monitor/core."""

from __future__ import annotations

from dataclasses import fields

from timwatch.monitor.core.accumulator import TOP_K
from timwatch.monitor.core.histograms import (
    ABS_DELTA_LAYOUT,
    HEATMAP_ABS_DELTA_EDGES,
    HEATMAP_ENTROPY_EDGES,
)
from timwatch.monitor.core.masks import CLAMP, POLICIES, PolicyParams
from timwatch.monitor.core.row import MetricRow
from timwatch.monitor.store.models import METRIC_COLUMNS

from .common import code, merge_check, num, table
from .tables import METRICS

__all__ = ["markers"]


def _type(annotation: object) -> str:
    text = str(annotation)
    optional = text.endswith(" | None")
    base = text.removesuffix(" | None")
    return code(base) + (" or null" if optional else "")


def _series(name: str) -> str:
    """How the history keeps a field: as itself, per policy, or not at all."""
    if name in METRIC_COLUMNS:
        return "✓"
    per_policy = [c for c in METRIC_COLUMNS if c.removeprefix(f"{name}_") in POLICIES]
    return f"`{name}_<policy>`" if per_policy else ""


def _check_columns(names: list[str]) -> None:
    """Every history column is a row field or one of its per-policy ratios."""
    loose = [
        c
        for c in METRIC_COLUMNS
        if c not in names and not any(c.removeprefix(f"{n}_") in POLICIES for n in names)
    ]
    if loose:
        raise ValueError(f"history columns that are no MetricRow field: {', '.join(loose)}")


def _fields() -> str:
    row_fields = fields(MetricRow)
    names = [f.name for f in row_fields]
    merge_check("MetricRow field", names, METRICS, "tables.METRICS")
    _check_columns(names)
    rows = [[code(f.name), _type(f.type), _series(f.name), *METRICS[f.name]] for f in row_fields]
    return table(["field", "type", "series", "formula", "healthy"], rows)


def _edges(edges: tuple[float, ...]) -> str:
    return "[" + ", ".join(num(e) for e in edges) + ", ∞)"


def markers() -> dict[str, str]:
    sub_bins = 2**ABS_DELTA_LAYOUT.sub_bits
    width = 100.0 / sub_bins
    return {
        "clamp": num(CLAMP),
        "eps": num(PolicyParams().eps),
        "fields": _fields(),
        "sub_bits": str(ABS_DELTA_LAYOUT.sub_bits),
        "sub_bins": str(sub_bins),
        "lo_exp": str(ABS_DELTA_LAYOUT.lo_exp),
        "hi_exp": str(ABS_DELTA_LAYOUT.hi_exp),
        "bin_width": f"{width:.2f}",
        "half_width": f"{width / 2:.1f}",
        "entropy_edges": _edges(HEATMAP_ENTROPY_EDGES),
        "entropy_rows": str(len(HEATMAP_ENTROPY_EDGES)),
        "delta_edges": _edges(HEATMAP_ABS_DELTA_EDGES),
        "delta_cols": str(len(HEATMAP_ABS_DELTA_EDGES)),
        "top_k": str(TOP_K),
    }
