"""A percentile bootstrap of the ratio of two means, with a seeded RNG.

`ratio_interval(a, b)` resamples ``a`` and ``b`` independently (with replacement, each to its own
size) ``draws`` times and takes the ``(1 − level)/2`` and ``(1 + level)/2`` quantiles of
``mean(b*) / mean(a*)``. Invariants (tests/unit/test_compare_bootstrap.py): the same seed gives
the same interval; ``lo ≤ point ≤ hi`` whenever both quantiles are finite (the point estimate,
``mean(b) / mean(a)``, is clamped into the interval, as a percentile interval can miss it by a
hair on skewed samples); swapping ``a`` and ``b`` inverts the point and the interval exactly
(``lo(b, a) = 1/hi(a, b)``): the two samples draw their resamples in an order fixed by their
content, not by their argument position (a sample compared with itself counts both orders),
and the quantiles are symmetric order statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DRAWS", "LEVEL", "Interval", "ratio_interval"]

DRAWS = 2000
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """``point`` = mean(b)/mean(a); ``lo``/``hi`` the bootstrap quantiles (inf when a resampled
    mean of ``a`` is 0; nan when a sample is empty)."""

    point: float
    lo: float
    hi: float
    n_a: int
    n_b: int

    def to_dict(self) -> dict[str, Any]:
        return {"ratio": self.point, "lo": self.lo, "hi": self.hi, "n_a": self.n_a, "n_b": self.n_b}


def _ratio(num: float, den: float) -> float:
    if den == 0.0:
        return math.nan if num == 0.0 else math.inf
    return num / den


def resample_means(x: np.ndarray[Any, Any], draws: int, rng: np.random.Generator) -> np.ndarray:
    """``draws`` means of ``x`` resampled with replacement to its own size."""
    idx = rng.integers(0, len(x), size=(draws, len(x)))
    return np.asarray(x, dtype=np.float64)[idx].mean(axis=1)


def ratio_interval(
    a: Any, b: Any, *, draws: int = DRAWS, level: float = LEVEL, seed: int = 0
) -> Interval:
    """The ratio mean(b)/mean(a) and its percentile bootstrap interval (see the module)."""
    xa = np.asarray(a, dtype=np.float64)
    xb = np.asarray(b, dtype=np.float64)
    xa, xb = xa[np.isfinite(xa)], xb[np.isfinite(xb)]
    if not len(xa) or not len(xb):
        return Interval(math.nan, math.nan, math.nan, len(xa), len(xb))
    point = _ratio(float(xb.mean()), float(xa.mean()))
    rng = np.random.default_rng(seed)
    if (len(xa), xa.tobytes()) <= (len(xb), xb.tobytes()):
        ma = resample_means(xa, draws, rng)
        mb = resample_means(xb, draws, rng)
    else:
        mb = resample_means(xb, draws, rng)
        ma = resample_means(xa, draws, rng)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(ma == 0.0, np.where(mb == 0.0, np.nan, np.inf), mb / ma)
    if len(xa) == len(xb) and xa.tobytes() == xb.tobytes():
        # the same sample twice: which one drew first is arbitrary, so both orders count
        with np.errstate(divide="ignore", invalid="ignore"):
            inverse = np.where(mb == 0.0, np.where(ma == 0.0, np.nan, np.inf), ma / mb)
        ratios = np.concatenate([ratios, inverse])
    ratios = ratios[~np.isnan(ratios)]
    if not len(ratios):
        return Interval(point, math.nan, math.nan, len(xa), len(xb))
    ratios.sort()
    k = int(math.floor((1.0 - level) / 2.0 * (len(ratios) - 1)))
    lo, hi = float(ratios[k]), float(ratios[len(ratios) - 1 - k])
    if math.isfinite(point):
        lo, hi = min(lo, point), max(hi, point)
    return Interval(point, lo, hi, len(xa), len(xb))
