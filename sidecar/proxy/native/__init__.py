"""The proxies' compiled reader (``_cstream.c``), when it was built, and its Python face.

``pip install`` compiles ``_cstream.c`` where a C compiler and Python's headers are found
(setup.py marks it optional: an install without them still succeeds). Where it is missing, or
``TIMWATCH_NATIVE=0`` is set, `cstream` answers None and the proxies read every frame and
answer whole with orjson instead (the object paths), which give the same records
(tests/unit/test_cstream.py). With ``TIMWATCH_NATIVE=1`` a missing build is an error at the
first call instead (CI sets it, so a build that failed cannot pass unnoticed as the fallback).

The wrappers here (`scan_deltas`, `triples`, `walk`) call the C module whether or not it is
switched on; callers ask `cstream` first.
"""

from __future__ import annotations

import os
import threading
from types import ModuleType

import numpy as np

__all__ = [
    "built",
    "cstream",
    "use_native",
    "scan_deltas",
    "triples",
    "walk",
    "member_values",
    "POW5",
]

try:
    from . import _cstream as _built  # type: ignore[attr-defined]
except ImportError:  # built without a compiler: the orjson fallback
    _built = None

_REQUIRED = os.environ.get("TIMWATCH_NATIVE", "") == "1"
_use: ModuleType | None = None if os.environ.get("TIMWATCH_NATIVE", "") == "0" else _built


def built() -> bool:
    """Whether the C module was compiled at install."""
    return _built is not None


def cstream() -> ModuleType | None:
    """The C module when it is built and switched on, else None (the orjson fallback runs)."""
    if _REQUIRED and _built is None:
        raise RuntimeError("TIMWATCH_NATIVE=1, but timwatch's C stream reader was not built")
    return _use


def use_native(on: bool) -> bool:
    """Switch the C code on (when built) or off in this process (tests, A/B measurements);
    returns whether it was on before."""
    global _use
    before = _use is not None
    _use = _built if on else None
    return before


Q_MIN, Q_MAX = -342, 308


def _pow5_table() -> np.ndarray:
    """``5**q`` for ``Q_MIN <= q <= Q_MAX`` as the top 128 bits of its binary expansion
    (``[high, low]`` words; truncated for ``q >= 0``, for ``q < 0`` one above the truncated
    reciprocal), as fast_float's table is generated: what ``csrc/numbers.h`` multiplies by."""
    out = np.empty((Q_MAX - Q_MIN + 1, 2), dtype=np.uint64)
    for q in range(Q_MIN, Q_MAX + 1):
        if q < 0:
            p5 = 5**-q
            z = p5.bit_length()
            if q >= -27:
                c = 2 ** (z + 127) // p5 + 1
            else:
                c = 2 ** (2 * z + 128) // p5 + 1
                while c >= 1 << 128:
                    c //= 2
        else:
            c = 5**q
            while c < 1 << 127:
                c *= 2
            while c >= 1 << 128:
                c //= 2
        out[q - Q_MIN, 0] = c >> 64
        out[q - Q_MIN, 1] = c & ((1 << 64) - 1)
    return out


POW5 = _pow5_table()

_SCRATCH = threading.local()


def _scratch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's arrays for a read of ``n`` bytes: room for the most rows and triples
    ``n`` bytes can hold, kept between reads (allocating them per read put a tenth of the
    proxy's profile in malloc); what a read returns is copied out of them."""
    kept = getattr(_SCRATCH, "arrays", None)
    if kept is None or kept[1].shape[0] < n // 10 + 1:
        m = max(n, 1 << 18)
        kept = (
            np.empty((m // 64 + 2, 7), dtype=np.int64),
            np.empty(m // 10 + 1, dtype=np.int64),
            np.empty(m // 10 + 1, dtype=np.float64),
        )
        _SCRATCH.arrays = kept
    return kept


def scan_deltas(
    buf: bytes | np.ndarray, small: int = 4096
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, bool]:
    """The run of one sample's small unfinished delta frames without top-k rows that a stream
    buffer starts with (``csrc/deltas.h``): ``(rows, consumed, ids, logps, stopped)``, one row
    per run of frames (start, end, kind 1, index 0, output_token_logprobs_length, count, at),
    the log-probs correctly rounded. ``stopped``: the complete frame at ``consumed`` is not
    such a delta; ``consumed`` -1: nothing taken (a frame read does not prove it holds only
    the keys it was read by)."""
    n = len(buf)
    rows, ids, vals = _scratch(n)
    assert _built is not None
    r, used, count, stopped = _built.scan_deltas(buf, small, rows, ids, vals, POW5)
    if used < 0:
        return rows[:0].copy(), -1, ids[:0].copy(), vals[:0].copy(), False
    return rows[:r].copy(), used, ids[:count].copy(), vals[:count].copy(), stopped


def triples(buf: bytes, pos: int) -> tuple[int, int, np.ndarray, np.ndarray]:
    """``(count, end, ids, logps)`` of the ``[[logprob,id,null],...]`` list at ``buf[pos]``
    (``csrc/numbers.h``: every log-prob the double orjson gives); count -1: refused."""
    cap = (len(buf) - pos) // 10 + 1
    ids = np.empty(cap, dtype=np.int64)
    vals = np.empty(cap, dtype=np.float64)
    assert _built is not None
    count, end = _built.triples(buf, pos, ids, vals, POW5)
    if count < 0:
        return -1, end, ids[:0], vals[:0]
    return count, end, ids[:count], vals[:count]


def walk(buf: bytes, max_depth: int, max_array_depth: int) -> np.ndarray:
    """Every value of the JSON object ``buf`` down to ``max_depth`` (objects) and
    ``max_array_depth`` (arrays), in one pass (``csrc/jsonwalk.h``). One row per value, seven
    columns: its container's row (-1 for the root), its depth (root 0), its key's span without
    quotes (-1 in an array), its own span, its position in its container. Empty when ``buf``
    is not one JSON object."""
    assert _built is not None
    size = 64
    while True:
        rows = np.empty((size, 7), dtype=np.int64)
        r = _built.walk(buf, max_depth, max_array_depth, rows)
        if r != -2:
            return rows[: max(r, 0)]
        size *= 8


def member_values(buf: bytes, pos: int, key: bytes) -> tuple[int, bytes]:
    """``(count, json)``: each object's value of member ``key`` in the array of objects at
    ``buf[pos]``, copied verbatim into one JSON list (``csrc/jsonwalk.h``); count -1: not an
    array of objects that all have that member with a scalar value."""
    assert _built is not None
    count, text = _built.member_values(buf, pos, key)
    return int(count), text
