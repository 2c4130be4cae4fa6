"""*timwatch — Entropy-scaled view*: the ESTR score S = δ²/(H+ε) and what each mask rejects.

ESTR's premise is E[δ²] ≈ σ²H: high-entropy tokens are allowed a larger log-ratio. This board
puts the score distribution next to the mask ratios of ESTR, IcePop and the fixed |δ| threshold,
and next to the entropy and noise scale that explain why they differ.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dashboard_b

from .common import (
    IdAllocator,
    base_dashboard,
    heatmap_panel,
    mask_ratio_window,
    rate_sum,
    ratio_of_rates,
    timeseries,
)
from .run_overview import ENTROPY_WINDOW, NOISE_WINDOW

__all__ = ["UID", "build"]

UID = "timwatch-estr"

POLICIES = "estr|icepop|delta_abs"
SCORE_BUCKETS = rate_sum("timwatch_token_estr_score_bucket", by="le")
SCORE_MEAN = ratio_of_rates("timwatch_token_estr_score_sum", "timwatch_token_estr_score_count")


def _score_quantile(q: float) -> str:
    buckets = rate_sum("timwatch_token_estr_score_bucket", by="le, run")
    return f"histogram_quantile({q}, {buckets})"


def build() -> dashboard_b.Dashboard:
    ids = IdAllocator()
    return (
        base_dashboard(
            "timwatch — Entropy-scaled view",
            UID,
            "ESTR score distribution and the mask ratios of ESTR, IcePop and the fixed |δ| "
            "threshold, with the entropy and noise scale behind them.",
        )
        .with_panel(
            heatmap_panel(
                ids,
                "ESTR score S = δ²/(H+ε) distribution",
                "Tokens per second in each score bucket over time (all selected runs); ESTR "
                "rejects S > τ (1.6 math, 0.7 agentic). Healthy: mass well below τ, a thin tail.",
                "none",
                SCORE_BUCKETS,
            )
        )
        .with_panel(
            timeseries(
                ids,
                "Mask ratio: ESTR vs IcePop vs fixed |δ| (window)",
                "Window share of tokens each policy rejects. Healthy: all < 1%; ESTR above "
                "IcePop means low-entropy tokens drift that a ratio clip cannot see.",
                "percentunit",
                [(mask_ratio_window(POLICIES), "{{run}} {{policy}}")],
                min_val=0,
            )
        )
        .with_panel(
            timeseries(
                ids,
                "Rejected tokens per second: ESTR vs IcePop vs fixed |δ|",
                "Tokens each policy rejects per second over the window, summed over replicas "
                "(the numerator of the mask ratio). Healthy: small against the ingest rate and "
                "flat; a jump means a batch of bad sequences arrived.",
                "ops",
                [
                    (
                        rate_sum(
                            "timwatch_masked_tokens_total",
                            by="run, policy",
                            matchers=f'policy=~"{POLICIES}"',
                        ),
                        "{{run}} {{policy}}",
                    )
                ],
                min_val=0,
            )
        )
        .with_panel(
            timeseries(
                ids,
                "ESTR score quantiles and mean",
                "p50/p99 of S from the histogram and the window mean ΣS/N. Healthy: p99 well "
                "below τ; p99 near τ means ESTR is about to start masking heavily.",
                "sci",
                [
                    (_score_quantile(0.5), "{{run}} p50"),
                    (_score_quantile(0.99), "{{run}} p99"),
                    (SCORE_MEAN, "{{run}} mean"),
                ],
                log_scale=True,
            )
        )
        .with_panel(
            timeseries(
                ids,
                "Entropy mean",
                "Mean next-token entropy H (nats) over the window. Healthy: slowly "
                "varying; falling entropy tightens ESTR's per-token trust region.",
                "none",
                [(ENTROPY_WINDOW, "{{run}}")],
                width=12,
                min_val=0,
            )
        )
        .with_panel(
            timeseries(
                ids,
                "Noise scale σ̂²",
                "σ̂² = Σδ²/Σ(H+ε), the engine noise ESTR's τ is calibrated against. Healthy: "
                "flat and well below τ; a rise at flat entropy means engine numerics changed.",
                "sci",
                [(NOISE_WINDOW, "{{run}}")],
                width=12,
                log_scale=True,
            )
        )
    )
