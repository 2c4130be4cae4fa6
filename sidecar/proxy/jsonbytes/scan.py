"""Compiled scanners for SGLang's log-prob lists in compact JSON bytes.

They accept exactly the shapes SGLang writes when no token text is asked for, and refuse
(count ``-1``) anything else, so the caller can fall back to a full JSON parse:

* triples ``[[logprob,token_id,null],...]`` (`scan_triples`): token ids are parsed into an int64
  array here; the log-prob tokens are copied, comma-separated inside brackets, into a byte
  buffer that orjson then reads as one flat list of floats, so every float is the one orjson
  (and the object path) would give;
* top-k rows ``[[[logprob,token_id,null],...],...]`` (`scan_rows`), all rows the same length;
* integer lists ``[id,...]`` (`scan_ints`);
* a stream buffer (`scan_frames`): its ``data: ...\n\n`` frames, and for every small unfinished
  chunk (an incremental stream's deltas) its index, ``output_token_logprobs_length`` and
  triples, so the caller's Python runs once per network read, not once per token.

Only the byte shapes are checked here; a malformed number token is caught by orjson.
"""

from __future__ import annotations

import numba as nb
import numpy as np

__all__ = ["byte_at", "id_null_at", "scan_triples", "scan_rows", "scan_ints", "scan_frames"]

_LB, _RB, _COMMA = 91, 93, 44


@nb.njit(cache=True, nogil=True, inline="always")
def byte_at(buf: np.ndarray, i: int) -> int:
    return int(buf[i]) if i < buf.shape[0] else 0


@nb.njit(cache=True, nogil=True, inline="always")
def _number_end(buf: np.ndarray, i: int) -> int:
    j = i
    while j < buf.shape[0]:
        c = buf[j]
        if (48 <= c <= 57) or c == 45 or c == 43 or c == 46 or c == 101 or c == 69:
            j += 1
        else:
            break
    return j if j > i else -1


@nb.njit(cache=True, nogil=True, inline="always")
def id_null_at(buf: np.ndarray, i: int) -> tuple[int, int]:
    """The ``id,null]`` that ends a log-prob triple, at ``buf[i]``: ``(id, the index after
    the ']')``, or ``(-1, where it failed)``."""
    value, j = 0, i
    while j < buf.shape[0] and 48 <= buf[j] <= 57 and j - i < 18:
        value = value * 10 + int(buf[j] - 48)
        j += 1
    if j == i or byte_at(buf, j) != _COMMA:
        return -1, i
    i = j + 1
    if not (
        byte_at(buf, i) == 110
        and byte_at(buf, i + 1) == 117
        and byte_at(buf, i + 2) == 108
        and byte_at(buf, i + 3) == 108
        and byte_at(buf, i + 4) == _RB
    ):
        return -1, i
    return value, i + 5


@nb.njit(cache=True, nogil=True, _nrt=False)
def _list_of_triples(
    buf: np.ndarray, i: int, ids: np.ndarray, count: int, out: np.ndarray, f: int
) -> tuple[int, int, int]:
    """Parse one ``[[lp,id,null],...]`` at ``buf[i]``; returns (new count, end, f), count -1 on
    refusal. Log-prob tokens are appended to ``out`` at ``f``, each followed by a comma."""
    if byte_at(buf, i) != _LB:
        return -1, i, f
    i += 1
    if byte_at(buf, i) == _RB:
        return count, i + 1, f
    while True:
        if byte_at(buf, i) != _LB:
            return -1, i, f
        i += 1
        j = _number_end(buf, i)
        if j < 0:
            return -1, i, f
        for t in range(i, j):
            out[f] = buf[t]
            f += 1
        out[f] = _COMMA
        f += 1
        i = j
        if byte_at(buf, i) != _COMMA:
            return -1, i, f
        value, i = id_null_at(buf, i + 1)
        if value < 0:
            return -1, i, f
        ids[count] = value
        count += 1
        c = byte_at(buf, i)
        if c == _COMMA:
            i += 1
        elif c == _RB:
            return count, i + 1, f
        else:
            return -1, i, f


