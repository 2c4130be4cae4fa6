"""HTTP/1.1 chunked transfer coding undone in one compiled pass per network read.

httptools calls back into Python once per HTTP chunk, and SGLang writes one chunk per stream
frame (one per token in an incremental stream), so de-chunking by callback cost about as much
as reading the frames. `Dechunker.feed` takes whatever bytes arrived, however they were cut
(a chunk-size line, its CRLF or the data split anywhere), and returns the body bytes they
carry; its state between reads is four integers.

Accepted: hex sizes (at most 15 digits), chunk extensions and whitespace after the size
(skipped to the CR), CRLF line ends, trailer fields after the last chunk (skipped). Anything
else, or a byte after the message ended, is a framing error (`DechunkError`).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from timwatch.monitor.core.errors import WireError

__all__ = ["Dechunker", "DechunkError"]

# phases
_SIZE, _EXT, _SIZE_LF, _DATA, _DATA_CR, _DATA_LF = 0, 1, 2, 3, 4, 5
_TRAILER, _FIELD, _FIELD_LF, _END_LF, _DONE, _ERROR = 6, 7, 8, 9, 10, -1
_CR, _LF = 13, 10


@nb.njit(cache=True, nogil=True)
def _hex(c: int) -> int:
    if 48 <= c <= 57:
        return c - 48
    if 97 <= c <= 102:
        return c - 87
    if 65 <= c <= 70:
        return c - 55
    return -1


@nb.njit(cache=True, nogil=True)
def _dechunk(buf: np.ndarray, out: np.ndarray, state: np.ndarray) -> int:
    """Append the body bytes in ``buf`` to ``out`` (as long as ``buf``); returns their count.
    ``state`` is (phase, bytes left in the chunk or the size so far, size digits seen)."""
    n = buf.shape[0]
    phase, left, digits = state[0], state[1], state[2]
    i, o = 0, 0
    while i < n:
        if phase == _DATA:
            take = min(left, n - i)
            out[o : o + take] = buf[i : i + take]
            o += take
            i += take
            left -= take
            if left == 0:
                phase = _DATA_CR
            continue
        c = buf[i]
        i += 1
        if phase == _SIZE:
            h = _hex(c)
            if h >= 0 and digits < 15:
                left = left * 16 + h
                digits += 1
            elif digits == 0:
                phase = _ERROR
            elif c == _CR:
                phase = _SIZE_LF
            elif c == 59 or c == 32 or c == 9:  # ';' ' ' '\t': an extension, skipped
                phase = _EXT
            else:
                phase = _ERROR
        elif phase == _EXT:
            if c == _CR:
                phase = _SIZE_LF
            elif c == _LF:
                phase = _ERROR
        elif phase == _SIZE_LF:
            if c != _LF:
                phase = _ERROR
            elif left == 0:
                phase = _TRAILER
            else:
                phase = _DATA
        elif phase == _DATA_CR:
            phase = _DATA_LF if c == _CR else _ERROR
        elif phase == _DATA_LF:
            if c == _LF:
                phase, left, digits = _SIZE, 0, 0
            else:
                phase = _ERROR
        elif phase == _TRAILER:
            phase = _END_LF if c == _CR else _FIELD
        elif phase == _FIELD:
            if c == _CR:
                phase = _FIELD_LF
        elif phase == _FIELD_LF:
            phase = _TRAILER if c == _LF else _ERROR
        elif phase == _END_LF:
            phase = _DONE if c == _LF else _ERROR
        else:  # a byte after the end, or after an error
            phase = _ERROR
        if phase == _ERROR:
            break
    state[0], state[1], state[2] = phase, left, digits
    return o


class DechunkError(WireError):
    """The upstream's chunked framing is broken (a `WireError`, so a `TimwatchError`)."""


class Dechunker:
    """One chunked body, fed read by read."""

    def __init__(self) -> None:
        self._state = np.zeros(3, dtype=np.int64)

    @property
    def done(self) -> bool:
        """The last chunk and the trailer's empty line have arrived."""
        return bool(self._state[0] == _DONE)

    def feed(self, data: bytes) -> bytes:
        """The body bytes ``data`` carries; raises `DechunkError` on broken framing."""
        if not data:
            return b""
        out = np.empty(len(data), dtype=np.uint8)
        got = _dechunk(np.frombuffer(data, dtype=np.uint8), out, self._state)
        if self._state[0] == _ERROR:
            raise DechunkError("bad chunked encoding from upstream")
        return out[:got].tobytes()
