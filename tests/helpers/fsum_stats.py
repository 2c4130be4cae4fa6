"""Plain float64 statistics for the test oracles, on Python floats with `math.fsum` (so they
share nothing with the engine's numba and numpy code)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["mean", "pearson"]


def mean(xs: Sequence[float]) -> float | None:
    """The mean, or None for no values."""
    return math.fsum(xs) / len(xs) if xs else None


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson's r; None for fewer than two values or a constant side."""
    if len(xs) < 2:
        return None
    mx, my = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    cov = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    vx = math.fsum((x - mx) ** 2 for x in xs)
    vy = math.fsum((y - my) ** 2 for y in ys)
    if vx == 0.0 or vy == 0.0:
        return None
    return cov / math.sqrt(vx * vy)
