"""Writing an upstream answer's body to the client as it arrives, through public ASGI.

`UpstreamStream` sends the head, then each `UpstreamResponse.next` piece (all that arrived
since the last send, de-chunked) as one ``http.response.body`` message with ``more_body``, so
the server frames it for its own client (uvicorn: chunked, or as is under the upstream's
``content-length``). Invariants: the client gets the upstream's body bytes in order (through
``transform`` when the proxy rewrites them), then the end of the body; while the client's
socket is full, ``send`` waits and the upstream stops being read once `client.HIGH_WATER`
bytes wait; a client that goes away (``http.disconnect``) stops the relay and closes the
upstream connection; an upstream that breaks off after the head went out ends the response
without its end (the server closes the client's connection before the last chunk, or short of
its ``content-length``: an incomplete body to any HTTP client, never a clean-looking one), is
logged and counted in ``partial_streams`` and ``upstream_errors``. The upstream connection is
released whichever way the relay ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .client import UpstreamError, UpstreamResponse

__all__ = ["ProxyApp", "RawStream", "StreamSink", "UpstreamStream", "uvicorn_cycle"]

log = logging.getLogger(__name__)

_SEND = "timwatch.server_send"
# The uvicorn versions whose httptools request cycle `RawStream` was tested on: pyproject pins
# uvicorn to them, and tests/unit/test_uvicorn_pin.py fails when the installed one leaves them
# or the attributes below change.
UVICORN_TESTED = (0, 55)
CYCLE_ATTRIBUTES = ("transport", "flow", "disconnected", "response_started", "chunked_encoding")


class StreamSink(Protocol):
    """What a relayed body is fed to after each piece went to the client (`relay.StreamReads`);
    closed once when the relay ends, however it ends."""

    def __call__(self, body: bytes, /) -> None: ...

    def close(self) -> None: ...


class UpstreamStream(Response):
    """The rest of ``upstream``'s answer relayed to the client as it arrives.

    ``transform`` rewrites the body pieces (a proxy's stream capture that changes bytes);
    without it each piece goes out as it came and is then fed to ``sink``, if any.
    ``counters`` (a `ProxyState`'s) gets ``partial_streams`` and ``upstream_errors`` for a body
    that broke off."""

    def __init__(
        self,
        upstream: UpstreamResponse,
        *,
        status_code: int,
        headers: Mapping[str, str],
        counters: dict[str, int],
        transform: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]] | None = None,
        sink: StreamSink | None = None,
    ) -> None:
        # not Response.__init__: it would give the head a content-length for an empty body
        self.status_code, self.background = status_code, None
        self.init_headers(headers)
        self.upstream, self.transform, self.sink = upstream, transform, sink
        self.counters = counters
        self.client_gone = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        upstream = self.upstream
        watch = asyncio.get_running_loop().create_task(self._watch(receive))
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            if self.transform is not None:
                async for changed in self.transform(upstream.chunks()):
                    await send({"type": "http.response.body", "body": changed, "more_body": True})
            else:
                sink = self.sink
                while (piece := await upstream.next()) is not None:
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                    if sink is not None:
                        sink(piece)
        except UpstreamError as exc:
            if not self.client_gone:
                self._broke_off(exc)
            return  # no end of the body: the server closes the client's connection short
        finally:
            watch.cancel()
            upstream.release()
            if self.sink is not None:
                self.sink.close()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _broke_off(self, exc: UpstreamError) -> None:
        self.counters["upstream_errors"] += 1
        self.counters["partial_streams"] += 1
        log.warning("upstream answer broke off after its head was relayed: %s", exc)

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.client_gone = True
        self.upstream.failed(UpstreamError("the client went away"))


class ProxyApp(Starlette):
    """A Starlette app that keeps its server's ``send`` in each HTTP scope (see `uvicorn_cycle`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[_SEND] = send
        await super().__call__(scope, receive, send)


def uvicorn_cycle(scope: Scope) -> Any | None:
    """uvicorn's httptools request cycle behind ``scope``, when `RawStream` can use it: the
    server's own ``send`` is the bound ``send`` of a ``RequestResponseCycle`` of a tested
    uvicorn (`UVICORN_TESTED`) that has not started its response."""
    try:
        import uvicorn
        from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
    except ImportError:  # pragma: no cover - uvicorn is a dependency
        return None
    if tuple(int(x) for x in uvicorn.__version__.split(".")[:2]) != UVICORN_TESTED:
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


class RawStream(UpstreamStream):
    """A 200 chunked stream relayed with the upstream's own chunk framing when `uvicorn_cycle`
    allows and the body is `UpstreamResponse.raw`; else `UpstreamStream` (public ASGI).

    An ASGI app hands its server body bytes and the server frames them again: for a stream the
    proxy did not change, that is a copy of every byte and a task step per upstream read. Here
    the head goes out through uvicorn, each upstream read's bytes (its last ``0`` chunk and
    trailer left out) are written to the client's transport and fed to ``sink`` in the
    connection's receive callback (`UpstreamResponse.push_to`), and uvicorn writes the last
    chunk and finishes the response, so keep-alive and its state stay uvicorn's. While
    uvicorn's flow control says the client's socket is full, the upstream is not read.
    ``counters["raw_streams"]`` counts the streams relayed this way."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cycle = uvicorn_cycle(scope) if self.upstream.raw and self.sink is not None else None
        if cycle is None:
            await super().__call__(scope, receive, send)
            return
        feed, upstream = self.sink, self.upstream
        assert feed is not None
        self.counters["raw_streams"] += 1
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
                if not await upstream.pushed():
                    break
                # `relay` paused reading on a full client socket (or the client left); the
                # socket may have drained since: a pause is always undone here
                await flow.drain()
                if cycle.disconnected:
                    return
                upstream.resume_reading()
        except UpstreamError as exc:
            self._broke_off(exc)
            return  # no last chunk: uvicorn closes the client's connection
        finally:
            upstream.release()
            feed.close()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
