"""A read of an incremental stream whose frames are all small unfinished deltas, read without
searching each frame for its keys.

`scan.scan_frames` finds a frame's end and its keys by visiting every quote that may start one
(about eight stops per 440-byte delta frame); that was most of an incremental stream's proxy
time. SGLang writes every delta of a sample with the same keys in the same order, so here:

* frame ends are found eight bytes at a time, from a little before where the previous
  frame's length puts the end (compact JSON holds no raw newline, so the first ``\\n\\n``
  after a frame's start is its end; one skipped over is caught by the count below);
* ``"output_token_logprobs_length":`` is looked for where the previous frame had it, counted
  from the frame's end; the list's key is the first ``:`` before it (a list of triples holds
  none), and ``"finish_reason":`` is looked for where the previous frame had it, counted back
  from the list's key. Each is checked byte for byte where it is looked for; a frame where one
  is not there is searched byte by byte (`_learn`) and teaches the positions to the next;
* one vectorised pass over the frames' bytes then counts every newline and every quote
  followed by ``fi``, ``output_t`` or ``ind``. Each frame read holds at least five (its
  ``"finish_reason":``, its list and total keys, its ``\\n\\n``), so exactly five per frame
  prove that there is no other: no ``index``, no ``output_top_logprobs``, no key twice, no
  frame end skipped. The rows are then the ones `scan.scan_frames` gives.
  Where a string starts like one (a token's text ``"fi…``), the keys themselves are counted.

`scan_deltas` stops at the first frame that is not such a delta (longer than ``small``, not
``data: {``, finished, a list that does not read exactly: the rest of the read is for
`scan.scan_frames`), and declines the whole read (``used`` -1) when the count does not add
up. It never guesses: a declined read costs one more pass, never a wrong row.
"""

from __future__ import annotations

import threading

import numba as nb
import numpy as np

from ..jsonbytes import numbers as numparse
from ..jsonbytes.numbers import POW5, triples_into
from ..jsonbytes.scan import (
    _P_DATA,
    _P_FINISH,
    _P_INDEX,
    _P_LIST,
    _P_TOP,
    _P_TOTAL,
    _int_at,
    _matches,
    byte_at,
    scan_frames,
)
from ..native import cstream

__all__ = ["scan_deltas", "scan_deltas_numba", "warm_up"]

_LO = np.uint64(0x0101010101010101)
_HI = np.uint64(0x8080808080808080)
_NL = np.uint64(0x0A0A0A0A0A0A0A0A)
# How much shorter than the one before a frame may be and still be found by `_scan_deltas`
# (a shorter one declines the read, for `scan.scan_frames`).
_SLACK = 128


@nb.njit(cache=True, nogil=True, inline="always")
def _frame_end(buf: np.ndarray, words: np.ndarray, i: int) -> int:
    """The index after the first ``\\n\\n`` at or after ``i``, -1: none in ``buf``. Whole
    8-byte words without a newline are skipped with one test each."""
    n = buf.shape[0]
    while i < n:
        if i & 7 == 0:
            j = i >> 3
            while j < words.shape[0]:
                v = words[j] ^ _NL
                if (v - _LO) & ~v & _HI:
                    break
                j += 1
            i = max(i, j << 3)
            if i >= n:
                return -1
        if buf[i] == 10:
            if i + 1 >= n:
                return -1
            if buf[i + 1] == 10:
                return i + 2
        i += 1
    return -1


@nb.njit(cache=True, nogil=True, _nrt=False)
def _learn(
    buf: np.ndarray,
    fs: int,
    end: int,
    p_finish: np.ndarray,
    p_list: np.ndarray,
    p_total: np.ndarray,
) -> tuple[int, int, int]:
    """``(finish, list, total)`` key starts in ``buf[fs:end]`` found byte by byte (the first
    of each); -1 where one is absent."""
    kf, kl, kt = -1, -1, -1
    for i in range(fs, end):
        if buf[i] != 34:
            continue
        c = buf[i + 1]
        if c == 102 and kf < 0 and _matches(buf, i, end, p_finish):
            kf = i
        elif c == 111:
            if kt < 0 and _matches(buf, i, end, p_total):
                kt = i
            elif kl < 0 and _matches(buf, i, end, p_list):
                kl = i
    return kf, kl, kt


