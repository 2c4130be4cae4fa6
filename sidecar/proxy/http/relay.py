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
from typing import Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .client import UpstreamError, UpstreamResponse

__all__ = ["StreamSink", "UpstreamStream"]

log = logging.getLogger(__name__)


class StreamSink(Protocol):
    """What a relayed body is fed to after each piece went to the client (`relay.StreamReads`);
    closed once when the relay ends, however it ends."""

    def __call__(self, body: bytes, /) -> None: ...

    def close(self) -> None: ...


class UpstreamStream(Response):
    """The rest of ``upstream``'s answer relayed to the client as it arrives.

    ``transform`` rewrites the body pieces (a proxy's stream capture that changes bytes);
    without it each piece goes out as it came and is then fed to ``sink``, if any.
    ``counters`` gets ``partial_streams`` and ``upstream_errors`` for a body that broke off."""

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
                async for piece in self.transform(upstream.chunks()):
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
            else:
                sink = self.sink
                while (piece := await upstream.next()) is not None:
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                    if sink is not None:
                        sink(piece)
        except UpstreamError as exc:
            if self.client_gone:
                return
            self.counters["upstream_errors"] = self.counters.get("upstream_errors", 0) + 1
            self.counters["partial_streams"] = self.counters.get("partial_streams", 0) + 1
            log.warning("upstream answer broke off after its head was relayed: %s", exc)
            return  # no end of the body: the server closes the client's connection short
        finally:
            watch.cancel()
            upstream.release()
            if self.sink is not None:
                self.sink.close()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.client_gone = True
        self.upstream.failed(UpstreamError("the client went away"))
