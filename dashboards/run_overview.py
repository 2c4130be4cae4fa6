"""*timwatch — Run overview*: every exported signal for the selected runs.

Every panel reads additive series (``rate`` of sums over counts, counters, histogram buckets),
summed over replicas before dividing, so it is exact when the batches of one step land on
different replicas; the per-replica latest-step gauges are never read (a step spread over
replicas makes them partial). The only gauges read are ``timwatch_step`` and
``timwatch_last_batch_timestamp_seconds``, under ``max by (run)``, which is exact, and, in the
*Trainer scalars* row, the ``timwatch_scalar_*`` gauges: the trainer's own logged numbers
(``Tap.log``, ``POST /v1/runs/{run}/scalars``) as of the latest post, under
``max by (run, source)`` (one post carries a step, so with one replica per run they are the
run's latest values).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.builders import timeseries as timeseries_b

from .common import (
    RUN,
    IdAllocator,
    base_dashboard,
    mask_ratio_window,
    rate_sum,
    ratio_of_rates,
    stat,
    timeseries,
)

__all__ = ["UID", "build", "scalar"]

UID = "timwatch-run"

KL_WINDOW = ratio_of_rates("timwatch_token_kl_sum", "timwatch_token_kl_count")
# Window IS-ratio moments from the additive summaries: E[r] = Σr/N, E[r²] = Σr²/N.
_R1 = ratio_of_rates("timwatch_token_is_ratio_sum", "timwatch_tokens_total")
_R2 = ratio_of_rates("timwatch_token_is_ratio_squared_sum", "timwatch_tokens_total")
IS_STD_WINDOW = f"sqrt(clamp_min(({_R2}) - ({_R1}) ^ 2, 0))"
# ESS = (Σr)² / (N·Σr²); the window length cancels, so rates can stand in for sums.
ESS_WINDOW = (
    f"{rate_sum('timwatch_token_is_ratio_sum')} ^ 2 / ({rate_sum('timwatch_tokens_total')}"
    f" * {rate_sum('timwatch_token_is_ratio_squared_sum')})"
)
# σ̂² = Σδ² / Σ(H + ε) with the default ESTR ε = 0.01.
NOISE_WINDOW = (
    f"{rate_sum('timwatch_token_log_ratio_squared_sum')}"
    f" / ({rate_sum('timwatch_token_entropy_sum')} + 0.01 * {rate_sum('timwatch_tokens_total')})"
)
# Rejections carry only `reason`: the service refuses some batches (bad token, too large)
# before it knows which run they belong to, so this is the one query without the run filter.
REJECTED_RATE = "sum by (reason) (rate(timwatch_rejected_batches_total[$__rate_interval]))"
ENTROPY_WINDOW = ratio_of_rates("timwatch_token_entropy_sum", "timwatch_token_entropy_count")
# Largest |δ| and version lag of the window: the upper bound of the highest non-empty bucket.
ABS_DELTA_MAX_WINDOW = (
    f"histogram_quantile(1, {rate_sum('timwatch_token_abs_log_ratio_bucket', by='le, run')})"
)
LAG_MAX_WINDOW = (
    f"histogram_quantile(1, {rate_sum('timwatch_token_version_lag_bucket', by='le, run')})"
)
LAG_MEAN_WINDOW = ratio_of_rates(
    "timwatch_token_version_lag_sum", "timwatch_token_version_lag_count"
)
TOKEN_ID_DRIFT_WINDOW = ratio_of_rates(
    "timwatch_token_id_mismatched_tokens_total", "timwatch_token_id_checked_tokens_total"
)


def _abs_delta_quantile(q: float) -> str:
    buckets = rate_sum("timwatch_token_abs_log_ratio_bucket", by="le, run")
    return f"histogram_quantile({q}, {buckets})"


def _gauge(metric: str) -> str:
    return f"max by (run) ({metric}{{{RUN}}})"


def scalar(name: str) -> str:
    """The latest value of trainer scalar `name` per run and source."""
    return f"max by (run, source) (timwatch_scalar_{name}{{{RUN}}})"


def _scalar_panel(
    ids: IdAllocator, title: str, description: str, unit: str, names: list[str], width: int = 8
) -> timeseries_b.Panel:
    targets = [(scalar(n), "{{run}} " + n + " ({{source}})") for n in names]
    return timeseries(ids, title, description, unit, targets, width=width)


def _scalar_rows(dash: dashboard_b.Dashboard, ids: IdAllocator) -> dashboard_b.Dashboard:
    panels = [
        ("Mismatch from trainer scalars",
         "The trainer's own mismatch numbers mapped onto timwatch's names (same formula as the "
         "per-token series of that name, docs/reference/metrics.md); for runs that send "
         "scalars instead of, or beside, per-token batches. Healthy: as the per-token panels.",
         "short", ["mismatch_kl", "kl_k1", "log_ratio_abs_mean", "log_ratio_abs_max"]),
        ("Trainer's own correction",
         "Numbers the trainer's correction computes that timwatch does not: its applied "
         "(truncated or masked) importance weight and the share of tokens it masked. Healthy: "
         "weight ≈ 1, masked share < 1 %.",
         "short", ["is_weight_mean", "correction_masked_fraction", "exp_abs_log_ratio_mean"]),
        ("Reward", "Mean and std of the step's rewards as the trainer logs them. Healthy: "
         "rising mean; a std of 0 leaves GRPO no signal.", "short", ["reward_mean", "reward_std"]),
        ("Gradient norm and loss", "The actor's gradient norm and loss. Healthy: finite and "
         "bounded; a spike together with a mismatch rise is the early warning of a collapse.",
         "short", ["grad_norm", "loss"]),
        ("Entropy and clip fraction", "Policy entropy as the trainer aggregates it and the share "
         "of tokens the PPO clip was active on. Healthy: entropy falling slowly, clip fraction "
         "< 0.2.", "short", ["entropy", "clip_fraction"]),
        ("Response length and learning rate", "Mean and max response length (tokens) and the "
         "actor's learning rate. Healthy: length stable or slowly growing, not pinned at the "
         "maximum.", "short", ["response_length_mean", "response_length_max", "learning_rate"]),
    ]  # fmt: skip
    dash = dash.with_row(dashboard_b.Row("Trainer scalars").id(ids.next()))
    for title, description, unit, names in panels:
        dash = dash.with_panel(_scalar_panel(ids, title, description, unit, names))
    return dash


def build() -> dashboard_b.Dashboard:
    ids = IdAllocator()
    dash = (
        base_dashboard(
            "timwatch — Run overview",
            UID,
            "Train–inference mismatch of the selected runs: KL, |δ|, IS weights, masks, entropy, "
            "noise scale, staleness, token-id drift and ingest.",
        )
        .with_row(dashboard_b.Row("Mismatch").id(ids.next()))
        .with_panel(
            timeseries(
                ids,
                "Mismatch KL (k3)",
                "Mean k3 KL(μ‖π) per token over the window (sums/counts). Healthy: flat and "
                "< 1e-3 for bf16 rollouts (~1e-5 fp16); "
                "> 2e-2 is off-policy (TimwatchMismatchKLHigh).",
                "sci",
                [(KL_WINDOW, "{{run}}")],
                log_scale=True,
            )
        )
        .with_panel(
            timeseries(
                ids,
                "|δ| quantiles",
                "p50/p90/p99 of |log π − log μ| from the histogram. Healthy: p99 < 0.1 for bf16; "
                "p99 climbing while p50 stays flat means a tail of tokens is diverging.",
                "sci",
                [
                    (_abs_delta_quantile(0.5), "{{run}} p50"),
                    (_abs_delta_quantile(0.9), "{{run}} p90"),
                    (_abs_delta_quantile(0.99), "{{run}} p99"),
                ],
                log_scale=True,
            )
        )
        .with_panel(
            timeseries(
                ids,
                "Max |δ| (window)",
                "Largest |log π − log μ| of the window, to the histogram bucket (its upper "
                "bound). Healthy: < 1; spikes > 5 are tokens the trainer finds near-impossible "
                "(sampling or tokenization bug).",
                "none",
                [(ABS_DELTA_MAX_WINDOW, "{{run}}")],
                width=8,
                min_val=0,
            )
        )
        .with_panel(
            stat(
                ids,
                "Trainer step",
                "Step of the last batch. Healthy: rises steadily; flat while batches keep "
                "arriving means the same step is being re-sent.",
                "none",
                [(_gauge("timwatch_step"), "{{run}}")],
                width=8,
                height=8,
            )
        )
        .with_panel(
            stat(
                ids,
                "Time since last batch",
                "Seconds since the run's last accepted batch. Healthy: below a couple of step "
                "durations; growing means the run stalled or its sidecar stopped reporting.",
                "s",
                [(f"time() - {_gauge('timwatch_last_batch_timestamp_seconds')}", "{{run}}")],
                width=8,
                height=8,
            )
        )
        .with_row(dashboard_b.Row("Importance weights").id(ids.next()))
        .with_panel(
            timeseries(
                ids,
                "IS-ratio std",
                "Population std of r = π/μ over the window (from Σr, Σr²). Healthy: "
                "< 0.1 for bf16; > 0.5 means heavy-tailed weights that inflate gradient variance.",
                "none",
                [(IS_STD_WINDOW, "{{run}}")],
                min_val=0,
            )
        )
        .with_panel(
            timeseries(
                ids,
                "IS effective sample size",
                "ESS = (Σr)²/(N·Σr²) over the window. Healthy: > 0.99; below 0.9 the importance "
                "weights waste more than a tenth of the batch.",
                "percentunit",
                [(ESS_WINDOW, "{{run}}")],
                min_val=0,
            )
        )
        .with_row(dashboard_b.Row("Correction masks").id(ids.next()))
        .with_panel(
            timeseries(
                ids,
                "Mask ratio per policy (window)",
                "Share of tokens each policy would reject (shadow evaluation), from counters. "
                "Healthy: estr and icepop < 1%; a sustained rise above 5% means the correction "
                "is discarding signal.",
                "percentunit",
                [(mask_ratio_window(), "{{run}} {{policy}}")],
                width=24,
                min_val=0,
            )
        )
        .with_row(dashboard_b.Row("Entropy and engine noise").id(ids.next()))
        .with_panel(
            timeseries(
                ids,
                "Entropy mean",
                "Mean next-token entropy H (nats) over the window. Healthy: slowly "
                "varying; a steady fall toward 0 is entropy collapse.",
                "none",
                [(ENTROPY_WINDOW, "{{run}}")],
                min_val=0,
            )
        )
        .with_panel(
            timeseries(
                ids,
                "Noise scale σ̂²",
                "σ̂² = Σδ²/Σ(H+ε), ε = 0.01: engine noise with entropy drift divided out. "
                "Healthy: flat; a rise at flat entropy means engine numerics got noisier.",
                "sci",
                [(NOISE_WINDOW, "{{run}}")],
                log_scale=True,
            )
        )
        .with_row(dashboard_b.Row("Staleness and correctness").id(ids.next()))
        .with_panel(
            timeseries(
                ids,
                "Version lag max",
                "Largest policy_version − token version of the window (to the histogram bucket; "
                "exact up to 4) and the mean lag. Healthy: 0 for synchronous RL, at most the "
                "configured staleness bound for async RL.",
                "short",
                [(LAG_MAX_WINDOW, "{{run}} max"), (LAG_MEAN_WINDOW, "{{run}} mean")],
                min_val=0,
            )
        )
        .with_panel(
            timeseries(
                ids,
                "Token-id drift",
                "Share of the window's compared tokens whose trainer token id differs from the "
                "sampled one. Healthy: exactly 0; any non-zero value is a token-in-token-out "
                "(retokenization) bug.",
                "percentunit",
                [(TOKEN_ID_DRIFT_WINDOW, "{{run}}")],
                min_val=0,
            )
        )
        .with_row(dashboard_b.Row("Ingest").id(ids.next()))
        .with_panel(
            timeseries(
                ids,
                "Ingest rate (tokens/s)",
                "Masked tokens accepted per second. Healthy: steady while the run trains; a "
                "drop to 0 means the trainer tap or the sidecar stopped reporting.",
                "ops",
                [(rate_sum("timwatch_tokens_total"), "{{run}}")],
                width=8,
                min_val=0,
            )
        )
        .with_panel(
            timeseries(
                ids,
                "Ingest rate (batches/s, sequences/s)",
                "Batches and sequences accepted per second. Healthy: about one batch per trainer "
                "rank and step; 0 while training runs means batches are not arriving.",
                "ops",
                [
                    (rate_sum("timwatch_batches_total"), "{{run}} batches"),
                    (rate_sum("timwatch_sequences_total"), "{{run}} sequences"),
                ],
                width=8,
                min_val=0,
            )
        )
        .with_panel(
            timeseries(
                ids,
                "Rejected batches by reason (all runs)",
                "Batches refused per second by the service, by reason (not per run: a refused "
                "batch may name no valid run). Healthy: 0; any rate means a collector sends bad "
                "batches or a bad token.",
                "ops",
                [(REJECTED_RATE, "{{reason}}")],
                width=8,
                min_val=0,
            )
        )
    )
    return _scalar_rows(dash, ids)
