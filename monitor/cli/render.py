"""Human-readable rendering of a metric row: rich tables grouped by topic."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

__all__ = ["TOPICS", "render_details", "render_row"]

TOPICS: dict[str, tuple[str, ...]] = {
    "KL": ("mismatch_kl", "kl_k1", "kl_k2", "discrepancy_kl", "staleness_kl"),
    "Log-ratio δ = π − μ": (
        "log_ratio_mean",
        "log_ratio_abs_mean",
        "log_ratio_abs_max",
        "log_ratio_abs_p99",
        "prob_abs_diff_mean",
        "prob_abs_diff_max",
    ),
    "IS ratio r = e^δ": (
        "is_ratio_mean",
        "is_ratio_std",
        "is_ratio_min",
        "is_ratio_max",
        "is_ess",
        "chi2_token",
    ),
    "Sequence": (
        "seq_log_ratio_abs_mean",
        "seq_log_ratio_abs_max",
        "seq_geo_ratio_mean",
        "chi2_seq",
    ),
    "Entropy": ("entropy_mean", "noise_scale", "entropy_delta_corr"),
    "Staleness & correctness": (
        "version_lag_mean",
        "version_lag_max",
        "intra_switch_ratio",
        "token_id_mismatch_ratio",
        "teacher_soft_ratio",
        "teacher_hard_ratio",
        "nonfinite_tokens",
        "impossible_tokens",
    ),
}


def _fmt(value: Any) -> str:
    if value is None:
        return "[dim]—[/dim]"
    if isinstance(value, float):
        return f"{value:.6g}"
    return escape(str(value))


def render_row(row: dict[str, Any], console: Console | None = None, title: str = "") -> None:
    """Print a row as topic tables, then the mask ratios of every policy side by side."""
    console = console or Console()
    head = (
        f"step {row['step']} · {row['tokens']} masked tokens in {row['sequences']} sequences"
        f" · entropy from {row.get('entropy_source')}"
    )
    if row.get("policy_version") is not None:
        head += f" · policy_version {row['policy_version']}"
    tables: list[Table] = []
    for topic, names in TOPICS.items():
        table = Table(title=topic, title_justify="left", show_header=False, min_width=44)
        table.add_column("metric", style="cyan")
        table.add_column("value", justify="right")
        for name in names:
            table.add_row(name, _fmt(row.get(name)))
        tables.append(table)
    masks = Table(
        title="Masks (shadow evaluation: share rejected)", title_justify="left", min_width=44
    )
    masks.add_column("policy", style="cyan")
    masks.add_column("tokens", justify="right")
    masks.add_column("sequences", justify="right")
    for policy, ratio in row["mask_ratio"].items():
        masks.add_row(escape(policy), _fmt(ratio), _fmt(row["seq_reject_ratio"].get(policy)))
    tables.append(masks)
    if title:
        console.rule(title)
    console.print(escape(head), highlight=False)
    console.print(Group(*tables))


def _bins(edges: list[float]) -> list[str]:
    """Labels of left-closed bins whose last one is open-ended: ``[0, 0.01)`` … ``≥ 3``."""
    inner = [f"[{lo:g}, {hi:g})" for lo, hi in zip(edges, edges[1:], strict=False)]
    return [*inner, f"≥ {edges[-1]:g}"]


def _length_table(buckets: dict[str, dict[str, Any]]) -> Table:
    t = Table(title="Length buckets (b = ⌊log2 n⌋)", title_justify="left")
    for name in ("b", "lengths", "sequences", "tokens", "mean |L|", "mismatch_kl"):
        t.add_column(name, justify="right")
    for key in sorted(buckets, key=int):
        b, v = int(key), buckets[key]
        t.add_row(
            str(b), f"{2**b}–{2 ** (b + 1) - 1}", _fmt(v["sequences"]), _fmt(v["tokens"]),
            _fmt(v["seq_log_ratio_abs_mean"]), _fmt(v["mismatch_kl"]),
        )  # fmt: skip
    return t


def _lag_table(buckets: dict[str, dict[str, Any]]) -> Table:
    t = Table(title="Lag buckets (policy_version − v)", title_justify="left", min_width=44)
    for name in ("lag", "tokens", "mismatch_kl"):
        t.add_column(name, justify="right")
    for key in sorted(buckets, key=int):
        t.add_row(key, _fmt(buckets[key]["tokens"]), _fmt(buckets[key]["mismatch_kl"]))
    return t


def _heatmap_table(heat: dict[str, Any]) -> Table:
    t = Table(
        title="Heatmap: tokens by H (rows) × |δ| (columns), ESTR-rejected in ( )",
        title_justify="left",
    )
    t.add_column("H \\ |δ|", style="cyan")
    for label in _bins(heat["abs_log_ratio_edges"]):
        t.add_column(escape(label), justify="right")
    for label, counts, rejected in zip(
        _bins(heat["entropy_edges"]), heat["all"], heat["estr_rejected"], strict=True
    ):
        cells = [f"{n} ({r})" if r else str(n) for n, r in zip(counts, rejected, strict=True)]
        t.add_row(escape(label), *cells)
    return t


def render_details(row: dict[str, Any], console: Console | None = None) -> None:
    """Print a row's buckets as small tables: length buckets, lag buckets (or why there are
    none), the entropy × |δ| heatmap and the worst tokens."""
    console = console or Console()
    console.print(_length_table(row.get("length_buckets") or {}))
    if row.get("lag_buckets"):
        console.print(_lag_table(row["lag_buckets"]))
    else:
        console.print("Lag buckets: none (the batches carry no versions or policy_version)")
    if row.get("heatmap"):
        console.print(_heatmap_table(row["heatmap"]))
    worst = row.get("worst_tokens") or []
    if worst:
        w = Table(*(escape(str(k)) for k in worst[0]), title="Worst tokens (by ESTR score)")
        for item in worst:
            w.add_row(*(_fmt(v) for v in item.values()))
        console.print(w)
