"""`sig3` and `pct3`: three significant digits on hand-worked cases, the edge cases each
spelled out (zero of either sign, negative, NaN, ±inf, None)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from timwatch.monitor.core.numfmt import pct3, sig3


@pytest.mark.parametrize(
    ("x", "text"),
    [
        (0.17254273745832444, "0.173"),
        (1.0833333333333333, "1.08"),
        (12345.6, "1.23e+04"),
        (999.5, "1e+03"),  # rounds up into the next decade
        (123.0, "123"),
        (2.0, "2"),
        (0.000123456, "0.000123"),
        (1.23456e-7, "1.23e-07"),
        (-0.17254273745832444, "-0.173"),
        (-12345.6, "-1.23e+04"),
        (0.0, "0"),
        (-0.0, "0"),
        (math.nan, "nan"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (None, "n/a"),
        (3, "3"),
        (np.float32(0.17254273745832444), "0.173"),
    ],
)
def test_sig3(x: float | None, text: str) -> None:
    assert sig3(x) == text


@pytest.mark.parametrize(
    ("share", "text"),
    [(0.4234, "42.3%"), (0.031, "3.1%"), (1.0, "100%"), (0.0, "0%"), (None, "n/a")],
)
def test_pct3(share: float | None, text: str) -> None:
    assert pct3(share) == text
