"""The gate: a candidate run against a `Baseline`, metric by metric.

A metric passes when the candidate's mean over its steps is at most

    limit = bound + Z · √(sd₀²/n₀ + sd_b²/n₁ + s_r² (1 + 1/R)),
    bound = max(mean₀ · max_ratio, mean₀ + max_abs)

where mean₀, sd₀, n₀ are the baseline's mean, step-to-step standard deviation and step count,
n₁ the candidate's step count, and s_r the standard deviation of the means of the baseline's R
runs (0 for a baseline of one run): the bound the baseline file sets, plus a tolerance of `Z`
standard errors of the difference of the two means, so that step-to-step noise alone, and with
several baseline runs the run-to-run spread they show, does not fail a run (every gated metric
is a mismatch: lower is better, only the upper side is gated).

The candidate's standard error is the one it would have at the bound: sd_b is the baseline's
step sd scaled to the bound, sd₀ · max_ratio where the ratio sets the bound and sd₀ where the
absolute allowance does (a control chart's limits, set by the in-control runs), never the
candidate's own sd. A candidate's own sd grows with its level, so with it any run whose steps
vary by more than √n₁/Z of their mean would pass however far above the bound it is (a bf16
engine at 10⁹× an fp32 baseline did, over 6 steps). Only where the baseline shows no step
variance at all (sd₀ = 0, e.g. a mask ratio that stayed 0) is the candidate's own sd used, as
there is no scale to take from the baseline. The gate passes when every metric passes. Errors
(`InputError`, exit 2 in the CLI): a candidate with no steps, a gated metric the candidate has
no value of, a baseline for another model or engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.errors import InputError
from ..diagnosis import StepSeries
from ..diagnosis.series import SERIES_COLUMNS
from .baseline import MAX_ABS, MAX_RATIO, Baseline, MetricBaseline
from .comparison import HEADLINE

__all__ = ["Z", "Check", "GateResult", "check_metrics", "gate", "make_baseline"]

#: standard errors of the difference of the means allowed on top of the bound
Z = 3.0


@dataclass(frozen=True)
class Check:
    metric: str
    baseline: MetricBaseline
    mean: float
    sd: float
    n: int

    @property
    def null_sd(self) -> float:
        """The step sd taken for the candidate: the baseline's, scaled to the bound (the
        candidate's own where the baseline has none)."""
        b = self.baseline
        if b.sd == 0:
            return self.sd
        return b.sd * (b.max_ratio if b.mean * b.max_ratio >= b.mean + b.max_abs else 1.0)

    @property
    def noise(self) -> float:
        b = self.baseline
        spread = b.run_sd**2 * (1 + 1 / b.runs)
        return Z * math.sqrt(b.sd**2 / b.n + self.null_sd**2 / self.n + spread)

    @property
    def bound(self) -> float:
        b = self.baseline
        return max(b.mean * b.max_ratio, b.mean + b.max_abs)

    @property
    def limit(self) -> float:
        return self.bound + self.noise

    @property
    def passed(self) -> bool:
        return self.mean <= self.limit

    @property
    def ratio(self) -> float | None:
        return self.mean / self.baseline.mean if self.baseline.mean > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric, "passed": self.passed, "candidate": self.mean,
            "baseline": self.baseline.mean, "ratio": self.ratio, "limit": self.limit,
            "bound": self.bound, "noise": self.noise, "steps": self.n, "sd": self.sd,
            "null_sd": self.null_sd,
            "max_ratio": self.baseline.max_ratio, "max_abs": self.baseline.max_abs,
            "baseline_runs": self.baseline.runs, "run_sd": self.baseline.run_sd,
        }  # fmt: skip


@dataclass(frozen=True)
class GateResult:
    run: str
    baseline: Baseline
    checks: list[Check]
    steps: tuple[int, int]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run, "passed": self.passed, "model": self.baseline.model,
            "engine": self.baseline.engine, "baseline_run": self.baseline.run,
            "steps": list(self.steps), "checks": [c.to_dict() for c in self.checks],
        }  # fmt: skip


def check_metrics(names: Sequence[str]) -> list[str]:
    """The names, each a column the gate can read; `InputError` names an unknown one."""
    for n in names:
        if n not in SERIES_COLUMNS:
            raise InputError("metric", f"unknown metric {n!r}; known: {', '.join(SERIES_COLUMNS)}")
    return list(names)


def _values(series: StepSeries, name: str) -> np.ndarray[Any, Any]:
    if not len(series):
        raise InputError("steps", f"run {series.run!r} has no steps in the range asked")
    v = series.col(name)
    v = v[np.isfinite(v)]
    if not len(v):
        raise InputError("metric", f"run {series.run!r} has no value of {name!r}")
    return v


def _span(series: StepSeries) -> tuple[int, int]:
    first, last = series.span()
    assert first is not None and last is not None
    return first, last


def make_baseline(
    series: StepSeries | Sequence[StepSeries], *, model: str, engine: str,
    metrics: Sequence[str] | None = None, max_ratio: float = MAX_RATIO, max_abs: float = MAX_ABS,
) -> Baseline:  # fmt: skip
    """A baseline from one run or several runs of the same settings: the given metrics, or
    every `HEADLINE` metric the first run has (each run needs a value of each)."""
    runs = [series] if isinstance(series, StepSeries) else list(series)
    for s in runs:
        if not len(s):
            raise InputError("steps", f"run {s.run!r} has no steps in the range asked")
    first = runs[0]
    names = check_metrics(metrics) if metrics else [n for n in HEADLINE if first.has(n)]
    if not names:
        raise InputError("metric", f"run {first.run!r} has no value of {', '.join(HEADLINE)}")
    out = {
        n: MetricBaseline.of_runs([_values(s, n) for s in runs], max_ratio, max_abs) for n in names
    }
    spans = [_span(s) for s in runs]
    steps = (min(a for a, _ in spans), max(b for _, b in spans))
    return Baseline(model, engine, ", ".join(s.run for s in runs), steps, out)


def gate(
    series: StepSeries, baseline: Baseline, *, model: str | None = None,
    engine: str | None = None,
) -> GateResult:  # fmt: skip
    """Check ``series`` against ``baseline`` (see the module)."""
    baseline.check_identity(model, engine)
    checks = []
    for name, b in baseline.metrics.items():
        v = _values(series, name)
        sd = float(v.std(ddof=1)) if len(v) > 1 else 0.0
        checks.append(Check(name, b, float(v.mean()), sd, int(len(v))))
    return GateResult(series.run, baseline, checks, _span(series))
