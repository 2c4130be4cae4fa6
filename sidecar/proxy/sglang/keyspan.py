"""Keys and their values found on the bytes of the compact JSON SGLang writes.

A key is found by its bytes ``"name":``. Inside a JSON string every ``"`` is escaped, so
``name":`` cannot occur in ``text`` or any other string: the match is the key itself. A value
holding only numbers, ``null`` and brackets (the log-prob lists when no token text is asked
for) ends at the first ``,"`` (next key) or ``}``; one with a string in it ends up unbalanced at
that cut and is refused (`NotFast`), so the caller takes the object path and nothing is
guessed. Used by `proxy.sglang.fastwire` (answers and stream chunks read and restored on their
bytes).
"""

from __future__ import annotations

import numpy as np

from ....monitor.core.errors import NotFast

__all__ = ["Hole", "value_span", "finished", "int_value"]

_LB, _RB, _COMMA = 91, 93, 44


def _u8(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


# The span of a value already read whole (by a compiled scanner, or by `value_span` with its
# check): no quote, so no key is inside it and key searches skip it; a value starting there
# is that value, not checked again.
Hole = tuple[int, int] | None


def _find(buf: bytes, pat: bytes, hole: Hole) -> int:
    if hole is None:
        return buf.find(pat)
    k = buf.find(pat, 0, hole[0])
    return k if k >= 0 else buf.find(pat, hole[1])


def value_span(
    buf: bytes, key: bytes, *, check: bool = True, hole: Hole = None
) -> tuple[int, int, int] | None:
    """``(key_start, value_start, value_end)`` of a quote-free value, None if the key is absent.

    With ``check``, raises `NotFast` if the value is not bracket-balanced (it held a string).
    ``hole``: a span known to hold no key (skipped by the search; the value if it starts there)."""
    pat = b'"' + key + b'":'
    k = _find(buf, pat, hole)
    if k < 0:
        return None
    v = k + len(pat)
    if hole is not None and v == hole[0]:
        after = buf[hole[1] : hole[1] + 2]
        if after == b',"' or after[:1] == b"}":
            return k, v, hole[1]
    quote, brace = buf.find(b'"', v), buf.find(b"}", v)
    if quote >= 0 and (brace < 0 or quote < brace):
        if buf[quote - 1] != _COMMA:
            raise NotFast(f"{key.decode()}: a string value")
        e = quote - 1
    elif brace >= 0:
        e = brace
    else:
        raise NotFast(f"{key.decode()}: no end")
    if check and e - v > 2:
        arr = _u8(buf)[v:e]
        if np.count_nonzero(arr == _LB) != np.count_nonzero(arr == _RB):
            raise NotFast(f"{key.decode()}: not a quote-free value")
    return k, v, e


def finished(frame: bytes) -> bool:
    """Whether a chunk is its sample's last (``finish_reason`` is not null)."""
    k = frame.find(b'"finish_reason":')
    if k < 0:
        raise NotFast("no finish_reason")
    c = frame[k + 16 : k + 17]
    if c == b"n":
        return False
    if c in (b"{", b'"'):
        return True
    raise NotFast("finish_reason not compact JSON")


def int_value(buf: bytes, key: bytes) -> int | None:
    span = value_span(buf, key, check=False)
    if span is None:
        return None
    try:
        return int(buf[span[1] : span[2]])
    except ValueError:
        raise NotFast(f"{key.decode()}: not an int") from None
