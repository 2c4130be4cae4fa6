"""Prometheus exposition (docs/reference/prometheus.md) built from the live run state on every
scrape.

A custom collector instead of module-level Gauge/Counter objects: the families are rebuilt from
``RunRegistry`` each scrape, so evicting a run removes all of its series at once, replays can
never double-count, and tests can run many apps in one process (each has its own registry).
Everything but the gauges is additive (``_sum``/``_count``, counters, cumulative buckets), so
``sum by (run)`` across replicas and ``rate()`` over any window stay exact. The gauges in
`PARTIAL_STEP_GAUGES` describe this process's share of its latest step only (partial when a
step's batches land on several replicas): no shipped alert or dashboard panel reads them
(tests/unit/test_fleet_exact.py); the `FLEET_EXACT_GAUGES` are exact under ``max by (run)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..core.scalars import CANONICAL
from .runs import REJECT_REASONS, SCALAR_REJECT_REASONS, RunRegistry, RunState, ScalarState

__all__ = [
    "CONTENT_TYPE",
    "FLEET_EXACT_GAUGES",
    "PARTIAL_STEP_GAUGES",
    "SCALAR_GAUGES",
    "TimwatchCollector",
    "make_registry",
    "render",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name, help, accumulator attribute holding the sum (count: masked tokens)
_SUMMARIES = (
    ("timwatch_token_kl", "Per-token k3 estimate of KL(rollout||trainer), nats.", "sum_k3"),
    (
        "timwatch_token_log_ratio_squared",
        "Squared per-token log-ratio delta^2.",
        "sum_log_ratio_sq",
    ),
    ("timwatch_token_entropy", "Per-token entropy H, nats.", "sum_entropy"),
    ("timwatch_token_is_ratio", "Per-token importance ratio r = exp(delta).", "sum_is_ratio"),
    (
        "timwatch_token_is_ratio_squared",
        "Squared per-token importance ratio r^2.",
        "sum_is_ratio_sq",
    ),
    (
        "timwatch_token_tis_weight",
        "Per-token truncated IS weight min(r, C), C = the TIS bound.",
        "sum_tis_weight",
    ),
    (
        "timwatch_token_prob_abs_diff",
        "Per-token probability difference |exp(logp_train) - exp(logp_rollout)|.",
        "sum_prob_abs_diff",
    ),
)
# per-sequence summaries (count: sequences with a masked token); verl's perplexity family
_SEQ_SUMMARIES = (
    (
        "timwatch_seq_training_log_ppl",
        "Per-sequence trainer log-perplexity -mean(logp_train), nats.",
        "sum_training_log_ppl",
    ),
    (
        "timwatch_seq_rollout_log_ppl",
        "Per-sequence rollout log-perplexity -mean(logp_rollout), nats.",
        "sum_rollout_log_ppl",
    ),
    (
        "timwatch_seq_training_ppl",
        "Per-sequence trainer perplexity exp(-mean(logp_train)).",
        "sum_training_ppl",
    ),
    (
        "timwatch_seq_rollout_ppl",
        "Per-sequence rollout perplexity exp(-mean(logp_rollout)).",
        "sum_rollout_ppl",
    ),
    (
        "timwatch_seq_log_ppl_diff",
        "Per-sequence log-perplexity difference mean(logp_rollout) - mean(logp_train).",
        "sum_log_ppl_diff",
    ),
    (
        "timwatch_seq_ppl_ratio",
        "Per-sequence perplexity ratio exp(mean(logp_rollout) - mean(logp_train)).",
        "sum_ppl_ratio",
    ),
    (
        "timwatch_seq_is_weight",
        "Per-sequence mean of the truncated IS weights min(r, C).",
        "sum_seq_is_weight",
    ),
)
_COUNTERS = (
    ("timwatch_tokens", "Masked (loss_mask=1) tokens ingested.", "tokens"),
    ("timwatch_sequences", "Sequences with at least one masked token ingested.", "sequences"),
    ("timwatch_batches", "Batches ingested (replays not counted).", "batches"),
    (
        "timwatch_impossible_tokens",
        "Masked tokens one side gives probability 0 (log-prob -inf, the other finite): "
        "delta = +-inf, left out of every metric.",
        "impossible_tokens",
    ),
    (
        "timwatch_is_ratio_low_tokens",
        "Masked tokens whose IS ratio is below 1/C (C = the TIS bound).",
        "is_ratio_low_tokens",
    ),
    (
        "timwatch_token_id_checked_tokens",
        "Masked tokens whose rollout and trainer token ids were both sent and compared.",
        "tid_tokens",
    ),
    (
        "timwatch_token_id_mismatched_tokens",
        "Compared masked tokens whose rollout and trainer token ids differ.",
        "tid_mismatch",
    ),
)
# The step row stored when this process took its last batch of the step: batches of that step
# that other replicas store later are missing from it.
_PARTIAL = " As of this replica's last batch of the step (later batches elsewhere missing)."
# gauge name, help, row key: this process's latest step row
_GAUGES = (
    ("timwatch_mismatch_kl", "Mean k3 KL of the latest step.", "mismatch_kl"),
    ("timwatch_is_ratio_std", "Population std of the IS ratio in the latest step.", "is_ratio_std"),
    ("timwatch_log_ratio_abs_max", "Max |delta| in the latest step.", "log_ratio_abs_max"),
    ("timwatch_entropy_mean", "Mean entropy (nats) in the latest step.", "entropy_mean"),
    (
        "timwatch_noise_scale",
        "ESTR noise scale sum(delta^2)/sum(H+eps), latest step.",
        "noise_scale",
    ),
    ("timwatch_version_lag_max", "Max policy-version lag in the latest step.", "version_lag_max"),
    (
        "timwatch_token_id_mismatch_ratio",
        "Share of masked tokens whose rollout and trainer token ids differ, latest step.",
        "token_id_mismatch_ratio",
    ),
)

#: the latest-step gauges: per replica, partial when a step's batches land on several replicas
PARTIAL_STEP_GAUGES = frozenset(name for name, _, _ in _GAUGES) | {"timwatch_mask_ratio"}
#: the trainer-scalar gauges: the latest post this replica took for the run (a step's scalars
#: arrive in one post, so with one replica, or one per run, they are the run's latest values)
SCALAR_GAUGES = frozenset(
    {"timwatch_scalar_step", *(f"timwatch_scalar_{name}" for name in CANONICAL)}
)
#: gauges whose ``max by (run)`` over replicas is the fleet-wide value
FLEET_EXACT_GAUGES = frozenset(
    {"timwatch_step", "timwatch_last_batch_timestamp_seconds", "timwatch_run_finished"}
)


def _num(v: Any) -> float | None:
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _buckets(edges: Iterable[tuple[float, int]]) -> list[tuple[str, float]]:
    return [(floatToGoString(edge), float(count)) for edge, count in edges]


class TimwatchCollector(Collector):
    """Builds every ``timwatch_*`` family from a ``RunRegistry`` snapshot."""

    def __init__(self, runs: RunRegistry) -> None:
        self.runs = runs

    def collect(self) -> Iterator[Metric]:
        yield from self.families(
            self.runs.snapshot(), self.runs.rejected(), self.runs.scalar_states(),
            self.runs.scalar_rejected(),
        )  # fmt: skip

    def families(
        self,
        states: list[RunState],
        rejected: Mapping[str, int] | None,
        scalars: Iterable[ScalarState] = (),
        scalar_rejected: Mapping[str, int] | None = None,
    ) -> Iterator[Metric]:
        """Every family, always in the same order, with the samples of `states` (in their
        order) and, unless `rejected` is None, the run-less samples taken from it; the
        trainer-scalar families last, with the samples of `scalars` and `scalar_rejected`.
        `timwatch.monitor.service.exposition` renders runs and run-less samples apart (the
        scalar samples with the run-less ones: they are re-rendered on every scrape)."""
        yield from self._summaries(states)
        yield from self._counters(states, rejected)
        yield from self._histograms(states)
        yield from self._gauges(states)
        yield from scalar_families(list(scalars), scalar_rejected)

    def _summaries(self, states: list[RunState]) -> Iterator[Metric]:
        for table, count in ((_SUMMARIES, "tokens"), (_SEQ_SUMMARIES, "sequences")):
            for name, doc, attr in table:
                fam = SummaryMetricFamily(name, doc, labels=["run"])
                for s in states:
                    fam.add_metric(
                        [s.run],
                        count_value=int(getattr(s.acc, count)),
                        sum_value=float(getattr(s.acc, attr)),
                    )
                yield fam

    def _counters(
        self, states: list[RunState], rejected_counts: Mapping[str, int] | None
    ) -> Iterator[Metric]:
        for name, doc, attr in _COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=["run"])
            for s in states:
                fam.add_metric([s.run], float(getattr(s.acc, attr)))
            yield fam
        masked = CounterMetricFamily(
            "timwatch_masked_tokens",
            "Masked tokens each policy rejects (shadow evaluation of every policy).",
            labels=["run", "policy"],
        )
        for s in states:
            for policy, n in sorted(s.acc.masked_tokens.items()):
                masked.add_metric([s.run, policy], float(n))
        yield masked
        oob = CounterMetricFamily(
            "timwatch_seq_is_ratio_out_of_bounds_sequences",
            "Sequences whose mean IS ratio is above C (side=high) or below 1/C (side=low).",
            labels=["run", "side"],
        )
        for s in states:
            for side, n in s.acc.seq_is_ratio_out_of_bounds.items():
                oob.add_metric([s.run, side], float(n))
        yield oob
        rejected = CounterMetricFamily(
            "timwatch_rejected_batches",
            f"Batches refused, by reason ({', '.join(REJECT_REASONS)}).",
            labels=["reason"],
        )
        for reason, n in (rejected_counts or {}).items():
            rejected.add_metric([reason], float(n))
        yield rejected
        dropped = CounterMetricFamily(
            "timwatch_tap_dropped_batches",
            "Batches the run's taps reported dropping (header Timwatch-Tap-Dropped).",
            labels=["run"],
        )
        for s in states:
            dropped.add_metric([s.run], float(s.tap_dropped))
        yield dropped

    def _histograms(self, states: list[RunState]) -> Iterator[Metric]:
        abs_lr = HistogramMetricFamily(
            "timwatch_token_abs_log_ratio", "Per-token |delta| = |logp_train - logp_rollout|.",
            labels=["run"],
        )  # fmt: skip
        score = HistogramMetricFamily(
            "timwatch_token_estr_score", "Per-token ESTR score delta^2 / (H + eps).", labels=["run"]
        )
        for s in states:
            abs_lr.add_metric(
                [s.run], _buckets(s.acc.abs_log_ratio_buckets()), float(s.acc.sum_abs_log_ratio)
            )
            score.add_metric(
                [s.run], _buckets(s.acc.estr_score_buckets()), float(s.acc.sum_estr_score)
            )
        lag = HistogramMetricFamily(
            "timwatch_token_version_lag",
            "Per-token policy-version lag (batches with versions only).",
            labels=["run"],
        )
        for s in states:
            if s.acc.lag_tokens:
                lag.add_metric([s.run], _buckets(s.acc.version_lag_buckets()), float(s.acc.lag_sum))
        yield abs_lr
        yield score
        yield lag

    def _gauges(self, states: list[RunState]) -> Iterator[Metric]:
        step = GaugeMetricFamily(
            "timwatch_step", "Training step of the latest batch.", labels=["run"]
        )
        ts = GaugeMetricFamily(
            "timwatch_last_batch_timestamp_seconds",
            "Unix time the latest batch was accepted.",
            labels=["run"],
        )
        finished = GaugeMetricFamily(
            "timwatch_run_finished",
            "1 while the run is finished (POST /v1/runs/{run}/finish), within its grace; else 0.",
            labels=["run"],
        )
        for s in states:
            step.add_metric([s.run], float(s.step))
            ts.add_metric([s.run], s.last_batch_ts)
            finished.add_metric([s.run], 0.0 if s.finished_m is None else 1.0)
        yield step
        yield finished
        for name, doc, key in _GAUGES:
            fam = GaugeMetricFamily(name, doc + _PARTIAL, labels=["run"])
            for s in states:
                v = _num(s.row.get(key))
                if v is not None:
                    fam.add_metric([s.run], v)
            yield fam
        mask = GaugeMetricFamily(
            "timwatch_mask_ratio",
            "Share of masked tokens each policy rejects, latest step." + _PARTIAL,
            labels=["run", "policy"],
        )  # fmt: skip
        for s in states:
            for policy, v in sorted((s.row.get("mask_ratio") or {}).items()):
                x = _num(v)
                if x is not None:
                    mask.add_metric([s.run, policy], x)
        yield mask
        yield ts


def scalar_families(
    states: list[ScalarState], rejected: Mapping[str, int] | None
) -> Iterator[Metric]:
    """``timwatch_scalar_<name>{run, source}`` for every canonical scalar name (only those:
    the label and family sets stay bounded whatever trainers send), the step they are of, and
    ``timwatch_rejected_scalar_posts_total{reason}``. A non-finite value has no sample."""
    step = GaugeMetricFamily(
        "timwatch_scalar_step",
        "Training step of the latest trainer scalars (POST /v1/runs/{run}/scalars).",
        labels=["run", "source"],
    )
    for st in states:
        step.add_metric([st.run, st.source or ""], float(st.step))
    yield step
    for name, meaning in CANONICAL.items():
        fam = GaugeMetricFamily(
            f"timwatch_scalar_{name}",
            f"Trainer scalar {name} ({meaning.kind}): {meaning.help}; latest step.",
            labels=["run", "source"],
        )
        for st in states:
            v = st.values.get(name)
            if v is not None:
                fam.add_metric([st.run, st.source or ""], v)
        yield fam
    refused = CounterMetricFamily(
        "timwatch_rejected_scalar_posts",
        f"Scalar posts refused, by reason ({', '.join(SCALAR_REJECT_REASONS)}).",
        labels=["reason"],
    )
    for reason, n in (rejected or {}).items():
        refused.add_metric([reason], float(n))
    yield refused


def make_registry(runs: RunRegistry) -> CollectorRegistry:
    """A fresh registry holding only the timwatch collector (no process/platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TimwatchCollector(runs))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
