"""Compiled structural walks over JSON bytes: where each value starts and ends, nothing parsed.

The vLLM proxy reads and edits vLLM's answers on their bytes (`proxy.vllm.edit`): it needs the
span of a member (``"logprobs": {...}``) to cut it or read it, not Python objects for every
token. These functions follow JSON's grammar exactly for structure (strings with their escapes,
nested objects and arrays) and only skip over scalars, so a span is always a whole value; a
malformed document gives ``-1`` and the caller falls back to a full parse.

* `skip_value` — the end of the value at ``i``;
* `walk` — every value down to a depth, with its key, span and container, in one pass;
* `member_numbers` — for an array of objects (chat's ``logprobs.content``), the number held by
  one key in each, copied into one flat JSON list that orjson reads at once.
"""

from __future__ import annotations

import numba as nb
import numpy as np

__all__ = ["skip_value", "walk", "member_numbers", "u8"]

_QUOTE, _BSLASH, _LB, _RB, _LC, _RC, _COMMA, _COLON = 34, 92, 91, 93, 123, 125, 44, 58


def u8(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


@nb.njit(cache=True, nogil=True, inline="always")
def _ws(buf: np.ndarray, i: int) -> int:
    n = buf.shape[0]
    while i < n and (buf[i] == 32 or buf[i] == 10 or buf[i] == 13 or buf[i] == 9):
        i += 1
    return i


@nb.njit(cache=True, nogil=True)
def _string_end(buf: np.ndarray, i: int) -> int:
    """``buf[i]`` is an opening quote; the index after the closing one, -1 if unterminated."""
    n = buf.shape[0]
    i += 1
    while i < n:
        c = buf[i]
        if c == _BSLASH:
            i += 2
            continue
        if c == _QUOTE:
            return i + 1
        i += 1
    return -1


@nb.njit(cache=True, nogil=True)
def skip_value(buf: np.ndarray, i: int) -> int:
    """The index just after the JSON value starting at ``buf[i]`` (no leading space), -1 if it
    is not a whole value."""
    n = buf.shape[0]
    if i >= n:
        return -1
    c = buf[i]
    if c == _QUOTE:
        return _string_end(buf, i)
    if c != _LB and c != _LC:
        # scalar: a number, true, false, null; ends at a delimiter
        j = i
        while j < n:
            d = buf[j]
            if d == _COMMA or d == _RB or d == _RC or d == 32 or d == 10 or d == 13 or d == 9:
                break
            if d == _QUOTE or d == _LB or d == _LC or d == _COLON:
                return -1
            j += 1
        return j if j > i else -1
    depth = 0
    j = i
    while j < n:
        d = buf[j]
        if d == _QUOTE:
            j = _string_end(buf, j)
            if j < 0:
                return -1
            continue
        if d == _LB or d == _LC:
            depth += 1
        elif d == _RB or d == _RC:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return -1


#: Columns of `walk`'s rows.
PARENT, DEPTH, KEY_START, KEY_END, VALUE_START, VALUE_END, INDEX = range(7)
_OBJ, _ARR = 0, 1


@nb.njit(cache=True, nogil=True, _nrt=False)
def _walk_into(  # noqa: C901
    buf: np.ndarray,
    max_depth: int,
    max_array_depth: int,
    rows: np.ndarray,
    st_row: np.ndarray,
    st_kind: np.ndarray,
    st_count: np.ndarray,
) -> int:
    """`walk` into ``rows``: how many rows, -1 when the bytes are not one JSON object, -2 when
    ``rows`` is too short (the caller walks again with a longer one)."""
    n = buf.shape[0]
    i = _ws(buf, 0)
    if i >= n or buf[i] != _LC:
        return -1
    rows[0, 0], rows[0, 1], rows[0, 2], rows[0, 3] = -1, 0, -1, -1
    rows[0, 4], rows[0, 5], rows[0, 6] = i, -1, 0
    r = 1
    st_row[0], st_kind[0], st_count[0] = 0, _OBJ, 0
    sp = 1
    i = _ws(buf, i + 1)
    while sp > 0:
        if i >= n:
            return -1
        c = buf[i]
        kind = st_kind[sp - 1]
        if (kind == _OBJ and c == _RC) or (kind == _ARR and c == _RB):
            rows[st_row[sp - 1], 5] = i + 1
            sp -= 1
            i = _ws(buf, i + 1)
            if sp == 0:
                return r if i == n else -1
            if i < n and buf[i] == _COMMA:
                i = _ws(buf, i + 1)
            continue
        ks = ke = -1
        v = i
        if kind == _OBJ:
            if c != _QUOTE:
                return -1
            k_end = _string_end(buf, i)
            if k_end < 0:
                return -1
            ks, ke = i + 1, k_end - 1
            j = _ws(buf, k_end)
            if j >= n or buf[j] != _COLON:
                return -1
            v = _ws(buf, j + 1)
        if r == rows.shape[0]:
            return -2
        row = r
        r += 1
        rows[row, 0], rows[row, 1], rows[row, 2], rows[row, 3] = st_row[sp - 1], sp, ks, ke
        rows[row, 4], rows[row, 5], rows[row, 6] = v, -1, st_count[sp - 1]
        st_count[sp - 1] += 1
        d = buf[v] if v < n else 0
        if (d == _LC and sp < max_depth) or (d == _LB and sp < max_array_depth):
            st_row[sp], st_kind[sp], st_count[sp] = row, _OBJ if d == _LC else _ARR, 0
            sp += 1
            i = _ws(buf, v + 1)
            continue
        e = skip_value(buf, v)
        if e < 0:
            return -1
        rows[row, 5] = e
        i = _ws(buf, e)
        if i < n and buf[i] == _COMMA:
            i = _ws(buf, i + 1)
        elif i >= n or (buf[i] != _RC and buf[i] != _RB):
            return -1
    return -1


@nb.njit(cache=True, nogil=True)
def walk(buf: np.ndarray, max_depth: int, max_array_depth: int) -> np.ndarray:
    """Every value of the document at ``buf[0]`` down to ``max_depth``, in one pass.

    One row per value (columns ``PARENT`` … ``INDEX``): the row of its container (-1 for the
    root), its depth (root 0), its key's span without quotes (-1 in an array), its own span, and
    its position in its container. Objects deeper than ``max_depth`` and arrays deeper than
    ``max_array_depth`` are skipped whole (their items get no rows).
    Returns an empty array when the bytes are not one JSON object."""
    st_row = np.empty(max_depth + 2, dtype=np.int64)
    st_kind = np.empty(max_depth + 2, dtype=np.int64)
    st_count = np.empty(max_depth + 2, dtype=np.int64)
    size = 64
    while True:
        rows = np.empty((size, 7), dtype=np.int64)
        r = _walk_into(buf, max_depth, max_array_depth, rows, st_row, st_kind, st_count)
        if r != -2:
            return rows[: max(r, 0)]
        size *= 4


@nb.njit(cache=True, nogil=True)
def member_numbers(buf: np.ndarray, i: int, key: np.ndarray) -> tuple[int, np.ndarray]:
    """For the array of objects at ``buf[i]``: ``(count, json)`` where ``json`` is
    ``[v0,v1,...]`` holding, in order, each object's value of member ``key`` (bytes, no
    quotes) copied verbatim. count -1: not an array of objects that all have that member
    with a scalar value."""
    out = np.empty(buf.shape[0] - i + 2, dtype=np.uint8)
    count, length = _member_numbers_into(buf, i, key, out)
    return count, out[:length]


@nb.njit(cache=True, nogil=True, _nrt=False)
def _member_numbers_into(  # noqa: C901
    buf: np.ndarray, i: int, key: np.ndarray, out: np.ndarray
) -> tuple[int, int]:
    """`member_numbers` into ``out``: ``(count, length of the JSON in out)``."""
    n = buf.shape[0]
    out[0] = _LB
    f = 1
    count = 0
    m = key.shape[0]
    if i >= n or buf[i] != _LB:
        return -1, 0
    i = _ws(buf, i + 1)
    if i < n and buf[i] == _RB:
        out[1] = _RB
        return 0, 2
    while True:
        if i >= n or buf[i] != _LC:
            return -1, 0
        found = False
        j = _ws(buf, i + 1)
        while True:
            if j >= n or buf[j] != _QUOTE:
                return -1, 0
            k_end = _string_end(buf, j)
            if k_end < 0:
                return -1, 0
            c = _ws(buf, k_end)
            if c >= n or buf[c] != _COLON:
                return -1, 0
            v = _ws(buf, c + 1)
            e = skip_value(buf, v)
            if e < 0:
                return -1, 0
            if not found and k_end - 1 - (j + 1) == m:
                same = True
                for t in range(m):
                    if buf[j + 1 + t] != key[t]:
                        same = False
                        break
                if same:
                    d = buf[v]
                    if d == _QUOTE or d == _LB or d == _LC:
                        return -1, 0
                    for t in range(v, e):
                        out[f] = buf[t]
                        f += 1
                    out[f] = _COMMA
                    f += 1
                    found = True
            j = _ws(buf, e)
            if j < n and buf[j] == _COMMA:
                j = _ws(buf, j + 1)
            elif j < n and buf[j] == _RC:
                break
            else:
                return -1, 0
        if not found:
            return -1, 0
        count += 1
        i = _ws(buf, j + 1)
        if i < n and buf[i] == _COMMA:
            i = _ws(buf, i + 1)
        elif i < n and buf[i] == _RB:
            if f == 1:
                out[1] = _RB
                return count, 2
            out[f - 1] = _RB
            return count, f
        else:
            return -1, 0
