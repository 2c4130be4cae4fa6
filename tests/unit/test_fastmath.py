"""The kernel's branch-free math against numpy's libm and the histogram's Python twin."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from timwatch.monitor.core.fastmath import exp, fine_index, from_order_key, log, order_key
from timwatch.monitor.core.histograms import ABS_DELTA_LAYOUT, ENTROPY_LAYOUT, ESTR_SCORE_LAYOUT


@njit
def _exp_all(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = exp(x[i])
    return out


@njit
def _log_all(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = log(x[i])
    return out


@njit
def _keys(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keys = np.empty(x.shape[0], dtype=np.int64)
    back = np.empty_like(x)
    for i in range(x.shape[0]):
        keys[i] = order_key(x[i])
        back[i] = from_order_key(keys[i])
    return keys, back


@njit
def _bins(x: np.ndarray, lo: int, octaves: int, sub: int, last: int) -> np.ndarray:
    out = np.empty(x.shape[0], dtype=np.int64)
    for i in range(x.shape[0]):
        out[i] = fine_index(x[i], lo, octaves, sub, last)
    return out


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(got - want) / np.spacing(np.abs(want))


def test_exp_within_two_ulp() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [rng.uniform(-700, 700, 200_000), rng.normal(0, 1e-3, 50_000), [0.0, -20.0, 20.0, 1.0]]
    )
    assert _ulps(_exp_all(x), np.exp(x)).max() <= 2.0
    assert _exp_all(np.array([-1e6, 1e6])).tolist() == [math.exp(-700.0), math.exp(700.0)]


def test_log_within_two_ulp_and_accurate_near_one() -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate(
        [np.exp(rng.uniform(-700, 700, 200_000)), 1 + rng.normal(0, 1e-9, 50_000), [1.0, 2.0]]
    )
    want = np.log(x)
    got = _log_all(x)
    nz = want != 0
    assert _ulps(got[nz], want[nz]).max() <= 2.0
    assert np.all(got[~nz] == 0.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=True), min_size=2, max_size=50))
def test_order_keys_sort_like_floats_and_invert(values: list[float]) -> None:
    x = np.array(values, dtype=np.float64)
    keys, back = _keys(x)
    assert np.array_equal(back.view(np.int64), x.view(np.int64))  # an exact inverse
    order = np.argsort(keys, kind="stable")
    assert np.array_equal(x[order], np.sort(x))


def test_fine_index_matches_python_twin() -> None:
    rng = np.random.default_rng(2)
    for layout in (ABS_DELTA_LAYOUT, ESTR_SCORE_LAYOUT, ENTROPY_LAYOUT):
        x = np.concatenate(
            [
                [0.0, 5e-324, 2.0**layout.lo_exp, 2.0**layout.hi_exp, 1e300],
                np.exp(rng.uniform(-80, 40, 20_000)),
            ]
        )
        got = _bins(x, layout.biased_lo, layout.hi_exp - layout.lo_exp, layout.sub_bits,
                    layout.bins - 1)  # fmt: skip
        want = np.array([layout.index_of(v) for v in x])
        assert np.array_equal(got, want)
        inside = (got > 0) & (got < layout.bins - 1)
        lows = np.array([layout.lower_edge(i) for i in got[inside]])
        highs = np.array([layout.upper_edge(i) for i in got[inside]])
        assert np.all((lows <= x[inside]) & (x[inside] < highs))
