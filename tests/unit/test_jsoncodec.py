"""`jsoncodec` keeps every row JSON-safe: non-finite floats (Python, numpy scalars, numpy array
elements) become ``null``, numpy values and non-string keys encode, and a round trip keeps the
finite values."""

from __future__ import annotations

import math

import numpy as np

from timwatch.monitor.core.jsoncodec import dumps, dumps_str, loads


def test_non_finite_values_encode_as_null() -> None:
    obj = {
        "py": [math.nan, math.inf, -math.inf],
        "np_scalar": np.float64("nan"),
        "np_array": np.array([1.5, np.inf, -np.inf, np.nan], dtype=np.float32),
    }
    assert loads(dumps(obj)) == {
        "py": [None, None, None],
        "np_scalar": None,
        "np_array": [1.5, None, None, None],
    }


def test_numpy_values_and_integer_keys() -> None:
    obj = {1: np.int64(3), "arr": np.arange(3, dtype=np.int32), "f": np.float32(0.25)}
    assert dumps_str(obj) == '{"1":3,"arr":[0,1,2],"f":0.25}'
    assert loads(dumps_str(obj).encode()) == {"1": 3, "arr": [0, 1, 2], "f": 0.25}
