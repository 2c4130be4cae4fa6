"""The bootstrap of the ratio of two means (monitor/compare/bootstrap.py): a hand-computed case,
the exact bootstrap distribution enumerated in float64 for a small case, and its invariants."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timwatch.monitor.compare import ratio_interval


def test_hand_computed_interval() -> None:
    # a = [1, 3]: a resampled mean is 1, 2 or 3 with probability 1/4, 1/2, 1/4; b = [2] always
    # means 2. So B/A is 2, 1 or 2/3 with those probabilities: the 2.5 % and 97.5 % quantiles
    # are 2/3 and 2 (each tail holds a quarter of the draws, far more than 2.5 %), the point 1.
    iv = ratio_interval([1.0, 3.0], [2.0], seed=7)
    assert iv.point == 1.0
    assert iv.lo == pytest.approx(2 / 3, rel=1e-15)
    assert iv.hi == 2.0
    assert (iv.n_a, iv.n_b) == (2, 1)


def _exact_quantiles(a: list[float], b: list[float], q: float) -> tuple[float, float]:
    """Every equally likely resample pair enumerated: the q and 1-q quantiles of B*/A*."""
    ratios = sorted(
        float(np.mean(rb)) / float(np.mean(ra))
        for ra in itertools.product(a, repeat=len(a))
        for rb in itertools.product(b, repeat=len(b))
    )
    k = len(ratios)
    return ratios[math.floor(q * (k - 1))], ratios[math.ceil((1 - q) * (k - 1))]


def test_matches_the_enumerated_bootstrap_distribution() -> None:
    a, b = [1.0, 2.0, 4.0], [3.0, 5.0, 6.0, 11.0]
    iv = ratio_interval(a, b, draws=20000, seed=3)
    # the sampled 2.5 % quantile lies between the exact 1 % and 5 % quantiles (and the 97.5 %
    # one between the exact 95 % and 99 %): 20000 draws put it far inside that band
    lo_1, hi_99 = _exact_quantiles(a, b, 0.01)
    lo_5, hi_95 = _exact_quantiles(a, b, 0.05)
    assert lo_1 <= iv.lo <= lo_5
    assert hi_95 <= iv.hi <= hi_99
    assert iv.point == pytest.approx(np.mean(b) / np.mean(a), rel=1e-15)


def test_empty_or_zero_samples() -> None:
    assert math.isnan(ratio_interval([], [1.0]).point)
    zero = ratio_interval([0.0, 0.0], [1.0])
    assert zero.point == math.inf and zero.lo == math.inf
    both = ratio_interval([0.0], [0.0])
    assert math.isnan(both.point) and math.isnan(both.lo)
    # non-finite values (null steps) are left out
    assert ratio_interval([1.0, float("nan")], [2.0]).n_a == 1


samples = st.lists(
    st.floats(min_value=1e-6, max_value=1e3, allow_nan=False), min_size=1, max_size=12
)


@settings(max_examples=60, deadline=None)
@given(a=samples, b=samples, seed=st.integers(0, 2**32 - 1))
def test_invariants(a: list[float], b: list[float], seed: int) -> None:
    iv = ratio_interval(a, b, draws=400, seed=seed)
    assert iv.lo <= iv.point <= iv.hi
    assert iv == ratio_interval(a, b, draws=400, seed=seed)  # seeded: reproducible
    swapped = ratio_interval(b, a, draws=400, seed=seed)
    assert swapped.point == pytest.approx(1 / iv.point, rel=1e-12)
    assert swapped.lo == pytest.approx(1 / iv.hi, rel=1e-12)
    assert swapped.hi == pytest.approx(1 / iv.lo, rel=1e-12)
    scaled = ratio_interval(a, [3.0 * x for x in b], draws=400, seed=seed)
    assert scaled.point == pytest.approx(3 * iv.point, rel=1e-12)


@settings(max_examples=30, deadline=None)
@given(a=samples, seed=st.integers(0, 1000))
def test_a_run_against_itself_is_one(a: list[float], seed: int) -> None:
    iv = ratio_interval(a, a, draws=400, seed=seed)
    assert iv.point == pytest.approx(1.0, rel=1e-12)
    assert iv.lo <= 1.0 <= iv.hi
