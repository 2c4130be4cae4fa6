"""Relaying an upstream's chunked event stream to the client as the upstream framed it.

An ASGI app hands its server body bytes, and the server frames them again: for a stream the
proxy did not change, that is de-chunking every upstream read and chunking it again, one
``send`` per read. When the proxy is served by uvicorn's httptools protocol (what
``timwatch sidecar`` runs), `RawStreamResponse` writes the response head through uvicorn, then
the upstream's raw chunks (framing kept, its last ``0`` chunk and trailer left out) straight to
the connection's transport, and lets uvicorn write the last chunk and finish the response, so
keep-alive and its state stay uvicorn's. Each upstream read is written and handed to the
capture (the de-chunked body; `relay.StreamReads` reads short ones together) in the callback
that received it (`UpstreamResponse.push_to`), and the capture is closed when the relay ends;
while uvicorn's flow control says the client's socket is full, the upstream is not read.

`ProxyApp` leaves uvicorn's own ``send`` in the scope; `uvicorn_cycle` accepts it only if it
is the bound ``send`` of uvicorn's httptools request cycle and the response has not started.
Anything else (another server, h11, a test client) takes the ordinary streaming path.
Invariants: the client receives exactly the upstream's bytes before its last chunk, then
``0\\r\\n\\r\\n`` (upstream trailers are not relayed); a client that goes away stops the relay
and closes the upstream connection (noticed when the next upstream bytes arrive or a write
waits on the client's full socket); every pause of the upstream is undone once the client's
socket drains, and the connection goes back to the pool reading; broken upstream framing
raises `UpstreamError` after the head went out, and uvicorn closes the client connection
(never reused).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .client import UpstreamResponse

__all__ = ["ProxyApp", "RawStreamResponse", "StreamSink", "uvicorn_cycle"]

_SEND = "timwatch.server_send"


class StreamSink(Protocol):
    """What a relayed stream's de-chunked body is fed to, read by read (`relay.StreamReads`);
    closed once when the relay ends, however it ends."""

    def __call__(self, body: bytes, /) -> None: ...

    def close(self) -> None: ...


class ProxyApp(Starlette):
    """A Starlette app that keeps its server's ``send`` in each HTTP scope (see `uvicorn_cycle`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[_SEND] = send
        await super().__call__(scope, receive, send)


def uvicorn_cycle(scope: Scope) -> Any | None:
    """uvicorn's httptools request cycle behind ``scope``, when the raw relay can use it."""
    try:
        from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
    except ImportError:  # pragma: no cover - uvicorn is a dependency
        return None
    send = scope.get(_SEND)
    cycle = getattr(send, "__self__", None)
    if type(cycle) is not RequestResponseCycle:
        return None
    if getattr(send, "__func__", None) is not RequestResponseCycle.send:
        return None
    if cycle.response_started or cycle.disconnected or scope.get("method") == "HEAD":
        return None
    return cycle


class RawStreamResponse(StreamingResponse):
    """A 200 chunked stream relayed raw when `uvicorn_cycle` allows, else as ``fallback``
    (the de-chunked body, relayed and captured by the caller's generator).

    ``capture`` makes the sink the de-chunked body is fed to, read by read, after the bytes
    it came in were handed to the client's transport, and closed when the relay ends;
    ``counters["raw_streams"]`` counts the streams relayed raw."""

    def __init__(
        self,
        upstream: UpstreamResponse,
        fallback: AsyncIterator[bytes],
        capture: Callable[[], StreamSink],
        *,
        status_code: int,
        headers: Mapping[str, str],
        counters: dict[str, int] | None = None,
    ) -> None:
        super().__init__(fallback, status_code=status_code, headers=headers)
        self.upstream, self.capture, self.counters = upstream, capture, counters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cycle = uvicorn_cycle(scope) if self.upstream.chunked else None
        if cycle is None:
            await super().__call__(scope, receive, send)
            return
        feed = self.capture()
        upstream = self.upstream
        if self.counters is not None:
            self.counters["raw_streams"] = self.counters.get("raw_streams", 0) + 1
        try:
            head = {"status": self.status_code, "headers": self.raw_headers}
            await send({"type": "http.response.start", **head})
            if not cycle.chunked_encoding:  # cannot happen: no length header is passed on
                raise RuntimeError("uvicorn did not choose chunked encoding for a stream")
            transport, flow = cycle.transport, cycle.flow

            def relay(pieces: list[bytes | memoryview], body: bytes) -> None:
                # runs in the upstream connection's receive callback (`push_to`)
                if cycle.disconnected:
                    upstream.pause_reading()  # the client went away: closed below
                    return
                for piece in pieces:
                    transport.write(piece)
                if body:
                    feed(body)
                if flow.write_paused:
                    upstream.pause_reading()

            upstream.push_to(relay)
            while True:
                if cycle.disconnected:
                    return  # the upstream connection is closed below
                if upstream.reading_paused:
                    # `relay` paused it on a full client socket, maybe before this loop ran;
                    # the socket may have drained since (``write_paused`` already false): a
                    # pause is always undone here, or nothing would wake this loop again
                    await flow.drain()
                    if cycle.disconnected:
                        return
                    upstream.resume_reading()
                if not await upstream.pushed():
                    break
        finally:
            upstream.release()
            feed.close()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
