"""Compiled structural walks over JSON bytes: where each value starts and ends, nothing parsed.

The vLLM proxy reads and edits vLLM's answers on their bytes (`proxy.vllm_edit`): it needs the
span of a member (``"logprobs": {...}``) to cut it or read it, not Python objects for every
token. These functions follow JSON's grammar exactly for structure (strings with their escapes,
nested objects and arrays) and only skip over scalars, so a span is always a whole value; a
malformed document gives ``-1`` and the caller falls back to a full parse.

* `skip_value` — the end of the value at ``i``;
* `object_members` — ``(key_start, key_end, value_start, value_end)`` per member of an object
  (key spans exclude the quotes);
* `array_items` — ``(start, end)`` per item of an array;
* `member_numbers` — for an array of objects (chat's ``logprobs.content``), the number held by
  one key in each, copied into one flat JSON list that orjson reads at once.
"""

from __future__ import annotations

import numba as nb
import numpy as np

__all__ = ["skip_value", "object_members", "array_items", "member_numbers", "u8"]

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


@nb.njit(cache=True, nogil=True)
def object_members(buf: np.ndarray, i: int) -> np.ndarray:
    """Rows ``(key_start, key_end, value_start, value_end)`` of the object at ``buf[i]``; a
    single row of -1 if it is not an object."""
    bad = np.full((1, 4), -1, dtype=np.int64)
    n = buf.shape[0]
    if i >= n or buf[i] != _LC:
        return bad
    rows = np.empty((16, 4), dtype=np.int64)
    r = 0
    i = _ws(buf, i + 1)
    if i < n and buf[i] == _RC:
        return rows[:0]
    while True:
        if i >= n or buf[i] != _QUOTE:
            return bad
        k_end = _string_end(buf, i)
        if k_end < 0:
            return bad
        j = _ws(buf, k_end)
        if j >= n or buf[j] != _COLON:
            return bad
        v = _ws(buf, j + 1)
        e = skip_value(buf, v)
        if e < 0:
            return bad
        if r == rows.shape[0]:
            bigger = np.empty((2 * r, 4), dtype=np.int64)
            bigger[:r] = rows
            rows = bigger
        rows[r, 0], rows[r, 1], rows[r, 2], rows[r, 3] = i + 1, k_end - 1, v, e
        r += 1
        i = _ws(buf, e)
        if i < n and buf[i] == _COMMA:
            i = _ws(buf, i + 1)
        elif i < n and buf[i] == _RC:
            return rows[:r]
        else:
            return bad


@nb.njit(cache=True, nogil=True)
def array_items(buf: np.ndarray, i: int) -> np.ndarray:
    """Rows ``(start, end)`` of the items of the array at ``buf[i]``; one row of -1 if it is
    not an array."""
    bad = np.full((1, 2), -1, dtype=np.int64)
    n = buf.shape[0]
    if i >= n or buf[i] != _LB:
        return bad
    rows = np.empty((16, 2), dtype=np.int64)
    r = 0
    i = _ws(buf, i + 1)
    if i < n and buf[i] == _RB:
        return rows[:0]
    while True:
        e = skip_value(buf, i)
        if e < 0:
            return bad
        if r == rows.shape[0]:
            bigger = np.empty((2 * r, 2), dtype=np.int64)
            bigger[:r] = rows
            rows = bigger
        rows[r, 0], rows[r, 1] = i, e
        r += 1
        i = _ws(buf, e)
        if i < n and buf[i] == _COMMA:
            i = _ws(buf, i + 1)
        elif i < n and buf[i] == _RB:
            return rows[:r]
        else:
            return bad


@nb.njit(cache=True, nogil=True)
def member_numbers(buf: np.ndarray, i: int, key: np.ndarray) -> tuple[int, np.ndarray]:
    """For the array of objects at ``buf[i]``: ``(count, json)`` where ``json`` is
    ``[v0,v1,...]`` holding, in order, each object's value of member ``key`` (bytes, no
    quotes) copied verbatim. count -1: not an array of objects that all have that member
    with a scalar value."""
    n = buf.shape[0]
    out = np.empty(n - i + 2, dtype=np.uint8)
    out[0] = _LB
    f = 1
    count = 0
    m = key.shape[0]
    if i >= n or buf[i] != _LB:
        return -1, out[:0]
    i = _ws(buf, i + 1)
    if i < n and buf[i] == _RB:
        out[1] = _RB
        return 0, out[:2]
    while True:
        if i >= n or buf[i] != _LC:
            return -1, out[:0]
        found = False
        j = _ws(buf, i + 1)
        while True:
            if j >= n or buf[j] != _QUOTE:
                return -1, out[:0]
            k_end = _string_end(buf, j)
            if k_end < 0:
                return -1, out[:0]
            c = _ws(buf, k_end)
            if c >= n or buf[c] != _COLON:
                return -1, out[:0]
            v = _ws(buf, c + 1)
            e = skip_value(buf, v)
            if e < 0:
                return -1, out[:0]
            if not found and k_end - 1 - (j + 1) == m:
                same = True
                for t in range(m):
                    if buf[j + 1 + t] != key[t]:
                        same = False
                        break
                if same:
                    d = buf[v]
                    if d == _QUOTE or d == _LB or d == _LC:
                        return -1, out[:0]
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
                return -1, out[:0]
        if not found:
            return -1, out[:0]
        count += 1
        i = _ws(buf, j + 1)
        if i < n and buf[i] == _COMMA:
            i = _ws(buf, i + 1)
        elif i < n and buf[i] == _RB:
            if f == 1:
                out[1] = _RB
                return count, out[:2]
            out[f - 1] = _RB
            return count, out[:f]
        else:
            return -1, out[:0]