@nb.njit(cache=True, nogil=True, _nrt=False)
def _marks(buf: np.ndarray, hi: int, flags: np.ndarray) -> int:
    """How many bytes of ``buf[:hi]`` are a newline, or a quote followed by ``fi``, ``ind`` or
    ``output_t``. Blocks of 4,096 positions are flagged without a branch, then summed (LLVM
    vectorises both loops; a sum taken in the first loop was not)."""
    top = max(hi - 8, 0)
    one, two, three = nb.uint64(1), nb.uint64(2), nb.uint64(3)
    total = nb.uint64(0)
    for base in range(0, top, 4096):
        b = nb.uint64(base)
        m = nb.uint64(min(4096, top - base))
        for k in range(m):
            p = b + k
            c0, c1, c2, c3 = buf[p], buf[p + one], buf[p + two], buf[p + three]
            output_t = (c1 == 111) & (c2 == 117) & (c3 == 116)
            output_t &= (buf[p + nb.uint64(7)] == 95) & (buf[p + nb.uint64(8)] == 116)
            key = ((c1 == 102) & (c2 == 105)) | ((c1 == 105) & (c2 == 110) & (c3 == 100))
            flags[k] = (c0 == 10) | ((c0 == 34) & (key | output_t))
        for k in range(m):
            total += flags[k]
    count = int(total)
    for k in range(top, hi):  # the last bytes, bounds checked
        c0, c1, c2, c3 = buf[k], byte_at(buf, k + 1), byte_at(buf, k + 2), byte_at(buf, k + 3)
        if c0 == 10:
            count += 1
        elif c0 == 34 and ((c1 == 102 and c2 == 105) or (c1 == 105 and c2 == 110 and c3 == 100)):
            count += 1
        elif c0 == 34 and c1 == 111 and c2 == 117 and c3 == 116 and k + 8 < hi:
            count += buf[k + 7] == 95 and buf[k + 8] == 116
    return count


@nb.njit(cache=True, nogil=True, _nrt=False)
def _exact_marks(
    buf: np.ndarray,
    hi: int,
    keys: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
) -> int:
    """As `_marks`, counting the keys themselves: ``"finish_reason":``,
    ``"output_token_logprobs":``, ``"output_token_logprobs_length":``,
    ``"output_top_logprobs":``, ``"index":`` (and newlines)."""
    count = 0
    for k in range(hi):
        c = buf[k]
        if c == 10:
            count += 1
        elif c == 34:
            for pat in keys:
                if _matches(buf, k, hi, pat):
                    count += 1
                    break
    return count


@nb.njit(cache=True, nogil=True, _nrt=False)
def _walk(
    buf: np.ndarray,
    words: np.ndarray,
    small: int,
    p_data: np.ndarray,
    p_finish: np.ndarray,
    p_list: np.ndarray,
    p_total: np.ndarray,
    table: np.ndarray,
    rows: np.ndarray,
    ids: np.ndarray,
    vals: np.ndarray,
) -> tuple[int, int, int, int, bool]:
    """The delta frames ``buf`` starts with, into ``rows``, ``ids`` and ``vals``: ``(rows,
    consumed, values, frames, stopped)``. Allocates nothing, so it is compiled without
    reference counting (each array access in a loop of inlined helpers otherwise costs an
    atomic increment and decrement)."""
    n = buf.shape[0]
    count, start, r, frames, length, stopped = 0, 0, 0, 0, 0, False
    lt, lf = -1, -1  # the template: total key from the end, finish key back from the list key
    m_total, m_list, m_finish = p_total.shape[0], p_list.shape[0], p_finish.shape[0]
    while start < n - 1:
        fs = start
        # the next frame's end is searched for from a little before where the last frame's
        # length puts it: a shorter frame's end skipped over leaves one mark too many
        end = _frame_end(buf, words, fs + max(7, length - _SLACK))
        if end < 0 and length - _SLACK > 7:
            end = _frame_end(buf, words, fs + 7)
        if end < 0:
            break
        length = end - fs
        if end - fs > small or not _matches(buf, fs, end, p_data):
            stopped = True
            break
        kt = end - lt
        ok = lt > 0 and kt > fs and _matches(buf, kt, end, p_total)
        kl = -1
        if ok:
            # the list's key: the first ':' before the ',' ahead of the total's key
            j = kt - 2
            while j > fs and buf[j] != 58 and kt - j < 80:
                j -= 1
            kl = j + 1 - m_list
            ok = buf[kt - 1] == 44 and kl > fs and _matches(buf, kl, end, p_list)
        kf = kl - lf
        if ok:
            ok = lf > 0 and kf > fs and _matches(buf, kf, end, p_finish)
        if not ok:
            kf, kl, kt = _learn(buf, fs, end, p_finish, p_list, p_total)
            if kf < 0 or kl < 0 or kt < 0:
                stopped = True
                break
            lt, lf = end - kt, kl - kf
        if buf[kf + m_finish] != 110:
            stopped = True  # finished (or not compact JSON): the last chunk
            break
        total = _int_at(buf, kt + m_total, end)
        got, e = triples_into(buf, kl + m_list, ids, vals, count, table)
        if total < 0 or got < 0 or e != kt - 1:
            stopped = True
            break
        p = r - 1
        if p >= 0 and rows[p, 4] + got - count == total and rows[p, 1] == fs:
            rows[p, 1], rows[p, 4], rows[p, 5] = end, total, rows[p, 5] + got - count
        else:
            if r == rows.shape[0]:
                stopped = True  # no room for another row: the rest is for scan_frames
                break
            rows[r, 0], rows[r, 1], rows[r, 2], rows[r, 3] = fs, end, 1, 0
            rows[r, 4], rows[r, 5], rows[r, 6] = total, got - count, count
            r += 1
        frames += 1
        count = got
        start = end
    return r, start, count, frames, stopped


