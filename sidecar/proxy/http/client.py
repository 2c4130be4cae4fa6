"""A lean HTTP/1.1 client for the proxy's ``/generate`` calls to SGLang: asyncio + httptools.

httpx costs more per request than the proxy's whole capture at engine speed (its connection
pool is scanned per request, so its cost grows with the number of connections, and without
``sniffio`` installed httpcore retries an import on every lock). This client keeps idle
keep-alive connections on a stack (O(1) to take and return; the most recent, likeliest alive,
first), writes each request in one send, and parses the status line and headers with
httptools. A chunked body (every stream) is not given to httptools, which calls back once per
HTTP chunk (once per token in an incremental stream): its raw reads are de-chunked in one
compiled pass each (`proxy.http.dechunk`), kept until the reader's turn, or, for a relay that asked
(`UpstreamResponse.push_to`), handed on in the read's own callback; other bodies go through
httptools.
A body is handed over as what arrived since the last turn, one piece, with backpressure
(reading pauses while more than `upstream_response.HIGH_WATER` bytes wait for the client).

A connection goes back to the stack only after its answer was read to the end and the
upstream allows keep-alive; one that dies while idle is noticed on the next request, which is
retried once on a fresh connection if nothing of its answer had arrived.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

from ....monitor.core.errors import UpstreamError
from .dechunk import Dechunker
from .response import UpstreamResponse

__all__ = ["Upstream", "UpstreamResponse", "UpstreamError"]

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
            resp._chunked_read(data)
            return
        body: bytes | memoryview = data
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
            body = memoryview(head)[end + 4 :]  # a slice would copy the first read's body
            if not body:
                return
            if resp is not None and resp._dechunker is not None:
                resp._chunked_read(body)
                return
        if self._feed(body) and resp is not None and resp._chunks:
            resp._received(len(body))  # once per read, however many body chunks it held

    def _feed(self, data: bytes | memoryview) -> bool:
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