@nb.njit(cache=True, nogil=True, _nrt=False)
def _close(out: np.ndarray, f: int) -> int:
    """Turn ``tok,tok,`` at ``out[1:f]`` into ``[tok,tok]``; returns its length."""
    out[0] = _LB
    if f == 1:
        out[1] = _RB
        return 2
    out[f - 1] = _RB
    return f


@nb.njit(cache=True, nogil=True)
def scan_triples(buf: np.ndarray, pos: int) -> tuple[int, int, np.ndarray, np.ndarray]:
    """``(count, end, ids, floats_json)`` for the triples at ``buf[pos]``; count -1: refused."""
    cap = (buf.shape[0] - pos) // 10 + 1
    ids = np.empty(cap, dtype=np.int64)
    out = np.empty(buf.shape[0] - pos + 2, dtype=np.uint8)
    count, end, f = _list_of_triples(buf, pos, ids, 0, out, 1)
    if count < 0:
        return -1, end, ids[:0], out[:0]
    return count, end, ids[:count], out[: _close(out, f)]


@nb.njit(cache=True, nogil=True, _nrt=False)
def _rows_into(
    buf: np.ndarray, pos: int, ids: np.ndarray, out: np.ndarray
) -> tuple[int, int, int, int]:
    """``(rows, k, end, length of the floats' JSON in out)`` for `scan_rows`; rows -1: refused."""
    if byte_at(buf, pos) != _LB:
        return -1, 0, pos, 0
    i, f, rows, total, k = pos + 1, 1, 0, 0, -1
    if byte_at(buf, i) == _RB:
        return 0, 0, i + 1, _close(out, f)
    while True:
        before = total
        total, i, f = _list_of_triples(buf, i, ids, total, out, f)
        if total < 0:
            return -1, 0, i, 0
        if k < 0:
            k = total - before
        elif total - before != k:
            return -1, 0, i, 0
        rows += 1
        c = byte_at(buf, i)
        if c == _COMMA:
            i += 1
        elif c == _RB:
            return rows, k, i + 1, _close(out, f)
        else:
            return -1, 0, i, 0


