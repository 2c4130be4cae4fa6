"""What the SGLang and vLLM proxies share: forwarding a request untouched, forwarding a
planned (rewritten) request and answering with what the client asked for, the header filters,
the answers for upstream failures, and the debug endpoints both serve.

Invariants: hop-by-hop headers never cross the proxy in either direction; ``date`` and
``server`` of the upstream are dropped (uvicorn writes its own); an upstream failure is a 502
(504 on a timeout) with a JSON ``error.message`` naming the upstream; a non-200 answer is
passed back with its status, headers and body unchanged. The proxy state is a protocol
(`proxy.sglang.app.ProxyState` satisfies it) so this module imports neither proxy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..capture import CaptureStore
from .client import Upstream, UpstreamError, UpstreamResponse
from .rawrelay import RawStreamResponse, StreamSink

__all__ = [
    "ALL_METHODS",
    "DeferredCaptures",
    "counters",
    "settle_captures",
    "forward_planned",
    "healthz",
    "passthrough",
    "relay",
    "upstream_clients",
]

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)
# uvicorn writes its own; forwarding the upstream's would duplicate them.
RESPONSE_DROP = HOP_BY_HOP | {"date", "server"}
ALL_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]

log = logging.getLogger(__name__)


class DeferredCaptures:
    """Captures of answers already sent, run off the response path.

    A capture waits until the next planned request has been written upstream (the engine then
    computes its answer while the proxy captures), at most ``delay_s`` when no request comes,
    and never past `flush`, which every reader of the capture store calls first; with more
    than ``max_pending`` waiting, the newest runs at once. So a record is in the store before
    anyone can look for it, and the bytes waiting are bounded (``max_pending`` answers)."""

    def __init__(self, *, delay_s: float = 0.02, max_pending: int = 64) -> None:
        self.delay_s, self.max_pending = delay_s, max_pending
        self._pending: list[Callable[[], None]] = []
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, capture: Callable[[], None]) -> None:
        self._pending.append(capture)
        if len(self._pending) > self.max_pending:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.delay_s, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            pending, self._pending = self._pending, []
            for capture in pending:
                try:
                    capture()
                except Exception:  # a capture must never take the proxy down
                    log.exception("deferred capture failed")


def settle_captures(state: ProxyState) -> None:
    """Run the captures still deferred: every reader of the capture store calls this first."""
    if state.deferred is not None:
        state.deferred.flush()


class ProxyState(Protocol):
    """What this module reads of a proxy's state (`proxy.sglang.app.ProxyState` has it all)."""

    upstream: str
    capture: CaptureStore
    counters: dict[str, int]
    timeout: httpx.Timeout
    timeout_s: float | None
    client: httpx.AsyncClient | None
    generate_upstream: Upstream | None
    deferred: DeferredCaptures | None

    def http(self) -> httpx.AsyncClient: ...

    def generate_client(self) -> Upstream: ...


@asynccontextmanager
async def upstream_clients(state: ProxyState) -> AsyncIterator[httpx.AsyncClient]:
    """Open the proxy's two upstream clients (httpx for relays and probes, `Upstream` for
    planned requests) on ``state`` for the app's lifetime; closed and unset on exit."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=state.timeout, limits=limits) as client:
        state.client = client
        state.generate_upstream = Upstream(state.upstream, timeout_s=state.timeout_s)
        yield client
        settle_captures(state)
        await state.generate_upstream.aclose()
        state.client = state.generate_upstream = None


def _request_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}


def _response_headers(resp: httpx.Response, *, keep_length: bool) -> dict[str, str]:
    drop = RESPONSE_DROP if keep_length else RESPONSE_DROP | {"content-length"}
    return {k: v for k, v in resp.headers.items() if k.lower() not in drop}


def _target(state: ProxyState, request: Request, path: str) -> str:
    query = request.url.query
    return f"{state.upstream}{path}" + (f"?{query}" if query else "")


def _gateway_error(exc: httpx.HTTPError, upstream: str) -> Response:
    status = 504 if isinstance(exc, httpx.TimeoutException) else 502
    message = f"timwatch sidecar: upstream {upstream} failed: {type(exc).__name__}: {exc}"
    return JSONResponse({"error": {"message": message}}, status_code=status)


async def relay(state: ProxyState, request: Request, content: Any, path: str) -> Response:
    """Forward one request untouched and stream the upstream's answer back untouched."""
    client = state.http()
    req = client.build_request(
        request.method,
        _target(state, request, path),
        headers=_request_headers(request),
        content=content,
    )
    try:
        resp = await client.send(req, stream=True)
    except httpx.HTTPError as exc:
        state.counters["upstream_errors"] += 1
        return _gateway_error(exc, state.upstream)
    return StreamingResponse(
        resp.aiter_raw(),
        status_code=resp.status_code,
        headers=_response_headers(resp, keep_length=True),
        background=BackgroundTask(resp.aclose),
    )


