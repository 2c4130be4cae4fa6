"""What a diagnosis rule answers: a `Finding` (a cause with its score, verdict, action and
evidence) or `NotChecked` (why the input it needs is missing). Plain data with ``to_dict``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Evidence", "Finding", "NotChecked", "clean", "ramp", "ramp_log"]


def clean(x: float | None) -> float | None:
    """``x`` as a JSON-safe float: None for None, NaN or ±inf."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def ramp(x: float | None, lo: float, hi: float) -> float:
    """0 at or below ``lo``, 1 at or above ``hi``, linear between; 0 for None/NaN."""
    if x is None or not math.isfinite(x):
        return 0.0
    if x <= lo:
        return 0.0
    if x >= hi:
        return 1.0
    return (x - lo) / (hi - lo)


def ramp_log(x: float | None, lo: float, hi: float) -> float:
    """`ramp` on a log scale (``lo``, ``hi`` > 0): for KLs and ratios spanning decades."""
    if x is None or not math.isfinite(x) or x <= 0:
        return 0.0
    return ramp(math.log(x), math.log(lo), math.log(hi))


@dataclass(frozen=True)
class Evidence:
    """One number behind a verdict: ``metric`` over ``steps`` = [first, last], its ``value``
    (a mean over the window unless ``detail`` says otherwise) and ``trend`` (late/early)."""

    metric: str
    steps: tuple[int | None, int | None]
    value: float | None
    trend: float | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "steps": list(self.steps),
            "value": clean(self.value),
            "trend": clean(self.trend),
            "detail": self.detail,
        }


@dataclass(frozen=True)
class Finding:
    """A checked cause; ``score`` in [0, 1] (0: the pattern is absent)."""

    cause: str
    score: float
    verdict: str
    action: str
    evidence: list[Evidence] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        score = clean(self.score) or 0.0
        return {
            "cause": self.cause,
            "score": round(min(1.0, max(0.0, score)), 4),
            "verdict": self.verdict,
            "action": self.action,
            "evidence": [e.to_dict() for e in self.evidence],
        }


@dataclass(frozen=True)
class NotChecked:
    """A cause that could not be checked: ``reason`` names the missing input."""

    cause: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "reason": self.reason}