@nb.njit(cache=True, nogil=True)
def scan_rows(buf: np.ndarray, pos: int) -> tuple[int, int, int, np.ndarray]:
    """``(rows, k, end, floats_json)`` for equal-length top-k rows at ``buf[pos]``; rows -1:
    refused (a null row, rows of different lengths, anything but the triple shape)."""
    ids = np.empty((buf.shape[0] - pos) // 10 + 1, dtype=np.int64)
    out = np.empty(buf.shape[0] - pos + 2, dtype=np.uint8)
    rows, k, end, length = _rows_into(buf, pos, ids, out)
    return rows, k, end, out[:length]


@nb.njit(cache=True, nogil=True, _nrt=False)
def _ints_into(buf: np.ndarray, pos: int, vals: np.ndarray) -> tuple[int, int]:
    """``(count, end)`` of the list of non-negative ints at ``buf[pos]``, read into ``vals``;
    count -1: refused."""
    if byte_at(buf, pos) != _LB:
        return -1, pos
    i, count = pos + 1, 0
    if byte_at(buf, i) == _RB:
        return 0, i + 1
    while True:
        value, j = 0, i
        while j < buf.shape[0] and 48 <= buf[j] <= 57 and j - i < 18:
            value = value * 10 + int(buf[j] - 48)
            j += 1
        if j == i:
            return -1, i
        vals[count] = value
        count += 1
        c = byte_at(buf, j)
        if c == _COMMA:
            i = j + 1
        elif c == _RB:
            return count, j + 1
        else:
            return -1, j


@nb.njit(cache=True, nogil=True)
def scan_ints(buf: np.ndarray, pos: int) -> tuple[int, int, np.ndarray]:
    """``(count, end, values)`` for a list of non-negative ints at ``buf[pos]``; -1: refused."""
    vals = np.empty((buf.shape[0] - pos) // 2 + 1, dtype=np.int64)
    count, end = _ints_into(buf, pos, vals)
    return count, end, vals[: max(count, 0)]


@nb.njit(cache=True, nogil=True, _nrt=False)
def _mark_flags(buf: np.ndarray, flags: np.ndarray) -> None:
    """Set to 1 in ``flags`` (zeroed, whole 8-byte words plus one) every position of ``buf``
    holding a newline or a quote before ``o``, ``f`` or ``i`` (where a frame may end or a
    wanted key start). One pass with no branch and unsigned indices: LLVM vectorises it."""
    n = buf.shape[0]
    one = nb.uint64(1)
    for k in range(nb.uint64(max(n - 1, 0))):
        c, d = buf[k], buf[k + one]
        flags[k] = (c == 10) | ((c == 34) & ((d == 111) | (d == 102) | (d == 105)))


@nb.njit(cache=True, nogil=True, inline="always")
def _next_mark(flags: np.ndarray, words: np.ndarray, lo: int) -> int:
    """The first flagged position from ``lo`` (`_mark_flags`; ``words``: the same bytes as
    uint64, skipped 8 at a time), -1: none."""
    i = lo
    while i & 7:
        if flags[i]:
            return i
        i += 1
    j, nw = i >> 3, words.shape[0]
    while j < nw and words[j] == 0:
        j += 1
    if j == nw:
        return -1
    i = j << 3
    while flags[i] == 0:
        i += 1
    return i


@nb.njit(cache=True, nogil=True, inline="always")
def _int_at(buf: np.ndarray, i: int, hi: int) -> int:
    value, j = 0, i
    while j < hi and 48 <= buf[j] <= 57 and j - i < 18:
        value = value * 10 + int(buf[j] - 48)
        j += 1
    return value if j > i else -1


def _pat(text: bytes) -> np.ndarray:
    return np.frombuffer(text, dtype=np.uint8).copy()


_P_DATA = _pat(b"data: {")
_P_TOP = _pat(b'"output_top_logprobs":')
_P_FINISH = _pat(b'"finish_reason":')
_P_INDEX = _pat(b'"index":')
_P_TOTAL = _pat(b'"output_token_logprobs_length":')
_P_LIST = _pat(b'"output_token_logprobs":')

#: Columns of `scan_frames`' rows.
FRAME_START, FRAME_END, FRAME_KIND, FRAME_INDEX, FRAME_TOTAL, FRAME_COUNT, FRAME_AT = range(7)
#: Frame kinds: nothing to capture, a delta read here, one for the caller's byte path.
KIND_SKIP, KIND_DELTA, KIND_OTHER = 0, 1, 2


@nb.njit(cache=True, nogil=True, inline="always")
def _matches(buf: np.ndarray, i: int, hi: int, pat: np.ndarray) -> bool:
    m = pat.shape[0]
    if i + m > hi:
        return False
    for j in range(m):
        if buf[i + j] != pat[j]:
            return False
    return True


@nb.njit(cache=True, nogil=True, _nrt=False)
def _frames_into(
    buf: np.ndarray,
    small: int,
    p_data: np.ndarray,
    p_top: np.ndarray,
    p_finish: np.ndarray,
    p_index: np.ndarray,
    p_total: np.ndarray,
    p_list: np.ndarray,
    flags: np.ndarray,
    words: np.ndarray,
    rows: np.ndarray,
    ids: np.ndarray,
    out: np.ndarray,
) -> tuple[int, int, int, int]:
    """`scan_frames`' loop: ``(rows, consumed, ids, length of the floats' JSON)``."""
    n = buf.shape[0]
    count, f, start, r = 0, 1, 0, 0
    while start < n - 1:
        fs = start
        data = _matches(buf, fs, n, p_data)
        # One pass per frame finds its end and, in its first `small` bytes, the keys at their
        # quotes (no key can sit inside a string); `_next_mark` skips the bytes between.
        keys_to = min(n, fs + small) if data else fs
        k_finish, k_index, k_total, k_list, top = -1, -1, -1, -1, False
        end, i = -1, fs + 6 if data else fs
        while True:
            i = _next_mark(flags, words, i)
            if i < 0:
                break
            c = buf[i]
            if c == 10 and buf[i + 1] == 10:
                end = i + 2
                break
            if c == 34 and i < keys_to:
                c = buf[i + 1]
                if c == 111:  # "o…
                    if _matches(buf, i, n, p_total):
                        k_total = i + p_total.shape[0]
                    elif _matches(buf, i, n, p_list):
                        k_list = i + p_list.shape[0]
                    elif _matches(buf, i, n, p_top):
                        top = True
                elif c == 102 and k_finish < 0 and _matches(buf, i, n, p_finish):
                    k_finish = i + p_finish.shape[0]
                elif c == 105 and k_index < 0 and _matches(buf, i, n, p_index):
                    k_index = i + p_index.shape[0]
            i += 1
        if end < 0:
            break
        start = end
        rows[r, 0], rows[r, 1], rows[r, 2], rows[r, 6] = fs, end, 2, count
        rows[r, 3], rows[r, 4], rows[r, 5] = 0, 0, 0
        r += 1
        if not data:
            rows[r - 1, 2] = 0
            continue
        if end - fs > small:
            continue
        if top or k_finish < 0 or byte_at(buf, k_finish) != 110 or k_total < 0 or k_list < 0:
            continue  # top-k rows, no finish_reason, the last chunk (not null), or no list
        index = 0 if k_index < 0 else _int_at(buf, k_index, end)
        total = _int_at(buf, k_total, end)
        if index < 0 or total < 0:
            continue
        got, _, f2 = _list_of_triples(buf, k_list, ids, count, out, f)
        if got < 0:
            continue
        p = r - 2
        if (
            p >= 0
            and rows[p, 2] == 1
            and rows[p, 3] == index
            and rows[p, 4] + got - count == total
            and rows[p, 1] == fs
        ):
            # a further delta of the same sample right after: one row for both
            rows[p, 1], rows[p, 4], rows[p, 5] = end, total, rows[p, 5] + got - count
            r -= 1
        else:
            q = r - 1
            rows[q, 2], rows[q, 3], rows[q, 4], rows[q, 5] = 1, index, total, got - count
        count, f = got, f2
    return r, start, count, _close(out, f)


def scan_frames(
    buf: np.ndarray, small: int = 4096
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """Cut ``data: ...\\n\\n`` frames out of a stream buffer and read the small delta chunks.

    Returns ``(rows, consumed, ids, floats_json)``: one row per complete frame (columns
    ``FRAME_*``), the bytes those frames span, and the token ids and log-prob tokens of every
    `KIND_DELTA` frame, frame after frame (row ``FRAME_AT`` is where a frame's start). A
    frame is `KIND_DELTA` only if it is at most ``small`` bytes, unfinished, without top-k rows,
    and its list reads exactly; every other ``data: {`` frame is `KIND_OTHER`."""
    n = buf.shape[0]
    rows = np.empty((n // 14 + 1, 7), dtype=np.int64)  # a frame is at least "data: {}\n\n"
    ids = np.empty(n // 10 + 1, dtype=np.int64)
    out = np.empty(n + 2, dtype=np.uint8)
    flags = np.zeros((n + 15) // 8 * 8, dtype=np.uint8)
    _mark_flags(buf, flags)
    r, start, count, length = _frames_into(
        buf, small, _P_DATA, _P_TOP, _P_FINISH, _P_INDEX, _P_TOTAL, _P_LIST,
        flags, flags.view(np.uint64), rows, ids, out,
    )  # fmt: skip
    return rows[:r], start, ids[:count], out[:length]