async def passthrough(request: Request) -> Response:
    state: ProxyState = request.app.state.proxy
    return await relay(state, request, request.stream(), request.url.path)


async def _run_now(capture: Callable[[], None]) -> None:
    # async, so Starlette runs it in the request's own task right after the last byte is
    # written, before the loop serves anything else (a sync one would go to a thread)
    try:
        capture()
    except Exception:  # as in `DeferredCaptures`: uvicorn would close the client's connection
        log.exception("capture failed")


def _planned_headers(request: Request) -> list[tuple[str, str]]:
    # The proxy parses the answers to planned requests, so it asks for them uncompressed.
    drop = HOP_BY_HOP | {"accept-encoding", "content-length"}
    return [(k, v) for k, v in request.headers.items() if k.lower() not in drop]


def _answer_headers(resp: UpstreamResponse, keep_length: bool) -> dict[str, str]:
    drop = RESPONSE_DROP if keep_length else RESPONSE_DROP | {"content-length"}
    return {k: v for k, v in resp.headers if k.lower() not in drop}


def _upstream_error(exc: UpstreamError, upstream: str) -> Response:
    message = f"timwatch sidecar: upstream {upstream} failed: {exc}"
    return JSONResponse({"error": {"message": message}}, status_code=504 if exc.timeout else 502)


async def _closing(chunks: AsyncIterator[bytes], resp: UpstreamResponse) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        resp.release()


async def forward_planned(
    state: ProxyState,
    request: Request,
    content: bytes,
    *,
    stream: bool,
    relay_chunks: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]],
    answer: Callable[[bytes], tuple[bytes, Callable[[], None] | None]],
    raw_capture: Callable[[], StreamSink] | None = None,
) -> Response:
    """Send ``content`` (the planned body) upstream and answer the client.

    A 200 event stream is relayed through ``relay_chunks`` when ``stream`` is true; any other
    200 answer is read whole and ``answer`` gives the client's bytes and the capture to run
    after they are written (by ``state.deferred`` when it has one). Failures and non-200
    answers count as ``upstream_errors``. With ``raw_capture`` (the proxy changed nothing in
    the request) a chunked stream may be relayed with the upstream's framing
    (`proxy.http.rawrelay.RawStreamResponse`), its body fed to what ``raw_capture`` makes.
    """
    query = request.url.query
    deferred = state.deferred
    try:
        resp = await state.generate_client().request(
            request.method,
            request.url.path + (f"?{query}" if query else ""),
            _planned_headers(request),
            content,
            sent=None if deferred is None else deferred.flush,
        )
    except UpstreamError as exc:
        state.counters["upstream_errors"] += 1
        return _upstream_error(exc, state.upstream)
    if resp.status != 200:
        state.counters["upstream_errors"] += 1
        try:
            body = await resp.read()
        except UpstreamError as exc:
            return _upstream_error(exc, state.upstream)
        finally:
            resp.release()
        return Response(body, status_code=resp.status, headers=_answer_headers(resp, True))
    if stream and resp.header("content-type").startswith("text/event-stream"):
        relayed = _closing(relay_chunks(resp.chunks()), resp)
        headers = _answer_headers(resp, False)
        if raw_capture is not None and resp.chunked:
            return RawStreamResponse(
                resp,
                relayed,
                raw_capture,
                status_code=resp.status,
                headers=headers,
                counters=state.counters,
            )
        return StreamingResponse(relayed, status_code=resp.status, headers=headers)
    try:
        body = await resp.read()
    except UpstreamError as exc:
        state.counters["upstream_errors"] += 1
        return _upstream_error(exc, state.upstream)
    finally:
        resp.release()
    client, capture = answer(body)
    if capture is not None and deferred is not None:
        deferred.add(capture)
        capture = None
    return Response(
        client,
        status_code=resp.status,
        headers=_answer_headers(resp, False),
        background=None if capture is None else BackgroundTask(_run_now, capture),
    )


async def counters(request: Request) -> Response:
    state: ProxyState = request.app.state.proxy
    settle_captures(state)
    capture = state.capture
    body = {
        "capture": capture.counters.to_dict(),
        "held_records": len(capture),
        "max_held_bytes": capture.max_held_bytes,
        "proxy": dict(state.counters),
    }
    return JSONResponse(body)


async def healthz(request: Request) -> Response:
    return JSONResponse({"ok": True})
