"""HTTP/1.1 chunked transfer coding undone in one compiled pass per network read.

httptools calls back into Python once per HTTP chunk, and SGLang writes one chunk per stream
frame (one per token in an incremental stream), so de-chunking by callback cost about as much
as reading the frames. `Dechunker.feed` takes whatever bytes arrived, however they were cut
(a chunk-size line, its CRLF or the data split anywhere), and returns the body bytes they
carry; its state between reads is four integers.

Accepted: hex sizes (at most 15 digits), chunk extensions and whitespace after the size
(skipped to the CR), CRLF line ends, trailer fields after the last chunk (skipped). Anything
else, or a byte after the message ended, is a framing error (`DechunkError`).

`Dechunker.feed_raw` also says how many of the raw bytes can go to a client as they are (a
relay that keeps the framing and lets its own server write the last chunk).

The pass is C (`native.cstream`, ``csrc/dechunk.h``) where it was built, else numba. On the
numba pass, a read that holds exactly one whole data chunk, begun where the last read ended a
chunk (an engine decoding writes one frame per token, so a proxy that keeps up reads them one
by one), is taken apart in Python instead, since numba's call and arrays cost more than such a
frame: the state it leaves is the one the compiled pass leaves. The C pass takes such a read
in less time than that Python (`benchmarks/scanner_cost.py`, "one-frame reads").
"""

from __future__ import annotations

import re

import numba as nb
import numpy as np

from ....monitor.core.errors import WireError
from ..native import cstream

__all__ = ["Dechunker", "DechunkError", "warm_up"]

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


@nb.njit(cache=True, nogil=True, _nrt=False)
def _dechunk(buf: np.ndarray, out: np.ndarray, state: np.ndarray) -> int:
    """Append the body bytes in ``buf`` to ``out`` (as long as ``buf``); returns their count.
    ``state`` is (phase, bytes left in the chunk or the size so far, size digits seen, where
    the current chunk-size line starts relative to the next ``buf``, and out: how many bytes
    of ``buf`` may be relayed as they are, see `Dechunker.feed_raw`)."""
    n = buf.shape[0]
    phase, left, digits, line = state[0], state[1], state[2], state[3]
    i, o = 0, 0
    while i < n:
        if phase == _DATA:
            take = min(left, n - i)
            # unsigned indices (no negative-index wraparound): LLVM vectorises the copy; a
            # slice assignment or signed indices cost 20-30x more per chunk
            ui, uo = nb.uint64(i), nb.uint64(o)
            for k in range(nb.uint64(take)):
                out[uo + k] = buf[ui + k]
            o += take
            i += take
            left -= take
            if left == 0:
                phase = _DATA_CR
                if i + 1 < n and buf[i] == _CR and buf[i + 1] == _LF:
                    i += 2  # the usual case, the CRLF and the next size line in this read
                    phase, left, digits, line = _SIZE, 0, 0, i
                    while i < n:
                        h = _hex(buf[i])
                        if h < 0 or digits == 15:
                            break
                        left = left * 16 + h
                        digits += 1
                        i += 1
                    if digits and i + 1 < n and buf[i] == _CR and buf[i + 1] == _LF:
                        i += 2
                        phase = _DATA if left else _TRAILER
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
                phase, left, digits, line = _SIZE, 0, 0, i
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
    if phase == _SIZE or phase == _EXT or phase == _SIZE_LF:
        safe = line if left == 0 else n  # a size line that may still be the last chunk's
    elif phase >= _TRAILER:
        safe = line  # the last chunk's size line and what follows it
    else:
        safe = n
    state[0], state[1], state[2], state[3], state[4] = phase, left, digits, line - n, safe
    return o


# A chunk-size line without extensions: what `_one_chunk` accepts (the compiled pass reads
# the rest).
_SIZE_LINE = re.compile(rb"[0-9A-Fa-f]{1,15}\r\n")
# False: every read through the compiled pass (for tests and A/B measurements).
ONE_CHUNK_FAST = True


class DechunkError(WireError):
    """The upstream's chunked framing is broken (a `WireError`, so a `TimwatchError`)."""


class Dechunker:
    """One chunked body, fed read by read."""

    def __init__(self) -> None:
        self._state = np.zeros(5, dtype=np.int64)
        self._boundary = True  # the next byte starts a chunk-size line
        self.done = False  # the last chunk and the trailer's empty line have arrived

    def feed(self, data: bytes | memoryview) -> bytes:
        """The body bytes ``data`` carries; raises `DechunkError` on broken framing."""
        return self.feed_raw(data)[0]

    def feed_raw(self, data: bytes | memoryview) -> tuple[bytes, int]:
        """The body bytes ``data`` carries, and how far the bytes fed so far may be relayed
        to a client as they are, counted from the start of ``data``: everything but the last
        chunk (``0`` size line, trailer, empty line) and a size line that may still be it.
        Negative when such a line began in an earlier read (those bytes are still held)."""
        state = self._state
        c = cstream()
        if c is not None:  # the C pass costs less than `_one_chunk` even on one chunk
            body = c.dechunk(data, state)
        else:
            if isinstance(data, memoryview):
                data = data.tobytes()
            if data and self._boundary and ONE_CHUNK_FAST:
                body = _one_chunk(data)
                if body is not None:  # at a boundary again: the compiled pass's state unchanged
                    return body, len(data)
            out = np.empty(len(data), dtype=np.uint8)
            got = _dechunk(np.frombuffer(data or b"\0", dtype=np.uint8)[: len(data)], out, state)
            body = out[:got].tobytes()
        phase, left, digits, line, safe = state.tolist()
        if phase == _ERROR and data:
            raise DechunkError("bad chunked encoding from upstream")
        self._boundary = phase == _SIZE and left == 0 and digits == 0 and line == 0
        self.done = phase == _DONE
        return body, safe


def _one_chunk(data: bytes) -> bytes | None:
    """The data of ``data`` when it is exactly one non-empty chunk (size line without
    extensions, data, CRLF); None otherwise."""
    m = _SIZE_LINE.match(data)
    if m is None:
        return None
    at = m.end()
    size = int(data[: at - 2], 16)
    if size == 0 or len(data) != at + size + 2 or not data.endswith(b"\r\n"):
        return None
    return data[at : at + size]


def warm_up() -> None:
    """The compiled pass run once (numba compiles it or loads its cache), the numba twin too
    where the C code de-chunks."""
    reader = Dechunker()
    reader.feed_raw(b"5\r\nhello\r\n3\r\nabc\r\n")  # two chunks: not `_one_chunk`'s path
    reader.feed_raw(b"")
    _dechunk(np.frombuffer(b"1\r\nx\r\n", np.uint8), np.empty(6, np.uint8), np.zeros(5, np.int64))
