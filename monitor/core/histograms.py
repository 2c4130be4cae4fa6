"""Fixed histogram layouts shared by the engine, the exporter and the dashboards.

The fine |δ| histogram bins a float64 by its bits: the exponent picks the octave and the top
`SUB_BITS` mantissa bits pick one of 2**SUB_BITS linear sub-bins. Bin membership is therefore
exact (no log is evaluated), edges are exactly representable, and every bin spans at most
2**-SUB_BITS of its lower edge: with 7 bits, ≤ 0.78 % relative width, so a quantile read at the
bin's geometric centre is within ±0.39 %. The coarse Prometheus buckets are derived from the fine
bin index with a lookup table plus one comparison, so they too are exact `le` buckets.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

__all__ = [
    "ABS_LOG_RATIO_BUCKETS",
    "ESTR_SCORE_BUCKETS",
    "VERSION_LAG_BUCKETS",
    "HEATMAP_ABS_DELTA_EDGES",
    "HEATMAP_ENTROPY_EDGES",
    "FineLayout",
    "ABS_DELTA_LAYOUT",
    "ESTR_SCORE_LAYOUT",
    "ENTROPY_LAYOUT",
    "HEATMAP_ABS_DELTA_TABLE",
    "HEATMAP_ENTROPY_TABLE",
    "left_closed_table",
    "fine_quantile",
]

# Prometheus `le` edges (the +Inf bucket is implicit).
ABS_LOG_RATIO_BUCKETS: tuple[float, ...] = (
    1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0,
)  # fmt: skip
ESTR_SCORE_BUCKETS: tuple[float, ...] = (
    1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 0.5, 0.7, 1.0, 1.6, 2.0, 3.0, 5.0, 10.0, 30.0, 100.0,
)  # fmt: skip
# Policy-version lag (integer versions): every lag up to 4 has its own bucket, so the largest
# lag of a window is exact at the staleness alert's threshold (4) whichever replica saw it.
VERSION_LAG_BUCKETS: tuple[float, ...] = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0)
# The heatmap grid of docs/reference/metrics.md: left-closed bins, the last one open-ended.
HEATMAP_ENTROPY_EDGES: tuple[float, ...] = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
HEATMAP_ABS_DELTA_EDGES: tuple[float, ...] = (0.0, 1e-4, 1e-3, 1e-2, 0.1, 1.0)


class FineLayout:
    """Bit-sliced log histogram over [2**lo_exp, 2**hi_exp) with 2**sub_bits bins per octave.

    Index 0 holds zero and everything below the range, the last index everything above it.
    """

    def __init__(self, lo_exp: int, hi_exp: int, sub_bits: int, coarse: tuple[float, ...]):
        self.lo_exp = lo_exp
        self.hi_exp = hi_exp
        self.sub_bits = sub_bits
        self.per_octave = 1 << sub_bits
        self.bins = (hi_exp - lo_exp) * self.per_octave + 2
        self.biased_lo = 1023 + lo_exp
        self.coarse_edges = np.asarray(coarse, dtype=np.float64)
        self.coarse_table = self._coarse_table()

    def lower_edge(self, index: int) -> float:
        index = int(index)
        if index <= 0:
            return 0.0
        if index >= self.bins - 1:
            return math.ldexp(1.0, self.hi_exp)
        octave, sub = divmod(index - 1, self.per_octave)
        return math.ldexp(1.0 + sub / self.per_octave, self.lo_exp + octave)

    def upper_edge(self, index: int) -> float:
        index = int(index)
        if index >= self.bins - 1:
            return math.inf
        return (
            self.lower_edge(index + 1)
            if index + 1 < self.bins - 1
            else math.ldexp(1.0, self.hi_exp)
        )

    def index_of(self, x: float) -> int:
        """Pure-Python twin of the kernel's bit slicing (tests and documentation)."""
        if not x > 0.0:
            return 0
        bits = int(np.float64(x).view(np.uint64))
        e = bits >> 52
        if e < self.biased_lo:
            return 0
        if e >= self.biased_lo + (self.hi_exp - self.lo_exp):
            return self.bins - 1
        sub = (bits >> (52 - self.sub_bits)) & (self.per_octave - 1)
        return 1 + (e - self.biased_lo) * self.per_octave + sub

    def _coarse_table(self) -> npt.NDArray[np.int64]:
        """For each fine bin, the coarse bucket of its lower edge (count of edges below it)."""
        lows = np.array([self.lower_edge(i) for i in range(self.bins)])
        table = np.searchsorted(self.coarse_edges, lows, side="left").astype(np.int64)
        for i in range(self.bins - 1):  # at most one coarse edge may fall inside a fine bin
            inside = (self.coarse_edges > lows[i]) & (self.coarse_edges < self.upper_edge(i))
            assert inside.sum() <= 1, "fine bins must be narrower than coarse buckets"
        return table


def left_closed_table(layout: FineLayout, edges: tuple[float, ...]) -> npt.NDArray[np.int64]:
    """For each fine bin, the left-closed grid bin of its lower edge (edges start at 0).

    A value x in fine bin b then lies in grid bin T[b] or T[b] + 1 (if x ≥ edges[T[b] + 1]).
    """
    lows = np.array([layout.lower_edge(i) for i in range(layout.bins)])
    grid = np.asarray(edges, dtype=np.float64)
    for i in range(layout.bins - 1):
        inside = (grid > lows[i]) & (grid < layout.upper_edge(i))
        assert inside.sum() <= 1, "fine bins must be narrower than grid bins"
    return (np.searchsorted(grid, lows, side="right") - 1).astype(np.int64)


ABS_DELTA_LAYOUT = FineLayout(lo_exp=-40, hi_exp=12, sub_bits=7, coarse=ABS_LOG_RATIO_BUCKETS)
ESTR_SCORE_LAYOUT = FineLayout(lo_exp=-60, hi_exp=24, sub_bits=3, coarse=ESTR_SCORE_BUCKETS)
ENTROPY_LAYOUT = FineLayout(lo_exp=-30, hi_exp=10, sub_bits=3, coarse=())
HEATMAP_ABS_DELTA_TABLE = left_closed_table(ABS_DELTA_LAYOUT, HEATMAP_ABS_DELTA_EDGES)
HEATMAP_ENTROPY_TABLE = left_closed_table(ENTROPY_LAYOUT, HEATMAP_ENTROPY_EDGES)


def fine_quantile(
    counts: npt.NDArray[np.int64], q: float, layout: FineLayout = ABS_DELTA_LAYOUT
) -> float | None:
    """Nearest-rank quantile: the geometric centre of the bin holding rank ceil(q·N)."""
    total = int(counts.sum())
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    index = int(np.searchsorted(np.cumsum(counts), rank, side="left"))
    if index == 0:
        return 0.0
    lo, hi = layout.lower_edge(index), layout.upper_edge(index)
    if math.isinf(hi):
        return math.inf  # the overflow bin has no centre: callers clip to the observed max
    return math.sqrt(lo * hi)
