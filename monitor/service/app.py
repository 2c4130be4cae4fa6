"""The timwatch HTTP API (docs/reference/api.md): `create_app` builds one app's state and
includes the routers of `timwatch.monitor.service.routes`.

Per app, on ``app.state``: ``settings``, ``store``, ``runs`` (the live `RunRegistry`),
``registry`` (its own Prometheus collector registry, so many apps can live in one process) and
``serving`` (`Serving`: incremental exposition, in-flight budget, ingest slots, store pinger)
``token_text`` (the ``--tokenizer`` vocabulary the report uses, or None) and ``pages``
(`PageBoard`: the runs the guard pages, fed by ``POST /v1/alertmanager``).
The event loop only moves bytes: parsing, validation, the metric kernel and the database
transaction of a batch all run in the threadpool, so one big batch never stalls scrapes or
other clients. ``/metrics`` renders on its own thread and ``/healthz`` answers from memory, so
neither waits behind ingests blocked on the store.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.errors import ApiError
from ..core.version import __version__
from ..report.tokenizer import load_tokenizer
from ..store import Store, StoreUnavailable
from .admission import RETRY_AFTER_S
from .exporter import make_registry
from .pages import PageBoard
from .responses import encode_masks, json_response, metric_column
from .routes import ROUTERS
from .runs import RunRegistry
from .serving import Serving
from .settings import Settings

__all__ = ["ApiError", "create_app", "encode_masks", "metric_column"]

log = logging.getLogger("timwatch.api")


async def _api_error(request: Request, exc: ApiError) -> Response:
    if exc.reason is not None:
        runs: RunRegistry = request.app.state.runs
        runs.reject(exc.reason)
    return json_response({"detail": exc.detail, **exc.extra}, exc.status, exc.headers)


async def _store_down(request: Request, exc: StoreUnavailable) -> Response:
    if request.method == "POST" and request.url.path.endswith("/batches"):
        runs: RunRegistry = request.app.state.runs
        runs.reject("store_unavailable")
    log.warning("store unavailable: %s", exc)
    return json_response(
        {"detail": f"store unavailable: {exc}"}, 503, {"Retry-After": RETRY_AFTER_S}
    )


def seed_registry(runs: RunRegistry, db: Store, replica_id: str) -> int:
    """Load the runs `replica_id` counted before this process (its stored totals, still live by
    the TTL and finish grace) so its counters continue; returns how many."""
    rows = db.replica_seed(replica_id, runs.clock.time() - runs.ttl)
    n = sum(
        runs.seed(r.run, (r.totals, r.tap_dropped), r.row, r.step, r.updated_at, r.finished_at)
        for r in rows
    )
    log.info("replica %s: %d live runs loaded from the store", replica_id, n)
    return n


def create_app(
    settings: Settings, *, store: Store | None = None, clock: Clock = SYSTEM_CLOCK
) -> FastAPI:
    """The ASGI app. Opens (and migrates) the store unless one is given; closes it on
    shutdown either way. The store pinger runs while the lifespan does. A ``tokenizer`` file
    that cannot be read fails here, before the store opens (`ConfigError`). The run registry's
    TTL and finish grace run on ``clock``."""
    token_text = load_tokenizer(settings.tokenizer) if settings.tokenizer else None
    db = store if store is not None else Store(settings.db_url)
    runs = RunRegistry(ttl=settings.run_ttl, finish_grace=settings.finish_grace, clock=clock)
    if settings.replica_id is not None:
        seed_registry(runs, db, settings.replica_id)
    serving = Serving.build(settings, db, runs)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        serving.start()
        try:
            yield
        finally:
            serving.stop()
            db.close()

    app = FastAPI(
        title="timwatch",
        version=__version__,
        summary="Train–inference mismatch monitoring for LLM RL.",
        lifespan=lifespan,
    )
    app.state.settings, app.state.store, app.state.runs = settings, db, runs
    app.state.registry = make_registry(runs)
    app.state.serving = serving
    app.state.token_text = token_text
    app.state.pages = PageBoard(settings.page_severity)
    app.exception_handler(ApiError)(_api_error)
    app.exception_handler(StoreUnavailable)(_store_down)
    for router in ROUTERS:
        app.include_router(router)
    return app
