"""The report's figures, drawn with matplotlib's Agg canvas into PNG data URIs.

Only `matplotlib.figure.Figure` objects are created (never pyplot), so rendering holds no
global state and may run in several threads at once. A figure is self-contained: the page
embeds it as ``data:image/png;base64,…`` and needs no network to show it. Each figure function
answers a figure it drew before for the same arguments from `figcache` (bounded by bytes).
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from ..core.numfmt import sig3
from .figcache import cached

__all__ = ["Curve", "buckets_png", "heatmap_png", "series_png"]

DPI = 96
#: a curve: label, steps, values
Curve = tuple[str, np.ndarray[Any, Any], np.ndarray[Any, Any]]
_LINE_STYLES = ("--", ":", "-.")
_SERIES_MARGINS = {"left": 0.075, "right": 0.99, "bottom": 0.15, "top": 0.91}


def _png(fig: Figure) -> str:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


@cached
def series_png(
    title: str,
    curves: Sequence[Curve],
    thresholds: Sequence[tuple[float, str]],
    *,
    ylabel: str = "",
    log: bool = False,
) -> str:
    """Curves over steps with each threshold ``(value, label)`` as a dashed red line; a log y
    axis when asked and every plotted value is positive."""
    fig = Figure(figsize=(10, 3.2))
    fig.subplots_adjust(**_SERIES_MARGINS)
    ax = fig.add_subplot()
    values: list[float] = []
    for label, x, y in curves:
        finite = np.isfinite(y)
        if not finite.any():
            continue
        ax.plot(x, y, lw=1.0, label=label)
        values += [float(v) for v in (np.nanmin(y[finite]), np.nanmax(y[finite]))]
    for i, (value, label) in enumerate(thresholds):
        ax.axhline(value, color="tab:red", lw=1.0, ls=_LINE_STYLES[i % 3], label=label)
        values.append(value)
    if log and values and min(values) > 0:
        ax.set_yscale("log")
    if not any(np.isfinite(y).any() for _, _, y in curves):
        ax.text(0.5, 0.5, "no values in this range", transform=ax.transAxes, ha="center")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # nothing drawn: no empty legend (and no warning)
        ax.legend(fontsize=7, loc="upper left", ncols=3)
    return _png(fig)


def _edge_labels(edges: Sequence[float]) -> list[str]:
    return [f"[{sig3(a)}, {sig3(b)})" for a, b in zip(edges, [*edges[1:], math.inf], strict=True)]


@cached
def heatmap_png(heatmap: dict[str, Any]) -> str:
    """Two panels of token counts on the H × |δ| grid: every masked token, ESTR-rejected."""
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    rows = _edge_labels(heatmap["entropy_edges"])
    cols = _edge_labels(heatmap["abs_log_ratio_edges"])
    for i, key in enumerate(("all", "estr_rejected")):
        ax = fig.add_subplot(1, 2, i + 1)
        grid = np.asarray(heatmap[key], dtype=np.float64)
        vmax = max(10.0, float(grid.max()))
        im = ax.imshow(
            np.where(grid > 0, grid, np.nan), origin="lower", aspect="auto", cmap="viridis",
            norm=LogNorm(vmin=1.0, vmax=vmax),
        )  # fmt: skip
        for (r, c), n in np.ndenumerate(grid):
            ax.text(c, r, f"{int(n)}", ha="center", va="center", fontsize=6, color="0.2")
        ax.set_xticks(range(len(cols)), cols, rotation=30, fontsize=6)
        ax.set_yticks(range(len(rows)), rows, fontsize=6)
        ax.set_xlabel("|δ| = |π − μ|")
        ax.set_ylabel("entropy H (nats)")
        ax.set_title("all masked tokens" if key == "all" else "ESTR-rejected", fontsize=9)
        fig.colorbar(im, ax=ax, label="tokens")
    return _png(fig)


@cached
def buckets_png(
    length_buckets: dict[str, dict[str, Any]], lag_buckets: dict[str, dict[str, Any]] | None
) -> str:
    """Mean k3 by sequence-length bucket (⌊log2 n⌋) and, with versions, by version lag."""
    panels = [("sequence length 2^b (masked tokens)", length_buckets, "b = ")]
    if lag_buckets:
        panels.append(("version lag", lag_buckets, ""))
    fig = Figure(figsize=(10, 3.0), layout="constrained")
    for i, (title, buckets, prefix) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        keys = list(buckets)
        kl = [buckets[k].get("mismatch_kl") for k in keys]
        heights = [v if v is not None and v > 0 else np.nan for v in kl]
        ax.bar(range(len(keys)), heights, color="tab:blue")
        every = max(1, math.ceil(len(keys) / 16))  # at most 16 labels stay legible
        ticks = range(0, len(keys), every)
        ax.set_xticks(list(ticks), [f"{prefix}{keys[j]}" for j in ticks], fontsize=7)
        if any(np.isfinite(h) for h in heights):
            ax.set_yscale("log")
        ax.set_title(f"mean k3 by {title}", fontsize=9)
        ax.set_ylabel("mismatch KL")
        ax.grid(alpha=0.3, axis="y")
    return _png(fig)