@nb.njit(cache=True, nogil=True)
def _scan_deltas(
    buf: np.ndarray,
    small: int,
    p_data: np.ndarray,
    p_finish: np.ndarray,
    p_list: np.ndarray,
    p_total: np.ndarray,
    p_top: np.ndarray,
    p_index: np.ndarray,
    table: np.ndarray,
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, bool]:
    n = buf.shape[0]
    rows = np.empty((n // 64 + 2, 7), dtype=np.int64)
    ids = np.empty(n // 10 + 1, dtype=np.int64)
    vals = np.empty(n // 10 + 1, dtype=np.float64)
    words = buf[: n - n % 8].view(np.uint64) if n >= 8 else np.empty(0, np.uint64)
    r, start, count, frames, stopped = _walk(
        buf, words, small, p_data, p_finish, p_list, p_total, table, rows, ids, vals
    )
    # every frame read holds at least its "finish_reason":, its two "output_token_logprobs…
    # keys and its ending "\n\n": exactly 5 marks per frame leave room for no other
    if _marks(buf, start, np.empty(4096, dtype=np.uint8)) != 5 * frames:
        # a string starting like a key (a token's text "fi…"): count the keys themselves
        keys = (p_finish, p_list, p_total, p_top, p_index)
        if _exact_marks(buf, start, keys) != 5 * frames:
            return rows[:0], -1, ids[:0], vals[:0], False
    return rows[:r], start, ids[:count], vals[:count], stopped


def scan_deltas(
    buf: np.ndarray, small: int = 4096
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, bool]:
    """`scan.scan_frames`' answer for the small unfinished one-sample deltas without top-k
    rows that a stream buffer starts with, the log-probs parsed: ``(rows, consumed, ids, logps,
    stopped)``. ``stopped``: a complete frame at ``consumed`` is not such a delta (for
    `scan.scan_frames` to read from there); ``consumed`` -1: nothing taken from this buffer.
    Read by the C twin of `_scan_deltas` where it is built (`native.cstream`), else by numba."""
    c = cstream()
    if c is None:
        return scan_deltas_numba(buf, small)
    rows, ids, vals = _scratch(buf.shape[0])
    r, used, count, stopped = c.scan_deltas(buf, small, rows, ids, vals, POW5)
    if used < 0:
        return rows[:0].copy(), -1, ids[:0].copy(), vals[:0].copy(), False
    return rows[:r].copy(), used, ids[:count].copy(), vals[:count].copy(), stopped


def scan_deltas_numba(
    buf: np.ndarray, small: int = 4096
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, bool]:
    """`scan_deltas` on the numba code, whether or not the C code is built."""
    return _scan_deltas(buf, small, _P_DATA, _P_FINISH, _P_LIST, _P_TOTAL, _P_TOP, _P_INDEX, POW5)


_SCRATCH = threading.local()


def _scratch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's arrays for the C scan of ``n`` bytes: room for the most rows and triples
    ``n`` bytes can hold, kept between reads (a profile of the proxy allocating them per read
    put a tenth of its samples there, malloc growing and trimming the heap); what a scan
    returns is copied out of them."""
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


def warm_up() -> None:
    """`numparse.warm_up`, and the stream scanners: compiled (or loaded from numba's cache)
    now, not on the first client's stream."""
    numparse.warm_up()
    frame = (
        b'data: {"meta_info":{"finish_reason":null,"output_token_logprobs":[[-1.5,2,null]],'
        b'"output_token_logprobs_length":1}}\n\n'
    )
    view = np.frombuffer(frame * 2, dtype=np.uint8)
    scan_deltas(view)
    # the numba twin too, when the C code reads (TIMWATCH_NATIVE=0 switches to it)
    scan_deltas_numba(view)
    scan_frames(view)
