"""Log-prob triples read straight into float64 arrays in compiled code, correctly rounded.

`scan.scan_triples` copies the log-prob tokens out and lets orjson parse them (a Python float
per token, then an array). Here each number token is parsed in place with the Eisel–Lemire
algorithm (Lemire, "Number parsing at a gigabyte per second", 2021; the fast_float library):
the decimal significand ``w`` (at most 19 digits) times a 128-bit truncation of ``5**q`` gives
the correctly rounded double, the same one orjson and Python's ``float()`` give. A plain
decimal with a significand below 2**53 and at most 22 decimals (every log-prob SGLang writes)
takes Clinger's fast path first: one correctly rounded division of two exact doubles, the
same double again.

Anything outside that exact path is refused, never approximated: more than 19 significant
digits, a result that would be subnormal or infinite, a token that is not a JSON number, a
triple that is not ``[number,id,null]``. The caller then takes the orjson path, which decides
(`fastwire._triples`).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba.core import types
from numba.extending import intrinsic

from .scan import byte_at, id_null_at, scan_ints, scan_rows, scan_triples

__all__ = ["triples_f64", "triples_into", "POW5", "Q_MIN", "Q_MAX", "warm_up"]

Q_MIN, Q_MAX = -342, 308
# a double's IEEE-754 bits as a signed 64-bit int (what numba returns: an int64)
Bits = int | np.int64


def _pow5_table() -> np.ndarray:
    """``5**q`` for ``Q_MIN <= q <= Q_MAX`` as the top 128 bits of its binary expansion
    (``[high, low]`` words; truncated for ``q >= 0``, for ``q < 0`` one above the truncated
    reciprocal), as fast_float's table is generated."""
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

_M32 = np.uint64(0xFFFFFFFF)
_U32 = np.uint64(32)
_U1 = np.uint64(1)
_U0 = np.uint64(0)
_SIGN = np.uint64(1 << 63)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_LB, _RB, _COMMA = 91, 93, 44
# the result of a refused token (any NaN bit pattern would do: it is never stored)
_REFUSED = -1


@nb.njit(cache=True, nogil=True, inline="always")
def _mul128(a: np.uint64, b: np.uint64) -> tuple[np.uint64, np.uint64]:
    """``(high, low)`` words of the 128-bit product of two uint64."""
    a_lo, a_hi = a & _M32, a >> _U32
    b_lo, b_hi = b & _M32, b >> _U32
    p0, p1, p2, p3 = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    mid = (p0 >> _U32) + (p1 & _M32) + (p2 & _M32)
    return p3 + (p1 >> _U32) + (p2 >> _U32) + (mid >> _U32), (mid << _U32) | (p0 & _M32)


@nb.njit(cache=True, nogil=True, inline="always")
def _clz(w: np.uint64) -> int:
    n = 0
    for bits in (32, 16, 8, 4, 2, 1):
        if w >> np.uint64(64 - bits) == _U0:
            w = w << np.uint64(bits)
            n += bits
    return n


@nb.njit(cache=True, nogil=True, inline="always")
def _bits(w: np.uint64, q: int, neg: bool, table: np.ndarray) -> Bits:
    """IEEE-754 bits of ``±w * 10**q`` correctly rounded (nearest, ties to even), or
    `_REFUSED` when that is not a normal finite double this path computes exactly."""
    sign = _SIGN if neg else _U0
    if w == _U0:
        return np.int64(sign)
    if q < Q_MIN or q > Q_MAX:
        return _REFUSED
    lz = _clz(w)
    w = w << np.uint64(lz)
    hi, lo = _mul128(w, table[q - Q_MIN, 0])
    mask = np.uint64(0x1FF)  # the bits below the 55 that decide the rounding
    if hi & mask == mask:
        s_hi, _ = _mul128(w, table[q - Q_MIN, 1])
        lo2 = lo + s_hi
        if s_hi > lo2:
            hi += _U1
        lo = lo2
    if lo == _ALL and (q < -27 or q > 55):
        return _REFUSED  # the product may be one short: not decided here
    upper = int(hi >> np.uint64(63))
    shift = np.uint64(upper + 9)
    mant = hi >> shift
    power2 = (((152170 + 65536) * q) >> 16) + 63 + upper - lz + 1023
    if power2 <= 0:
        return _REFUSED  # subnormal
    if lo <= _U1 and -4 <= q <= 23 and mant & np.uint64(3) == _U1:
        if mant << shift == hi:
            mant &= ~_U1
    mant += mant & _U1
    mant >>= _U1
    if mant >= np.uint64(2 << 52):
        mant = np.uint64(1 << 52)
        power2 += 1
    mant &= ~np.uint64(1 << 52)
    if power2 >= 0x7FF:
        return _REFUSED  # infinite
    return np.int64(mant | (np.uint64(power2) << np.uint64(52)) | sign)


