"""Trainer-report endpoints on the SGLang proxy, and the forwarder from the join to the monitor.

`install_join(app, monitor=URL)` adds to an app built by
`timwatch.sidecar.proxy.sglang.app.create_app`:

* ``POST /timwatch/v1/trainer_reports`` — a JSON trainer report (see `proxy.join.joiner`). Answers
  ``{"status": "forwarded"|"pending", "joined", ...}``; 422 with ``{"detail", "field"}`` for a
  malformed report (nothing is consumed from the capture store then).
* ``GET /timwatch/v1/join`` — join counters, capture counters, each run's tap stats and, with
  peers, each peer's take counters (``peers``) and the records this proxy gave (``given``).
* ``POST /timwatch/v1/peer/take`` — the peers' side of `proxy.join.peers` (always installed, so any
  proxy with a join can be another's peer).

It wraps the app's lifespan to run a sweep thread (pending reports retried, old ones expired)
and to flush the taps on shutdown. Routes go in front of the proxy's catch-all pass-through.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...tap import Tap
from ..http.state import ProxyState, settle_captures
from .joiner import Joiner, JoinError
from .peers import (
    TAKE_PATH,
    PeerClient,
    encode_records,
    parse_keys,
    take_records,
)

__all__ = ["TapForwarder", "install_join", "REPORTS_PATH"]

log = logging.getLogger(__name__)

REPORTS_PATH = "/timwatch/v1/trainer_reports"


class TapForwarder:
    """One `Tap` per run; ``__call__`` is the `Joiner`'s ``forward``."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url
        self.token = token
        self.id_prefix = f"join-{socket.gethostname()}-{os.getpid()}"
        self.taps: dict[str, Tap] = {}
        self._lock = threading.Lock()

    def __call__(
        self,
        run: str,
        step: int,
        arrays: dict[str, np.ndarray],
        policy_version: int | None,
        batch_id: str | None,
        entropy_source: str,
    ) -> None:
        with self._lock:
            tap = self.taps.get(run)
            if tap is None:
                # a proxy never finishes a run: the trainer owns its lifecycle, and one proxy
                # replica restarting must not mark the run finished
                tap = self.taps[run] = Tap(
                    self.url, run, self.token, id_prefix=self.id_prefix, finish=False
                )
        tap.report(
            step,
            **arrays,
            policy_version=policy_version,
            batch_id=batch_id,
            entropy_source=entropy_source,
        )

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {run: tap.stats() for run, tap in self.taps.items()}

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            taps = list(self.taps.values())
        for tap in taps:
            tap.close(timeout)


def install_join(
    app: Starlette,
    *,
    monitor: str,
    run: str = "default",
    token: str | None = None,
    report_ttl_s: float = 60.0,
    sweep_s: float = 0.5,
    peers: Sequence[str] = (),
    peer_timeout_s: float = 5.0,
    self_url: str | None = None,
) -> Joiner:
    """Add the trainer-report endpoints to a proxy app; returns its `Joiner`. ``peers`` are
    the other proxies behind the same router (``self_url`` is dropped from them)."""
    state: ProxyState = app.state.proxy
    forwarder = TapForwarder(monitor, token or os.environ.get("TIMWATCH_TOKEN"))
    peer_client = PeerClient(peers, timeout_s=peer_timeout_s, self_url=self_url) if peers else None
    joiner = Joiner(
        state.capture,
        forwarder,
        default_run=run,
        rollout_entropy=state.rollout_entropy,
        report_ttl_s=report_ttl_s,
        peers=peer_client if peer_client is not None and peer_client.urls else None,
    )
    app.state.joiner, app.state.forwarder = joiner, forwarder
    given = {"requests": 0, "records": 0}

    async def reports(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return JSONResponse({"detail": f"body is not JSON: {exc}", "field": "body"}, 422)
        settle_captures(state)  # answers already sent are in the store before the join
        try:
            answer = await run_in_threadpool(joiner.submit, body)
        except JoinError as exc:
            return JSONResponse({"detail": str(exc), "field": exc.field}, 422)
        return JSONResponse(answer)

    async def take(request: Request) -> Response:
        try:
            keys = parse_keys(json.loads(await request.body()))
        except ValueError as exc:
            return JSONResponse({"detail": str(exc), "field": "keys"}, 422)
        settle_captures(state)  # a peer asks for records this proxy may have answered just now
        taken = await run_in_threadpool(take_records, state.capture, keys)
        given["requests"] += 1
        given["records"] += len(taken)
        return Response(encode_records(taken), media_type="application/octet-stream")

    async def join_stats(request: Request) -> Response:
        return JSONResponse(
            {
                "join": dict(joiner.counters),
                "capture": state.capture.counters.to_dict(),
                "taps": forwarder.stats(),
                "peers": peer_client.stats() if peer_client is not None else {},
                "given": dict(given),
            }
        )

    app.router.routes[0:0] = [
        Route(REPORTS_PATH, reports, methods=["POST"]),
        Route("/timwatch/v1/join", join_stats, methods=["GET"]),
        Route(TAKE_PATH, take, methods=["POST"]),
    ]

    inner = app.router.lifespan_context
    stop = threading.Event()

    def sweeper() -> None:
        while not stop.wait(sweep_s):
            try:
                joiner.sweep()
            except Exception:  # noqa: BLE001 - keep sweeping
                log.exception("join sweep failed")

    @asynccontextmanager
    async def lifespan(a: Starlette) -> AsyncIterator[Any]:
        thread = threading.Thread(target=sweeper, name="timwatch-join-sweep", daemon=True)
        thread.start()
        async with inner(a) as value:
            try:
                yield value
            finally:
                stop.set()
                thread.join(timeout=5.0)
                await run_in_threadpool(joiner.sweep)
                await run_in_threadpool(forwarder.close)
                if peer_client is not None:
                    peer_client.close()

    app.router.lifespan_context = lifespan
    return joiner
