"""One answer read from the upstream (`upstream.Upstream.request`): its status and headers,
then its body, read in turns (`UpstreamResponse.chunks`) or handed on read by read in the
connection's own receive callback (`UpstreamResponse.push_to`, the raw relay).

A chunked body's reads are de-chunked in one compiled pass each (`proxy.http.dechunk`); reading
pauses while more than `HIGH_WATER` bytes wait for the client, and resumes when the reader
takes them. The connection goes back to its pool on `UpstreamResponse.release` only when the
answer was read to the end and the upstream allows keep-alive.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from ....monitor.core.errors import UpstreamError
from .dechunk import Dechunker, DechunkError

__all__ = ["HIGH_WATER", "Connection", "Pool", "UpstreamResponse"]

# Bytes of a body that may wait for the reader before the upstream connection stops reading.
HIGH_WATER = 1 << 20


class Connection(Protocol):
    """What an answer needs of the connection it arrives on (`upstream._Conn`)."""

    transport: asyncio.Transport | None
    lost: bool
    resp: UpstreamResponse | None

    def close(self) -> None: ...


class Pool(Protocol):
    """Where a connection goes back once its answer was read to the end (`upstream.Upstream`)."""

    def _give_back(self, conn: Any, /) -> None: ...


class UpstreamResponse:
    """One answer: ``status`` and ``headers`` once `Upstream.request` returns, then the body
    by `read` or `chunks`. `release` must be called when done (it closes an unread one)."""

    def __init__(self, owner: Pool, conn: Connection, timeout_s: float | None) -> None:
        self.status = 0
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._owner, self._conn, self._timeout = owner, conn, timeout_s
        self._chunks: collections.deque[bytes] = collections.deque()
        self._raw: list[bytes | memoryview] = []  # reads of a chunked body, not yet de-chunked
        self._dechunker: Dechunker | None = None
        self._sink: Callable[[list[bytes | memoryview], bytes], None] | None = None
        self._sink_error: Exception | None = None
        self._held = b""  # pushed raw bytes that may be the last chunk's size line
        self._buffered = 0
        self._paused = False
        self._done = False
        self._keep_alive = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._last_push = 0.0  # when the last read was pushed (`time.monotonic`)
        self.got_bytes = False

    @property
    def headers(self) -> list[tuple[str, str]]:
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self._raw_headers]

    def header(self, name: str) -> str:
        want = name.lower().encode()
        for k, v in self._raw_headers:
            if k.lower() == want:
                return v.decode("latin-1")
        return ""

    def _chunked(self) -> bool:
        return any(
            k.lower() == b"transfer-encoding" and v.strip().lower().endswith(b"chunked")
            for k, v in self._raw_headers
        )

    def _wake(self) -> None:
        self.got_bytes = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _received(self, nbytes: int) -> None:
        self._buffered += nbytes  # with the chunk framing: a bound, not a count
        if self._buffered > HIGH_WATER:
            self.pause_reading()
        self._wake()

    def _chunked_read(self, data: bytes | memoryview) -> None:
        """One read of a chunked body, framing included: given to the `push_to` sink at once,
        or kept for the reader (`chunks`) to de-chunk in its turn."""
        if self._sink is not None:
            self._push(data)
            return
        self._raw.append(data)
        self._received(len(data))

    def _complete(self, keep_alive: bool) -> None:
        self._done, self._keep_alive = True, keep_alive
        self._wake()

    def _fail(self, exc: UpstreamError) -> None:
        if not self._done:
            self._error = exc
        self._wake()

    async def _wait(self, timeout: float | None = None) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(self._waiter, self._timeout if timeout is None else timeout)
        except asyncio.TimeoutError:
            raise UpstreamError("upstream read timed out", timeout=True) from None
        finally:
            self._waiter = None

    async def _headers(self) -> None:
        while not self.status and self._error is None:
            await self._wait()
        if self._error is not None and not self.status:
            raise self._error

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (de-chunked); raises `UpstreamError` if it breaks off."""
        while True:
            if self._raw:
                body = self._dechunked()[1]
                if body:
                    yield body
                continue
            if self._chunks:
                # all that arrived since the last turn, as one piece: under load the relay's
                # per-piece work is paid once per many stream chunks
                if len(self._chunks) == 1:
                    chunk = self._chunks.popleft()
                else:
                    chunk = b"".join(self._chunks)
                    self._chunks.clear()
                self.resume_reading()
                yield chunk
                continue
            if self._done:
                return
            if self._error is not None:
                raise self._error
            await self._wait()

    @property
    def chunked(self) -> bool:
        """The body comes in chunked transfer coding (`push_to` can hand it on raw)."""
        return self._dechunker is not None

    def push_to(self, sink: Callable[[list[bytes | memoryview], bytes], None]) -> None:
        """Hand a chunked body to ``sink`` read by read, inside the connection's receive
        callback: the raw bytes a client can be sent as they are (framing kept; never the last
        chunk, ``0``, trailer and empty line: whoever relays writes its own) and the body bytes
        they carry. A read is de-chunked and given on at once, before the event loop reads
        the other connections' answers, which would evict it from the CPU's caches (a read
        that waited for its turn took 3x as long to de-chunk). Wait with `pushed`; reading
        pauses and resumes with `pause_reading` and `resume_reading`."""
        self._last_push = time.monotonic()
        self._sink = sink
        if self._raw:  # what arrived before the relay began
            self._push(None)

    def _push(self, data: bytes | memoryview | None) -> None:
        """One read (None: the reads kept so far, joined) de-chunked and given to the sink."""
        sink = self._sink
        assert sink is not None
        try:
            data, body, safe = self._dechunked(data, raw=True)
        except UpstreamError:
            self._wake()
            return
        held = self._held
        if safe < 0:  # a size line that may be the last chunk's, until it is known
            self._held = held + data
            pieces: list[bytes | memoryview] = []
        else:
            pieces = [held] if held else []
            pieces.append(data if safe == len(data) else memoryview(data)[:safe])
            self._held = bytes(data[safe:]) if safe < len(data) else b""
        try:
            sink(pieces, body)
        except Exception as exc:  # the relay's own failure: `pushed` raises it
            self._sink_error = exc
            self._conn.close()
        self._last_push = time.monotonic()
        if self._done or self._paused or self._sink_error is not None:
            # only then has the waiting relay something to do: an incremental stream arrives
            # about one frame per read, and waking it on every read cost a task step each
            self._wake()

    async def pushed(self) -> bool:
        """After `push_to`: wait until the body is complete (False) or a read paused reading
        (True: the relay resumes it when its client can take more). Reads that do neither
        are handed on without waking the caller. Raises `UpstreamError` if the body breaks
        off, its framing is broken or no read comes within the timeout (counted from the last
        read, not from the call), and what the sink raised."""
        if self._sink_error is not None:
            raise self._sink_error
        if self._done:
            return False
        if self._error is not None:
            raise self._error
        while True:
            since = self._last_push
            try:
                if self._timeout is None:
                    await self._wait()
                else:
                    await self._wait(max(self._timeout - (time.monotonic() - since), 0.0))
                break
            except UpstreamError as exc:
                if not exc.timeout or self._last_push == since:
                    raise
                # reads came while waiting: the timeout counts from the latest
        if self._sink_error is not None:
            raise self._sink_error
        if self._error is not None and not self._done:
            raise self._error
        return not self._done

    @property
    def reading_paused(self) -> bool:
        return self._paused

    def pause_reading(self) -> None:
        if not self._paused and self._conn.transport is not None:
            self._conn.transport.pause_reading()
            self._paused = True

    def _dechunked(
        self, data: bytes | memoryview | None = None, raw: bool = False
    ) -> tuple[bytes | memoryview, bytes, int]:
        dechunker = self._dechunker
        assert dechunker is not None
        if data is None:
            data = self._raw[0] if len(self._raw) == 1 else b"".join(self._raw)
            self._raw.clear()
            self.resume_reading()
        try:
            body, safe = dechunker.feed_raw(data) if raw else (dechunker.feed(data), 0)
        except DechunkError as exc:
            self._conn.close()
            self._error = UpstreamError(str(exc))
            raise self._error from None
        if dechunker.done and not self._done:
            self._done = True  # ``_keep_alive`` was set from the head
        return data, body, safe

    def resume_reading(self) -> None:
        self._buffered = 0
        if self._paused:
            self._paused = False
            if self._conn.transport is not None:
                self._conn.transport.resume_reading()

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        conn, self._conn.resp = self._conn, None
        if self._done and self._keep_alive and not conn.lost and self._error is None:
            self.resume_reading()  # a relay may have paused it on the last read
            self._owner._give_back(conn)
        else:
            conn.close()
