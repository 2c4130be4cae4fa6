"""What the SGLang and vLLM proxies share: forwarding a request untouched, forwarding a
planned (rewritten) request and answering with what the client asked for, the header filters,
the answers for upstream failures, and the debug endpoints both serve.

Invariants: hop-by-hop headers never cross the proxy in either direction; ``date`` and
``server`` of the upstream are dropped (uvicorn writes its own); an upstream failure is a 502
(504 on a timeout) with a JSON ``error.message`` naming the upstream; a non-200 answer is
passed back with its status, headers and body unchanged. The proxy state is
`proxy.http.state.ProxyState`, which each proxy extends, so this module imports neither proxy.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ....monitor.core.jsoncodec import dumps
from .client import UpstreamError, UpstreamResponse
from .relay import RawStream, StreamSink, UpstreamStream
from .state import ProxyState, settle_captures

__all__ = [
    "ALL_METHODS",
    "counters",
    "forward_planned",
    "healthz",
    "passthrough",
    "proxy_routes",
    "records",
    "relay",
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
# the client sets a request's framing itself
REQUEST_DROP = HOP_BY_HOP | {"content-length", "expect"}
ALL_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


def _request_headers(request: Request, drop: frozenset[str]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in request.headers.items() if k.lower() not in drop]


def _answer_headers(resp: UpstreamResponse, keep_length: bool) -> dict[str, str]:
    # a 204 or 304 has no body whatever its content-length says, and the server checks it
    keep = keep_length and resp.status not in (204, 304)
    drop = RESPONSE_DROP if keep else RESPONSE_DROP | {"content-length"}
    return {k: v for k, v in resp.headers if k.lower() not in drop}


def _target(request: Request, path: str) -> str:
    query = request.url.query
    return path + (f"?{query}" if query else "")


def _upstream_error(state: ProxyState, exc: UpstreamError) -> Response:
    state.counters["upstream_errors"] += 1
    message = f"timwatch sidecar: upstream {state.upstream} failed: {exc}"
    return JSONResponse({"error": {"message": message}}, status_code=504 if exc.timeout else 502)


async def relay(
    state: ProxyState, request: Request, content: bytes | AsyncIterable[bytes], path: str
) -> Response:
    """Forward one request untouched and stream the upstream's answer back untouched."""
    length = request.headers.get("content-length")
    if length is None and "transfer-encoding" not in request.headers:
        content = b""  # RFC 9112 §6.3: a request with neither header has no body
    try:
        resp = await state.client().request(
            request.method,
            _target(request, path),
            _request_headers(request, REQUEST_DROP),
            content,
            length=None if length is None else int(length),
        )
    except UpstreamError as exc:
        return _upstream_error(state, exc)
    return UpstreamStream(
        resp,
        status_code=resp.status,
        headers=_answer_headers(resp, keep_length=True),
        counters=state.counters,
    )


async def passthrough(request: Request) -> Response:
    state: ProxyState = request.app.state.proxy
    return await relay(state, request, request.stream(), request.url.path)


async def forward_planned(
    state: ProxyState,
    request: Request,
    content: bytes,
    *,
    stream: bool,
    relay_chunks: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]],
    answer: Callable[[bytes], tuple[bytes, Callable[[], None] | None]],
    stream_sink: Callable[[], StreamSink] | None = None,
) -> Response:
    """Send ``content`` (the planned body) upstream and answer the client.

    A 200 event stream is relayed when ``stream`` is true: through ``relay_chunks``, or, with
    ``stream_sink`` (the proxy changed nothing in the request), piece by piece as it arrived,
    each piece fed after it went out to what ``stream_sink`` makes. Any other 200 answer is
    read whole and ``answer`` gives the client's bytes and the capture to run after they are
    written (by ``state.deferred``). Failures and non-200 answers count as
    ``upstream_errors``; a non-200 answer is passed back as it came.
    """
    try:
        resp = await state.client().request(
            request.method,
            _target(request, request.url.path),
            # the proxy parses the answers to planned requests, so it asks for them plain
            _request_headers(request, REQUEST_DROP | {"accept-encoding"}),
            content,
            sent=state.deferred.flush,
        )
        if (
            resp.status == 200
            and stream
            and resp.header("content-type").startswith("text/event-stream")
        ):
            sink = None if stream_sink is None else stream_sink()
            return RawStream(
                resp,
                status_code=200,
                headers=_answer_headers(resp, False),
                counters=state.counters,
                transform=relay_chunks if sink is None else None,
                sink=sink,
            )
        try:
            body = await resp.read()
        finally:
            resp.release()
    except UpstreamError as exc:
        return _upstream_error(state, exc)
    if resp.status != 200:
        state.counters["upstream_errors"] += 1
        return Response(body, status_code=resp.status, headers=_answer_headers(resp, True))
    client, capture = answer(body)
    if capture is not None:
        state.deferred.add(capture)
    return Response(client, status_code=resp.status, headers=_answer_headers(resp, False))


async def records(request: Request) -> Response:
    """``/timwatch/records``: the records held and the counters, with a log-prob of -inf (a
    token the engine gave probability 0) listed as null: JSON has no infinity."""
    state: ProxyState = request.app.state.proxy
    settle_captures(state)
    body = {
        "records": [rec.to_dict() for rec in state.capture.snapshot()],
        "capture": state.capture.counters.to_dict(),
        "proxy": dict(state.counters),
    }
    return Response(dumps(body), media_type="application/json")  # dumps: -inf as null


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


def proxy_routes(*routes: Route) -> list[Route]:
    """A proxy app's routes: the debug endpoints both proxies serve (``/timwatch/records``,
    ``/timwatch/counters``, ``/timwatch/healthz``), then ``routes``, then every other path
    passed through (last: it matches any path)."""
    return [
        Route("/timwatch/records", records, methods=["GET"]),
        Route("/timwatch/counters", counters, methods=["GET"]),
        Route("/timwatch/healthz", healthz, methods=["GET"]),
        *routes,
        Route("/{path:path}", passthrough, methods=ALL_METHODS),
    ]
