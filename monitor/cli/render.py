"""Human-readable rendering of a metric row: rich tables grouped by topic."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.table import Table

__all__ = ["TOPICS", "render_row"]

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
    ),
}


def _fmt(value: Any) -> str:
    if value is None:
        return "[dim]—[/dim]"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def render_row(row: dict[str, Any], console: Console | None = None, title: str = "") -> None:
    """Print a row as topic tables, then the mask ratios of every policy side by side."""
    console = console or Console()
    head = (
        f"step {row['step']} · {row['tokens']} masked tokens in {row['sequences']} sequences"
        f" · entropy from {row.get('entropy_source')}"
    )
    tables: list[Table] = []
    for topic, names in TOPICS.items():
        table = Table(title=topic, title_justify="left", show_header=False, min_width=44)
        table.add_column("metric", style="cyan")
        table.add_column("value", justify="right")
        for name in names:
            table.add_row(name, _fmt(row.get(name)))
        tables.append(table)
    masks = Table(title="Masks (shadow evaluation: share rejected)", title_justify="left")
    masks.add_column("policy", style="cyan")
    masks.add_column("tokens", justify="right")
    masks.add_column("sequences", justify="right")
    for policy, ratio in row["mask_ratio"].items():
        masks.add_row(policy, _fmt(ratio), _fmt(row["seq_reject_ratio"].get(policy)))
    tables.append(masks)
    if title:
        console.rule(title)
    console.print(head)
    console.print(Group(*tables))
