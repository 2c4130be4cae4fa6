"""Reverse proxy in front of SGLang that captures μ for every finished sample.

Clients (slime, verl's SGLang rollout, any HTTP caller) point at the proxy instead of SGLang.
``/generate`` is rewritten so SGLang also returns what the sidecar needs (log-probs, top-k,
prompt ids; see `proxy.sglang.wire`), the answer is recorded, and what the proxy added is
removed again so the client gets the keys and values SGLang would have sent it. Every other
path is forwarded byte for byte, streamed both ways. Upstream errors pass back unchanged
(status, headers, body). The proxy keeps no per-request state beyond the stream it is relaying.

Read-only debug endpoints live under ``/timwatch/`` (SGLang has no such prefix):
``/timwatch/records`` (held records, a -inf log-prob as null, and counters; shared with the vLLM
proxy in `proxy.http.forward`), ``/timwatch/counters`` (the counters
alone: captured, evicted and ``evicted_bytes`` by the byte bound, ``held_bytes``),
``/timwatch/probes`` (recent probe results, prober counters and, with `proxy.sglang.probe_forward`,
the forwarder's), ``/timwatch/healthz``.
Trainer reports and the forwarding of probes to the monitor are installed on top by
`proxy.join.http.install_join` and `proxy.sglang.probe_forward.install_probe_forward`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..capture import DEFAULT_MAX_HELD_BYTES, CaptureStore
from ..http.forward import forward_planned, proxy_routes, relay
from ..http.relay import ProxyApp
from ..http.state import ProxyState, serving
from ..records import RolloutRecord
from .answers import Capturer, answer_parts
from .probe import DEFAULT_PROBE_TOPK, Prober, ProbeSink
from .stream import relay_stream, stream_capture
from .wire import dumps, loads, plan_request

__all__ = ["create_app", "SglangState"]

log = logging.getLogger(__name__)


class SglangState(ProxyState):
    """A `ProxyState` with what only the SGLang proxy holds: the top-k it asks for, the
    prober and its sink, and the `Capturer` its answers go to (which knows the vocabulary
    size)."""

    def __init__(
        self,
        upstream: str,
        *,
        topk: int | None,
        probe_rate: float,
        vocab_size: int | None,
        capture: CaptureStore,
        timeout_s: float | None,
    ) -> None:
        if topk is not None and topk <= 0:
            raise ValueError(f"topk must be a positive integer, got {topk}")
        super().__init__(upstream, capture=capture, timeout_s=timeout_s)
        self.topk = topk
        self.rollout_entropy = topk is not None
        self.probe_rate = probe_rate
        self.prober: Prober | None = None
        self.probe_sink: ProbeSink | None = None  # set before start by install_probe_forward
        self.capturer = Capturer(self.commit, self.counters, vocab_size)

    def commit(self, record: RolloutRecord) -> None:
        self.capture.add(record)
        if self.prober is not None:
            self.prober.maybe_probe(record)  # if the record is selected


async def _generate(request: Request) -> Response:
    state: SglangState = request.app.state.proxy
    state.counters["requests"] += 1
    raw = await request.body()
    try:
        body = loads(raw)
    except ValueError:
        body = None
    plan = plan_request(body, state.topk)
    if plan is None:
        return await relay(state, request, raw, request.url.path)
    return await forward_planned(
        state,
        request,
        dumps(plan.body) if plan.changed else raw,
        stream=plan.stream,
        relay_chunks=lambda chunks: relay_stream(state.capturer, plan, chunks),
        answer=lambda content: answer_parts(state.capturer, plan, content),
        stream_sink=None if plan.changed else lambda: stream_capture(state.capturer, plan),
    )


async def _probes(request: Request) -> Response:
    state: SglangState = request.app.state.proxy
    prober = state.prober
    return JSONResponse(
        {
            "rate": state.probe_rate,
            "results": [r.to_dict() for r in prober.results()] if prober else [],
            "counters": dict(prober.counters) if prober else {},
            "forward": state.probe_sink.stats() if state.probe_sink else None,
        }
    )


def create_app(
    upstream: str,
    *,
    topk: int | None = None,
    probe_rate: float = 0.0,
    vocab_size: int | None = None,
    capture: CaptureStore | None = None,
    timeout_s: float | None = None,
    ttl_s: float = 900.0,
    max_held_bytes: int = DEFAULT_MAX_HELD_BYTES,
) -> Starlette:
    """Build the proxy app. ``timeout_s=None`` waits as long as the client does, so the
    client's own timeout decides; ``vocab_size`` enables the top-k tail bound; records no
    trainer collects are held for ``ttl_s`` and in at most ``max_held_bytes``."""
    if capture is None:
        capture = CaptureStore(ttl_s=ttl_s, max_held_bytes=max_held_bytes)
    state = SglangState(
        upstream,
        topk=topk,
        probe_rate=probe_rate,
        vocab_size=vocab_size,
        capture=capture,
        timeout_s=timeout_s,
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with serving(state):
            if probe_rate > 0.0:
                state.prober = Prober(
                    state.client(),
                    probe_rate,
                    topk=topk or DEFAULT_PROBE_TOPK,
                    sink=state.probe_sink,
                )
            yield
            state.deferred.flush()  # before the prober drains: a capture may start a probe
            if state.prober is not None:
                await state.prober.drain()

    routes = proxy_routes(
        Route("/timwatch/probes", _probes, methods=["GET"]),
        Route("/generate", _generate, methods=["POST", "PUT"]),
    )
    app = ProxyApp(routes=routes, lifespan=lifespan)
    app.state.proxy = state
    return app
