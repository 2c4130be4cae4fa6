"""Two runs side by side: each headline metric's means, their ratio B/A with a bootstrap
interval over steps, where the difference lives (length and version-lag buckets, B's worst
tokens) and one verdict line.

Invariants (tests/unit/test_compare.py): every metric of `HEADLINE` appears once in
``metrics``, with ``ratio`` None where either run has no value of it; ``where`` lists only
buckets both runs have; the verdict names the first headline metric both runs have and, when
B's diagnosis has a cause that fires (score ≥ `FIRES`) and A's does not, that cause's action
(the causes of `timwatch.monitor.diagnosis`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..diagnosis import FIRES, Diagnosis, StepSeries, diagnose
from ..diagnosis.buckets import merge_buckets
from ..diagnosis.findings import clean
from .bootstrap import Interval, ratio_interval

__all__ = ["CONCENTRATED", "HEADLINE", "MIN_STEPS", "Comparison", "compare_series", "fmt_ratio"]

#: the metrics compared, most telling first (store column names)
HEADLINE = ("mismatch_kl", "discrepancy_kl", "seq_log_ratio_abs_mean", "mask_ratio_estr")
#: with fewer steps than this in either run the interval is flagged as rough
MIN_STEPS = 5
#: a bucket whose ratio is at least this times the overall ratio is where B's excess sits
CONCENTRATED = 1.5


def fmt_ratio(x: float | None) -> str:
    """``14×``, ``1.3×``, ``0.52×``; ``-`` for None, ``∞`` for inf."""
    if x is None or math.isnan(x):
        return "-"
    if math.isinf(x):
        return "∞"
    return f"{x:.0f}×" if x >= 10 else f"{x:.2g}×"


@dataclass(frozen=True)
class MetricComparison:
    metric: str
    mean_a: float | None
    mean_b: float | None
    interval: Interval | None

    def to_dict(self) -> dict[str, Any]:
        iv = self.interval
        return {
            "metric": self.metric,
            "a": clean(self.mean_a),
            "b": clean(self.mean_b),
            "ratio": None if iv is None else clean(iv.point),
            "lo": None if iv is None else clean(iv.lo),
            "hi": None if iv is None else clean(iv.hi),
            "steps_a": None if iv is None else iv.n_a,
            "steps_b": None if iv is None else iv.n_b,
        }


@dataclass(frozen=True)
class Where:
    """One bucket both runs have: ``dimension`` (``length``: log2 response-length bucket,
    ``lag``: version lag), its key and label, each run's token-weighted mismatch_kl there."""

    dimension: str
    key: int
    label: str
    a: float
    b: float

    @property
    def ratio(self) -> float:
        return math.inf if self.a == 0 else self.b / self.a

    def to_dict(self) -> dict[str, Any]:
        return {
            "dimension": self.dimension, "key": self.key, "label": self.label,
            "a": self.a, "b": self.b, "ratio": clean(self.ratio),
        }  # fmt: skip


@dataclass(frozen=True)
class Comparison:
    run_a: str
    run_b: str
    metrics: list[MetricComparison]
    where: list[Where] = field(default_factory=list)
    worst_tokens: list[dict[str, Any]] = field(default_factory=list)
    verdict: str = ""
    cause: str | None = None
    rough: bool = False

    def metric(self, name: str) -> MetricComparison:
        return next(m for m in self.metrics if m.metric == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.run_a,
            "b": self.run_b,
            "metrics": [m.to_dict() for m in self.metrics],
            "where": [w.to_dict() for w in self.where],
            "worst_tokens": self.worst_tokens,
            "verdict": self.verdict,
            "cause": self.cause,
            "rough": self.rough,
        }


def _values(s: StepSeries, name: str) -> np.ndarray[Any, Any]:
    v = s.col(name)
    return v[np.isfinite(v)]


def _where(a: StepSeries, b: StepSeries) -> list[Where]:
    out: list[Where] = []
    for dim, detail in (("length", "length_buckets"), ("lag", "lag_buckets")):
        ka = {x.key: x for x in merge_buckets(a, detail)}
        for xb in merge_buckets(b, detail):
            xa = ka.get(xb.key)
            if xa is None:
                continue
            label = (
                f"lengths {2**xb.key}–{2 ** (xb.key + 1) - 1}" if dim == "length"
                else f"version lag {xb.key}"
            )  # fmt: skip
            out.append(Where(dim, xb.key, label, xa.mismatch_kl, xb.mismatch_kl))
    return out


def _worst(b: StepSeries, k: int = 5) -> list[dict[str, Any]]:
    tokens = [
        {**t, "step": step}
        for step, d in b.details.items()
        for t in (d.get("worst_tokens") or ())
        if isinstance(t, dict)
    ]
    tokens.sort(key=lambda t: -float(t.get("score") or 0.0))
    return tokens[:k]


def _fired(d: Diagnosis) -> dict[str, Any]:
    return {c.cause: c for c in d.causes if c.score >= FIRES}


def compare_series(
    a: StepSeries, b: StepSeries, *, seed: int = 0, draws: int | None = None
) -> Comparison:
    """Compare run ``b`` with run ``a`` (A is the reference: ratios are B/A)."""
    kw: dict[str, Any] = {"seed": seed} if draws is None else {"seed": seed, "draws": draws}
    metrics = []
    for name in HEADLINE:
        va, vb = _values(a, name), _values(b, name)
        if not len(va) or not len(vb):
            ma = float(va.mean()) if len(va) else None
            mb = float(vb.mean()) if len(vb) else None
            metrics.append(MetricComparison(name, ma, mb, None))
            continue
        metrics.append(
            MetricComparison(name, float(va.mean()), float(vb.mean()), ratio_interval(va, vb, **kw))
        )
    where = _where(a, b)
    rough = min(len(a), len(b)) < MIN_STEPS
    head = next((m for m in metrics if m.interval is not None), None)
    fired_b = _fired(diagnose(b))
    fired_a = _fired(diagnose(a))
    new = [c for name, c in fired_b.items() if name not in fired_a]
    cause = new[0] if new else None
    verdict = _verdict(a.run, b.run, head, where, cause)
    return Comparison(a.run, b.run, metrics, where, _worst(b), verdict,
                      None if cause is None else cause.cause, rough)  # fmt: skip


def _verdict(
    run_a: str, run_b: str, head: MetricComparison | None, where: list[Where], cause: Any
) -> str:
    if head is None or head.interval is None:
        return f"no headline metric has values in both {run_a} and {run_b}: nothing to compare"
    iv = head.interval
    if not (math.isfinite(iv.lo) and math.isfinite(iv.hi)):
        size = "cannot be sized (A's mean is 0)"
        return f"{run_b}'s {head.metric} {size}"
    span = f"{fmt_ratio(iv.point)} {run_a}'s ({fmt_ratio(iv.lo)}–{fmt_ratio(iv.hi)})"
    if iv.lo > 1.0:
        text = f"{run_b}'s {head.metric} is {span}: worse"
    elif iv.hi < 1.0:
        text = f"{run_b}'s {head.metric} is {span}: better"
    else:
        return f"{run_b}'s {head.metric} is {span}: no clear difference"
    if iv.lo > 1.0:
        top = max(where, key=lambda w: w.ratio, default=None)
        if top is not None and math.isfinite(iv.point) and top.ratio >= CONCENTRATED * iv.point:
            text += f", concentrated at {top.label} ({fmt_ratio(top.ratio)})"
        if cause is not None:
            text += f"; {cause.cause}: {cause.action}"
    return text
