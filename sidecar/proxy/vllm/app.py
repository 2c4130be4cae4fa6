"""Reverse proxy in front of vLLM's OpenAI-compatible server that captures μ for every sample.

Clients point at the proxy instead of vLLM. ``/v1/completions``, ``/v1/chat/completions`` and
``/inference/v1/generate`` are rewritten so vLLM also returns the sampled token's log-prob and
the token ids (`proxy.vllm.edit.plan_request`); the answer is recorded and what the proxy added
is set back to the ``null`` vLLM writes for a field not asked for, so the client gets the bytes
vLLM would have sent for its own request. Every other path (``/v1/models``, ``/health``,
``/update_weight_version``, ``/collective_rpc``, ...) is forwarded byte for byte, streamed both
ways; upstream errors pass back unchanged.

Records carry the request's sampling parameters and the engine's log-prob mode
(``--logprobs-mode``, vLLM's default ``raw_logprobs``); samples whose μ is not the sampling
distribution are counted as a sampling-side mismatch (`proxy.vllm.capture`).

Debug endpoints as on the SGLang proxy (`proxy.http.forward.proxy_routes`):
``/timwatch/records`` (a -inf log-prob is null there), ``/timwatch/counters``,
``/timwatch/healthz``, plus ``/timwatch/metrics`` (Prometheus text: the counters).
Trainer reports are installed on top by `proxy.join.http.install_join`.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ....monitor.core.jsoncodec import dumps, loads
from ..capture import DEFAULT_MAX_HELD_BYTES, CaptureStore
from ..http.forward import forward_planned, proxy_routes, relay
from ..http.state import ProxyState, serving, settle_captures
from .capture import (
    COUNTER_NAMES,
    VllmCapturer,
    answer_parts,
    relay_stream,
)
from .edit import plan_request

__all__ = ["create_app", "LOGPROBS_MODES", "ENDPOINTS", "VllmState"]

# the capture's counters and the relay's
_COUNTERS = (*COUNTER_NAMES, "partial_streams")
#: vLLM's ``--logprobs-mode`` values that return log-probs (the logits modes do not).
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
ENDPOINTS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/inference/v1/generate": "generate",
}


class VllmState(ProxyState):
    """A `ProxyState` with the vLLM proxy's counters and the `VllmCapturer` its answers go to
    (which knows the engine's log-prob mode)."""

    def __init__(
        self,
        upstream: str,
        *,
        logprobs_mode: str,
        capture: CaptureStore,
        timeout_s: float | None,
    ) -> None:
        super().__init__(upstream, capture=capture, timeout_s=timeout_s)
        for name in _COUNTERS:
            self.counters.setdefault(name, 0)
        self.capturer = VllmCapturer(self.commit, self.counters, logprobs_mode)


async def _endpoint(request: Request) -> Response:
    state: VllmState = request.app.state.proxy
    cap = state.capturer
    state.counters["requests"] += 1
    raw = await request.body()
    try:
        body = loads(raw)
    except ValueError:
        body = None
    plan = plan_request(ENDPOINTS[request.url.path], body)
    if plan is None:
        state.counters["uncaptured_requests"] += 1
        return await relay(state, request, raw, request.url.path)
    return await forward_planned(
        state,
        request,
        dumps(plan.body) if plan.changed else raw,
        stream=True,
        relay_chunks=lambda chunks: relay_stream(cap, plan, chunks),
        answer=lambda content: answer_parts(cap, plan, content),
    )


async def _metrics(request: Request) -> Response:
    state: VllmState = request.app.state.proxy
    settle_captures(state)
    help_ = {
        "requests": "Requests to the captured endpoints.",
        "uncaptured_requests": "Captured-endpoint requests passed through unread (echo, beam).",
        "wire_errors": "Answers or chunks the proxy could not read (passed through).",
        "upstream_errors": "Upstream failures and non-200 answers.",
        "partial_streams": "Answers whose upstream broke off after their head was relayed.",
        "sampling_mismatch_samples": (
            "Samples whose μ is raw log-probs while the request sampled with temperature, "
            "top-p, top-k or min-p (a sampling-side mismatch, not engine noise)."
        ),
        "sampling_mismatch_tokens": "Tokens of sampling_mismatch_samples.",
        "impossible_tokens": "Captured tokens the engine gave log-prob -inf (vLLM: -9999).",
    }
    held = state.capture.counters.to_dict()
    rows = [(f"vllm_{n}_total", help_[n], state.counters[n]) for n in _COUNTERS] + [
        (f"vllm_records_{n}_total", f"Capture store: records {n}.", held[n])
        for n in ("captured", "evicted", "expired", "popped")
    ]
    text = "".join(
        f"# HELP timwatch_sidecar_{m} {h}\n# TYPE timwatch_sidecar_{m} counter\n"
        f"timwatch_sidecar_{m} {v}\n"
        for m, h, v in rows
    )
    return Response(text, media_type="text/plain; version=0.0.4")


def create_app(
    upstream: str,
    *,
    logprobs_mode: str = "raw_logprobs",
    capture: CaptureStore | None = None,
    timeout_s: float | None = None,
    ttl_s: float = 900.0,
    max_held_bytes: int = DEFAULT_MAX_HELD_BYTES,
) -> Starlette:
    """Build the vLLM proxy app. ``logprobs_mode`` is the engine's ``--logprobs-mode`` (the
    proxy cannot ask vLLM for it); ``timeout_s=None`` waits as long as the client does."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    if capture is None:
        capture = CaptureStore(ttl_s=ttl_s, max_held_bytes=max_held_bytes)
    state = VllmState(
        upstream,
        logprobs_mode=logprobs_mode,
        capture=capture,
        timeout_s=timeout_s,
    )

    routes = proxy_routes(
        Route("/timwatch/metrics", _metrics, methods=["GET"]),
        *(Route(path, _endpoint, methods=["POST"]) for path in ENDPOINTS),
    )
    app = Starlette(routes=routes, lifespan=lambda app: serving(state))
    app.state.proxy = state
    return app