@nb.njit(cache=True, nogil=True, inline="always")
def _digit(buf: np.ndarray, i: int) -> int:
    if i < buf.shape[0]:
        c = int(buf[i]) - 48
        if 0 <= c <= 9:
            return c
    return -1


_ZEROS8 = np.uint64(0x3030303030303030)
_HIGH8 = np.uint64(0x8080808080808080)
_ADD46 = np.uint64(0x4646464646464646)
_MASK8 = np.uint64(0x000000FF000000FF)
_MUL1 = np.uint64(0x000F424000000064)  # 100 + 1000000 << 32
_MUL2 = np.uint64(0x0000271000000001)  # 1 + 10000 << 32
_E8 = np.uint64(100_000_000)


@nb.njit(cache=True, nogil=True, inline="always")
def _digits(buf: np.ndarray, i: int, w: np.uint64) -> tuple[np.uint64, int, int]:
    """Append the decimal digits at ``buf[i:]`` to ``w``: ``(w, how many, end)``. Eight at a
    time where eight digits follow (one multiply chain per eight, not per digit); ``w``
    wraps past 19 digits, which the caller refuses."""
    n, size = 0, buf.shape[0]
    while i + 8 <= size:
        v = _U0
        for t in range(8):
            v |= np.uint64(buf[i + t]) << np.uint64(8 * t)
        if ((v + _ADD46) | (v - _ZEROS8)) & _HIGH8 != _U0:
            break
        v -= _ZEROS8
        v = v * np.uint64(10) + (v >> np.uint64(8))
        v = ((v & _MASK8) * _MUL1 + ((v >> np.uint64(16)) & _MASK8) * _MUL2) >> _U32
        w = w * _E8 + (v & _M32)
        n += 8
        i += 8
    d = _digit(buf, i)
    while d >= 0:
        w = w * np.uint64(10) + np.uint64(d)
        n += 1
        i += 1
        d = _digit(buf, i)
    return w, n, i


@nb.njit(cache=True, nogil=True, inline="always")
def _number(buf: np.ndarray, i: int, table: np.ndarray) -> tuple[Bits, int]:
    """``(bits, end)`` of the JSON number token at ``buf[i]``; bits `_REFUSED` if it is not
    one (the JSON grammar, strictly) or this path cannot convert it."""
    neg = i < buf.shape[0] and buf[i] == 45
    if neg:
        i += 1
    d = _digit(buf, i)
    if d < 0:
        return _REFUSED, i
    w, digits, q, is_float = _U0, 0, 0, False
    if d == 0:
        i += 1
        if _digit(buf, i) >= 0:
            return _REFUSED, i  # a leading zero
    else:
        w, n, i = _digits(buf, i, _U0)
        digits += n
    if i < buf.shape[0] and buf[i] == 46:
        is_float = True
        i += 1
        d = _digit(buf, i)
        if d < 0:
            return _REFUSED, i
        while d == 0 and w == _U0:  # leading zeros: not significant
            q -= 1
            i += 1
            d = _digit(buf, i)
        w, n, i = _digits(buf, i, w)
        digits += n
        q -= n
    if i < buf.shape[0] and (buf[i] == 101 or buf[i] == 69):
        is_float = True
        i += 1
        e_neg = i < buf.shape[0] and buf[i] == 45
        if i < buf.shape[0] and (buf[i] == 45 or buf[i] == 43):
            i += 1
        d = _digit(buf, i)
        if d < 0:
            return _REFUSED, i
        e, e_digits = 0, 0
        while d >= 0:
            e = e * 10 + d
            e_digits += 1
            i += 1
            d = _digit(buf, i)
        if e_digits > 4:
            return _REFUSED, i
        q += -e if e_neg else e
    if digits > 19:
        return _REFUSED, i
    # orjson reads "-0" as the int 0, which becomes +0.0; "-0.0" stays -0.0
    return _bits(w, q, neg and (is_float or w != _U0), table), i


