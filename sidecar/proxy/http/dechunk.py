"""HTTP/1.1 chunked transfer coding undone in one C pass per network read (``csrc/dechunk.h``).

llhttp (httptools) calls back into Python once per HTTP chunk, and an engine writes one chunk
per stream frame (one per token in an incremental stream), so de-chunking by callback cost
about as much as reading the frames. `Dechunker.feed` takes whatever bytes arrived, however
they were cut (a chunk-size line, its CRLF or the data split anywhere), and returns the body
bytes they carry; its state between reads is a few integers.

Accepted: hex sizes (at most 15 digits), chunk extensions and whitespace after the size
(skipped to the CR), CRLF line ends, trailer fields after the last chunk (skipped). Anything
else, or a byte after the message ended, is a framing error (`DechunkError`). llhttp refuses
the same framings (tests/unit/test_dechunk.py compares the two), except that it accepts any
number of hex digits whose value fits and refuses whitespace before an extension.

Where the C module was not built, or ``TIMWATCH_NATIVE=0``, `available` is False and the
upstream client hands chunked bodies to llhttp instead (`proxy.http.client`).
"""

from __future__ import annotations

from array import array

from ....monitor.core.errors import WireError
from ..native import cstream

__all__ = ["Dechunker", "DechunkError", "available"]

_DONE, _ERROR = 10, -1  # csrc/dechunk.h's phases


class DechunkError(WireError):
    """The upstream's chunked framing is broken (a `WireError`, so a `TimwatchError`)."""


def available() -> bool:
    """Whether the C pass runs here (else llhttp de-chunks)."""
    return cstream() is not None


class Dechunker:
    """One chunked body, fed read by read through the C pass (only where `available`)."""

    def __init__(self) -> None:
        c = cstream()
        if c is None:
            raise RuntimeError("the C de-chunker is not built or switched off")
        self._dechunk = c.dechunk
        # (phase, bytes left in the chunk or the size so far, size digits seen, where the
        # size line began, bytes a relay could pass on as they are): csrc/dechunk.h
        self._state = array("q", bytes(40))
        self.done = False  # the last chunk and the trailer's empty line have arrived

    def feed(self, data: bytes | memoryview) -> tuple[bytes, int]:
        """The body bytes ``data`` carries (`DechunkError` on broken framing), and how far
        the bytes fed so far may be relayed to a client as they are, counted from the start of
        ``data``: everything but the last chunk (``0`` size line, trailer, empty line) and a
        size line that may still be it. Negative when such a line began in an earlier read
        (those bytes are still held)."""
        state = self._state
        body: bytes = self._dechunk(data, state)
        phase = state[0]
        if phase == _ERROR and data:
            raise DechunkError("bad chunked encoding from upstream")
        self.done = phase == _DONE
        return body, state[4]
