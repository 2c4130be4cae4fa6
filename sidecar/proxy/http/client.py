"""The proxies' one HTTP/1.1 client to their engine: asyncio + httptools (llhttp).

Every upstream call goes through `Upstream.request`: relayed paths, planned ``/generate`` and
vLLM calls, the prefill probe. httpx cost more per request than the proxy's whole capture at
engine speed; this client keeps idle keep-alive connections on a stack (O(1) to take and
return, the most recent first), writes a request in one send, and lets llhttp parse each
response head and check each body's framing.

Every framing RFC 9112 §6.3 allows is read to its end: no body (a ``HEAD`` request, 1xx, 204,
304), ``Content-Length``, chunked (extensions and trailers too) and close-delimited (neither
header: the body ends when the upstream closes the connection, which then is the answer's
normal end, not an error). Interim 1xx answers (100, 103) are skipped to the final one. A
chunked body is de-chunked by the C pass (`proxy.http.dechunk`) read by read where it was built,
else by llhttp. A connection goes back to the stack only when its answer was read to the end
and llhttp says the upstream keeps it open (HTTP/1.1 without ``Connection: close``, HTTP/1.0
with ``Connection: keep-alive``, a body that did not end at EOF); any other is closed. An idle
connection that died is noticed on the next request, which is retried once on a fresh
connection when nothing of its answer arrived and its body can be sent again.

Failures are `UpstreamError`: connect failures and broken answers, or ``timeout=True`` when
the upstream was slower than ``timeout_s`` (connecting, or between two reads).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

from ....monitor.core.errors import UpstreamError
from . import dechunk

__all__ = ["HIGH_WATER", "Upstream", "UpstreamError", "UpstreamResponse"]

# Bytes of a body that may wait for the reader before the connection stops reading.
HIGH_WATER = 1 << 20
_MAX_HEAD = 1 << 16
_NO_BODY = (204, 304)


class UpstreamResponse:
    """One final answer: ``status`` and ``headers`` once `Upstream.request` returns, then its
    body by `next`, `chunks` or `read`. `release` must be called when done: the connection
    goes back to the pool only if the body was read to its end and the upstream allows it."""

    def __init__(self, conn: _Conn, timeout_s: float | None) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.done = False  # the body was received to its end
        self.got_bytes = False  # anything of the answer arrived
        self.keep_alive = False
        self._conn, self._timeout = conn, timeout_s
        self._body: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        # a chunked body on the C pass, until its reader chose `next` or `push_to`: the raw
        # reads and how far each may be relayed as it is
        self._raw: list[tuple[bytes, int]] | None = None
        self._sink: Callable[[list[bytes | memoryview], bytes], None] | None = None
        self._sink_error: Exception | None = None
        self._held = b""  # raw bytes that may be the last chunk's size line
        self._last_push = 0.0

    def header(self, name: str) -> str:
        """The first value of header ``name`` (any case), or ``""``."""
        want = name.lower()
        for k, v in self.headers:
            if k.lower() == want:
                return v
        return ""

    # the connection's side
    def started(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.status, self.headers = status, headers
        if self._conn.dechunker is not None:
            self._raw = []
        self._wake()

    def received(self, body: bytes) -> None:
        if body:
            self._body.append(body)
            self._buffered += len(body)
            if self._buffered > HIGH_WATER:
                self._conn.pause_reading()
            self._wake()

    def raw_received(self, data: bytes | memoryview, body: bytes, safe: int) -> None:
        """One read of a chunked body on the C pass: ``data`` as it came, the ``body`` it
        carries, how much of it may be relayed as it is (`dechunk.Dechunker.feed`)."""
        if self._sink is not None:
            self._push(data, body, safe)
            return
        if self._raw is not None:
            self._raw.append((bytes(data), safe))
        self.received(body)

    def finished(self, keep_alive: bool) -> None:
        if not self.done and self._error is None:
            self.done, self.keep_alive = True, keep_alive
            self._wake()

    def failed(self, exc: UpstreamError) -> None:
        if not self.done and self._error is None:
            self._error = exc
            self._wake()

    def _wake(self) -> None:
        self.got_bytes = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, timeout: float | None = None) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(self._waiter, self._timeout if timeout is None else timeout)
        except asyncio.TimeoutError:
            raise UpstreamError("upstream read timed out", timeout=True) from None
        finally:
            self._waiter = None

    # the reader's side
    async def head(self) -> None:
        """Wait for the final answer's status and headers; raises `UpstreamError`."""
        while not self.status:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def next(self) -> bytes | None:
        """All body bytes that arrived since the last call, waiting for some; None once the
        body ended. Raises `UpstreamError` if it broke off or no read came within the timeout
        (counted from the call)."""
        self._raw = None
        while True:
            body = self._body
            if body:
                piece = body.popleft() if len(body) == 1 else b"".join(body)
                body.clear()
                self._buffered = 0
                self._conn.resume_reading()
                return piece
            if self.done:
                return None
            if self._error is not None:
                raise self._error
            await self._wait()

    @property
    def raw(self) -> bool:
        """The body is chunked, on the C pass, and nothing of it was read yet: `push_to` can
        hand it on with its framing."""
        return self._raw is not None

    def push_to(self, sink: Callable[[list[bytes | memoryview], bytes], None]) -> None:
        """Hand a `raw` body to ``sink`` read by read, inside the connection's receive
        callback: the raw bytes a client can be sent as they are (framing kept; never the last
        chunk, ``0``, trailer and empty line: whoever relays writes its own) and the body bytes
        they carry. A read is given on at once, while it is in the CPU's caches, and the caller
        is woken only when the body ends, fails or reading paused (`pushed`)."""
        assert self._raw is not None, "push_to needs a raw body not read yet"
        kept, self._raw = self._raw, None
        self._sink, self._last_push = sink, time.monotonic()
        if kept:  # what arrived before: its body is in `_body` already
            body = b"".join(self._body)
            self._body.clear()
            self._buffered = 0
            for i, (data, safe) in enumerate(kept):
                self._push(data, body if i == len(kept) - 1 else b"", safe)

    def _push(self, data: bytes | memoryview, body: bytes, safe: int) -> None:
        held = self._held
        if safe < 0:  # a size line that may be the last chunk's, until it is known
            self._held = held + data
            pieces: list[bytes | memoryview] = []
        else:
            pieces = [held] if held else []
            pieces.append(data if safe == len(data) else memoryview(data)[:safe])
            self._held = bytes(data[safe:]) if safe < len(data) else b""
        assert self._sink is not None
        try:
            self._sink(pieces, body)
        except Exception as exc:  # the relay's own failure: `pushed` raises it
            self._sink_error = exc
            self._conn.close()
        self._last_push = time.monotonic()
        if self._sink_error is not None or self._conn.paused:
            self._wake()  # else the relay has nothing to do: waking it per read cost a step

    async def pushed(self) -> bool:
        """After `push_to`: wait until the body is complete (False) or reading paused (True:
        resume it with `Upstream`'s connection when the client can take more). Raises
        `UpstreamError` if the body breaks off or no read comes within the timeout (counted
        from the last read), and what the sink raised."""
        while True:
            if self._sink_error is not None:
                raise self._sink_error
            if self.done:
                return False
            if self._error is not None:
                raise self._error
            if self._conn.paused:
                return True
            since = self._last_push
            left = None if self._timeout is None else self._timeout - (time.monotonic() - since)
            try:
                await self._wait(None if left is None else max(left, 0.0))
            except UpstreamError as exc:
                if not exc.timeout or self._last_push == since:
                    raise  # reads that came meanwhile restart the timeout

    def pause_reading(self) -> None:
        self._conn.pause_reading()

    def resume_reading(self) -> None:
        self._conn.resume_reading()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (`next` until the end)."""
        while (piece := await self.next()) is not None:
            yield piece

    async def read(self) -> bytes:
        parts = [piece async for piece in self.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Give the connection back (a whole answer the upstream keeps open) or close it."""
        self._conn.finish(reuse=self.done and self.keep_alive)


