"""A lean HTTP/1.1 client for the proxy's ``/generate`` calls to SGLang: asyncio + httptools.

httpx costs more per request than the proxy's whole capture at engine speed (its connection
pool is scanned per request, so its cost grows with the number of connections, and without
``sniffio`` installed httpcore retries an import on every lock). This client keeps idle
keep-alive connections on a stack (O(1) to take and return; the most recent, likeliest alive,
first), writes each request in one send, and parses the status line and headers with
httptools. A chunked body (every stream) is not given to httptools, which calls back once per
HTTP chunk (once per token in an incremental stream): its raw reads are de-chunked in one
compiled pass each (`proxy.dechunk`), kept until the reader's turn, or, for a relay that asked
(`UpstreamResponse.push_to`), handed on in the read's own callback; other bodies go through
httptools.
A body is handed over as what arrived since the last turn, one piece, with backpressure
(reading pauses while more than `_HIGH_WATER` bytes wait for the client).

A connection goes back to the stack only after its answer was read to the end and the
upstream allows keep-alive; one that dies while idle is noticed on the next request, which is
retried once on a fresh connection if nothing of its answer had arrived.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

from timwatch.monitor.core.errors import UpstreamError
from timwatch.sidecar.proxy.dechunk import Dechunker, DechunkError

__all__ = ["Upstream", "UpstreamResponse", "UpstreamError"]

_HIGH_WATER = 1 << 20
_MAX_HEAD = 1 << 16


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: UpstreamResponse | None = None
        self.lost = False
        self._head = b""  # the status line and headers so far, until they are complete
        self._in_body = False

    def start(self, resp: UpstreamResponse) -> None:
        """Expect the answer to a request just sent (a fresh parser per answer)."""
        self.resp = resp
        self.parser = httptools.HttpResponseParser(self)
        self._head, self._in_body = b"", False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.resp is not None:
            self.resp._fail(UpstreamError(f"upstream closed the connection: {exc or 'EOF'}"))

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is not None and resp._dechunker is not None:
            if resp._sink is not None:
                resp._push(data)
                return
            resp._raw.append(data)  # a chunked body: de-chunked by the reader, per turn
            resp._received(len(data))
            return
        if not self._in_body:
            # the head goes to httptools alone, so a chunked body can be taken raw after it
            head = self._head + data if self._head else data
            end = head.find(b"\r\n\r\n")
            if end < 0:
                self._head = head
                if len(head) > _MAX_HEAD:
                    self._bad("response head too long")
                return
            self._head, self._in_body = b"", True
            if not self._feed(head[: end + 4]):
                return
            data = head[end + 4 :]
            if not data:
                return
            if resp is not None and resp._dechunker is not None:
                self.data_received(data)
                return
        if self._feed(data) and resp is not None and resp._chunks:
            resp._received(len(data))  # once per read, however many body chunks it held

    def _feed(self, data: bytes) -> bool:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._bad(f"bad HTTP from upstream: {exc}")
            return False
        return True

    def _bad(self, why: str) -> None:
        if self.resp is not None:
            self.resp._fail(UpstreamError(why))
        self.close()

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.resp is not None:
            self.resp._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp is not None:
            resp.status = self.parser.get_status_code()
            if resp.status >= 200 and resp.status not in (204, 304) and resp._chunked():
                resp._dechunker = Dechunker()
                resp._keep_alive = self.parser.should_keep_alive()
            resp._wake()

    def on_body(self, body: bytes) -> None:
        # called once per HTTP chunk (one per stream frame): kept to the append
        if self.resp is not None:
            self.resp._chunks.append(body)

    def on_message_complete(self) -> None:
        if self.resp is not None:
            self.resp._complete(self.parser.should_keep_alive())


class UpstreamResponse:
    """One answer: ``status`` and ``headers`` once `Upstream.request` returns, then the body
    by `read` or `chunks`. `release` must be called when done (it closes an unread one)."""

    def __init__(self, owner: Upstream, conn: _Conn, timeout_s: float | None) -> None:
        self.status = 0
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._owner, self._conn, self._timeout = owner, conn, timeout_s
        self._chunks: collections.deque[bytes] = collections.deque()
        self._raw: list[bytes] = []  # reads of a chunked body, not yet de-chunked
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
        if self._buffered > _HIGH_WATER:
            self.pause_reading()
        self._wake()

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

    def _push(self, data: bytes | None) -> None:
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
            self._held = data[safe:] if safe < len(data) else b""
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

    def _dechunked(self, data: bytes | None = None, raw: bool = False) -> tuple[bytes, bytes, int]:
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


class Upstream:
    """Keep-alive connections to one ``http://host:port`` base URL."""

    def __init__(self, base_url: str, *, timeout_s: float | None, max_idle: int = 4096) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http:// URL, got {base_url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc.encode()
        self.timeout_s = timeout_s
        self.max_idle = max_idle
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Conn, self.host, self.port),
                min(self.timeout_s or 10.0, 10.0),
            )
        except asyncio.TimeoutError:
            raise UpstreamError("connect timed out", timeout=True) from None
        except OSError as exc:
            raise UpstreamError(f"connect failed: {exc}") from None
        return conn

    async def request(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send one request (``target`` is path and query); returns once headers arrived.
        ``sent`` is called once the request is written, while the upstream works on it."""
        head = [f"{method} {self.prefix}{target} HTTP/1.1\r\n".encode("latin-1")]
        head.append(b"host: " + self.host_header + b"\r\n")
        for k, v in headers:
            head.append(f"{k}: {v}\r\n".encode("latin-1"))
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        data = b"".join(head) + body
        for attempt in (0, 1):
            conn = self._take_idle()
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            assert conn.transport is not None
            resp = UpstreamResponse(self, conn, self.timeout_s)
            conn.start(resp)
            conn.transport.write(data)
            if sent is not None:
                sent()
                sent = None
            try:
                await resp._headers()
            except UpstreamError as exc:
                conn.resp = None
                conn.close()
                if reused and attempt == 0 and not resp.got_bytes and not exc.timeout:
                    continue  # the upstream closed this idle connection as we sent: once more
                raise
            return resp
        raise UpstreamError("upstream closed the connection")

    def _take_idle(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.lost and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    def _give_back(self, conn: _Conn) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