@intrinsic
def _as_f64(typingctx, bits):  # type: ignore[no-untyped-def]
    """The float64 whose IEEE-754 bits are the int64 ``bits`` (a register move, no array)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], context.get_value_type(types.float64))

    return types.float64(types.int64), codegen


# 10**k for k <= 22: exact doubles
_POW10 = np.array([10.0**k for k in range(23)])


@nb.njit(cache=True, nogil=True, inline="always")
def _float_at(buf: np.ndarray, i: int, table: np.ndarray) -> tuple[float, int]:
    """The JSON number at ``buf[i]`` as a float64 and its end (end -1: refused). A plain
    decimal ``-?d+.d+`` with a significand below 2**53 and at most 22 decimals is
    ``w / 10**k``: both exact, one correctly rounded division (Clinger's fast path), so the
    float `_number` and orjson give; any other token goes to `_number`."""
    j, n = i, buf.shape[0]
    neg = j < n and buf[j] == 45
    j += neg
    w, digits, frac = nb.uint64(0), 0, -1
    first = j
    while j < n:
        c = buf[j]
        if 48 <= c <= 57:
            w = w * nb.uint64(10) + nb.uint64(c - 48)
            digits += 1
        elif c == 46 and frac < 0 and digits > 0:
            frac = digits
        else:
            break
        j += 1
    k = digits - frac
    lead_ok = byte_at(buf, first) != 48 or frac == 1  # no leading zero before the point
    if frac > 0 and 0 < k <= 22 and digits <= 18 and w < nb.uint64(1 << 53) and lead_ok:
        c = byte_at(buf, j)
        if c != 101 and c != 69:
            value = float(w) / _POW10[k]
            return (-value if neg else value), j
    bits, j = _number(buf, i, table)
    if bits == _REFUSED:
        return 0.0, -1
    return _as_f64(bits), j


@nb.njit(cache=True, nogil=True, _nrt=False)
def triples_into(
    buf: np.ndarray, i: int, ids: np.ndarray, vals: np.ndarray, count: int, table: np.ndarray
) -> tuple[int, int]:
    """``[[logprob,id,null],...]`` at ``buf[i]`` appended to ``ids`` and ``vals`` (the
    log-probs, the floats orjson gives) from ``count``; returns (new count, end), count -1
    where the list does not read exactly that way or a log-prob is refused. ``table`` is
    `POW5`; ``ids`` and ``vals`` have room for every triple the bytes can hold."""
    if byte_at(buf, i) != _LB:
        return -1, i
    i += 1
    if byte_at(buf, i) == _RB:
        return count, i + 1
    while True:
        if byte_at(buf, i) != _LB:
            return -1, i
        value, i = _float_at(buf, i + 1, table)
        if i < 0 or byte_at(buf, i) != _COMMA:
            return -1, i
        tid, i = id_null_at(buf, i + 1)
        if tid < 0:
            return -1, i
        ids[count], vals[count] = tid, value
        count += 1
        c = byte_at(buf, i)
        if c == _COMMA:
            i += 1
        elif c == _RB:
            return count, i + 1
        else:
            return -1, i


@nb.njit(cache=True, nogil=True)
def triples_f64(
    buf: np.ndarray, pos: int, table: np.ndarray
) -> tuple[int, int, np.ndarray, np.ndarray]:
    """``(count, end, ids, logps)`` for the ``[[logprob,id,null],...]`` list at ``buf[pos]``;
    count -1: refused (the shape, or a log-prob this path does not convert: the caller asks
    orjson). ``table`` is `POW5`."""
    cap = (buf.shape[0] - pos) // 10 + 1
    ids = np.empty(cap, dtype=np.int64)
    vals = np.empty(cap, dtype=np.float64)
    count, end = triples_into(buf, pos, ids, vals, 0, table)
    if count < 0:
        return -1, end, ids[:0], vals[:0]
    return count, end, ids[:count], vals[:count]


def warm_up() -> None:
    """Run every scanner the SGLang proxy's answer path uses once: numba compiles them (or
    loads its cache) now, not on the first client's request (~10 s on a cold cache)."""
    triple = np.frombuffer(b"[[-1.5,2,null]]", np.uint8)
    triples_f64(triple, 0, POW5)
    scan_triples(triple, 0)
    scan_rows(np.frombuffer(b"[[[-1.5,2,null]]]", np.uint8), 0)
    scan_ints(np.frombuffer(b"[1,2]", np.uint8), 0)