class _Conn(asyncio.Protocol):
    """One connection: reads one answer at a time into its `UpstreamResponse`."""

    def __init__(self, pool: Upstream) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.resp: UpstreamResponse | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._head = b""  # a response head so far, until it is complete
        self._headers: list[tuple[str, str]] = []
        self._no_body = False  # the request was HEAD
        self._in_body = False  # the body goes to llhttp
        self.dechunker: dechunk.Dechunker | None = None  # the body goes to the C pass
        self._until_eof = False  # close-delimited
        self._keep_alive = False
        self.paused = False  # reading paused (`pause_reading`): a reader or the client is behind
        self._drained: asyncio.Future[None] | None = None

    def start(self, resp: UpstreamResponse, *, head_request: bool) -> None:
        """Expect the answer to a request about to be sent (a fresh parser per answer)."""
        self.resp, self._no_body = resp, head_request
        self._parser = httptools.HttpResponseParser(self)
        self._head, self._headers, self._in_body, self.dechunker = b"", [], False, None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        resp = self.resp
        if resp is None:
            return
        if self._in_body and self._until_eof and exc is None:
            resp.finished(keep_alive=False)  # RFC 9112 §6.3: the body ends at EOF
        else:
            why = f"{exc}" if exc is not None else "EOF before the answer ended"
            resp.failed(UpstreamError(f"upstream closed the connection: {why}"))

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    async def drain(self) -> None:
        if self._drained is not None:
            await self._drained

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None:
            self.close()  # bytes nobody asked for: the connection's state is unknown
        elif self.dechunker is not None:
            self._dechunked(resp, data)
        elif self._in_body:
            self._feed(data)
        else:
            self._head_received(resp, data)

    def _head_received(self, resp: UpstreamResponse, data: bytes) -> None:
        head = self._head + data if self._head else data
        at = 0
        while not resp.status:  # interim (1xx) answers are skipped
            end = head.find(b"\r\n\r\n", at)
            if end < 0:
                self._head = head[at:]
                if len(self._head) > _MAX_HEAD:
                    self._bad("response head too long")
                return
            if not self._feed(memoryview(head)[at : end + 4]):
                return
            at = end + 4
        self._head = b""
        rest = memoryview(head)[at:]  # not a slice: that would copy the first read's body
        if self.dechunker is not None:
            if rest:
                self._dechunked(resp, rest)
        elif self._no_body or resp.status in _NO_BODY:
            # bytes after a body-less answer: nothing asked for them, the connection is spent
            resp.finished(self._keep_alive and not rest)
        else:
            self._in_body = True
            if rest:
                self._feed(rest)

    def _dechunked(self, resp: UpstreamResponse, data: bytes | memoryview) -> None:
        assert self.dechunker is not None
        try:
            body, safe = self.dechunker.feed(data)
            resp.raw_received(data, body, safe)
        except dechunk.DechunkError as exc:
            self._bad(str(exc))
            return
        if self.dechunker.done:
            resp.finished(self._keep_alive)

    def _feed(self, data: bytes | memoryview) -> bool:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._bad(f"bad HTTP from upstream: {exc}")
            return False
        return True

    def _bad(self, why: str) -> None:
        if self.resp is not None:
            self.resp.failed(UpstreamError(why))
        self.close()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status, headers, self._headers = self._parser.get_status_code(), self._headers, []
        assert self.resp is not None
        if self.resp.status:  # a second answer: nothing was asked for it
            raise httptools.HttpParserError("bytes after the answer's end")
        if status < 200:
            if status == 101:  # never asked for: the connection now speaks something else
                raise httptools.HttpParserError("101 Switching Protocols without an upgrade")
            return
        self._keep_alive = self._parser.should_keep_alive()
        names = {k.lower(): v for k, v in headers}
        coding = names.get("transfer-encoding", "").strip().lower()
        self._until_eof = not coding.endswith("chunked") and "content-length" not in names
        if coding and not coding.endswith("chunked"):
            self._until_eof = True  # RFC 9112 §6.3 rule 4: not chunked, read to EOF
        body = not self._no_body and status not in _NO_BODY
        if body and coding.endswith("chunked") and dechunk.available():
            self.dechunker = dechunk.Dechunker()
        self.resp.started(status, headers)

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp.received(body)

    def on_message_complete(self) -> None:
        resp = self.resp
        if resp is not None and resp.status and not self._no_body and resp.status not in _NO_BODY:
            resp.finished(self._keep_alive)

    # flow control and the end of an answer
    def pause_reading(self) -> None:
        if not self.paused and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True

    def resume_reading(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def finish(self, *, reuse: bool) -> None:
        """The answer was handed over: back to the pool when ``reuse``, else closed."""
        self.resp = None
        if reuse and not self.lost:
            self.resume_reading()
            self.pool.give_back(self)
        else:
            self.close()

    def reusable(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class Upstream:
    """Keep-alive connections to one ``http://host:port[/prefix]`` base URL."""

    def __init__(self, base_url: str, *, timeout_s: float | None, max_idle: int = 4096) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http:// URL, got {base_url!r}")
        self.url = base_url.rstrip("/")
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
                loop.create_connection(lambda: _Conn(self), self.host, self.port),
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
        body: bytes | AsyncIterable[bytes] = b"",
        *,
        length: int | None = None,
        sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send one request (``target`` is path and query; ``headers`` without ``host``,
        ``content-length`` and ``transfer-encoding``, which this adds) and return once the
        final answer's head arrived. An iterable ``body`` is streamed, with ``length`` as its
        ``content-length`` or chunked without it. ``sent`` is called once the request is
        written, while the upstream works on it."""
        head = [f"{method} {self.prefix}{target} HTTP/1.1\r\n".encode("latin-1")]
        head.append(b"host: " + self.host_header + b"\r\n")
        for k, v in headers:
            head.append(f"{k}: {v}\r\n".encode("latin-1"))
        whole = isinstance(body, bytes)
        if isinstance(body, bytes):
            head.append(b"content-length: %d\r\n\r\n" % len(body))
            data = b"".join(head) + body
        elif length is not None:
            data = b"".join(head) + b"content-length: %d\r\n\r\n" % length
        else:
            data = b"".join(head) + b"transfer-encoding: chunked\r\n\r\n"
        for attempt in (0, 1):
            conn = self._take_idle()
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            resp = UpstreamResponse(conn, self.timeout_s)
            conn.start(resp, head_request=method == "HEAD")
            assert conn.transport is not None
            conn.transport.write(data)
            try:
                if not isinstance(body, bytes):
                    await self._stream(conn, body, chunked=length is None)
                if sent is not None:
                    sent()
                    sent = None
                await resp.head()
            except BaseException as exc:
                conn.finish(reuse=False)
                if (
                    isinstance(exc, UpstreamError)
                    and reused
                    and whole
                    and attempt == 0
                    and not resp.got_bytes
                    and not exc.timeout
                ):
                    continue  # the upstream closed this idle connection as we sent: once more
                raise
            return resp
        raise UpstreamError("upstream closed the connection")

    @staticmethod
    async def _stream(conn: _Conn, body: AsyncIterable[bytes], *, chunked: bool) -> None:
        assert conn.transport is not None
        async for piece in body:
            if conn.lost:
                break  # its answer (or failure) arrived already: `head` says which
            if piece:
                conn.transport.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                await conn.drain()
        if chunked and not conn.lost:
            conn.transport.write(b"0\r\n\r\n")

    def _take_idle(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable():
                return conn
        return None

    def give_back(self, conn: _Conn) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
