"""The service's dependencies: per-app state, authentication, the size-limited body and the
policy parameters of a request.

`create_app` puts ``settings``, ``store``, ``runs``, ``registry`` and ``serving`` on
``app.state``; every route reaches them only through the ``*Dep`` types below, so a route's
signature says what it uses. The state dependencies are ``async`` so they resolve on the event
loop, not in a thread.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Query, Request
from prometheus_client import CollectorRegistry

from ..core.errors import ApiError
from ..core.masks import PolicyParams
from ..store import Store
from .admission import Reservation
from .pages import PageBoard
from .params import PolicyQuery, apply_query
from .runs import RunRegistry
from .serving import Serving
from .settings import Settings

__all__ = [
    "CollectorRegistryDep",
    "PagesDep",
    "PolicyParamsDep",
    "RunsDep",
    "ServingDep",
    "SettingsDep",
    "StoreDep",
    "get_collector_registry",
    "get_pages",
    "get_runs",
    "get_serving",
    "get_settings",
    "get_store",
    "policy_params",
    "read_body",
    "require_read",
    "require_write",
]


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def get_runs(request: Request) -> RunRegistry:
    runs: RunRegistry = request.app.state.runs
    return runs


async def get_serving(request: Request) -> Serving:
    serving: Serving = request.app.state.serving
    return serving


async def get_collector_registry(request: Request) -> CollectorRegistry:
    registry: CollectorRegistry = request.app.state.registry
    return registry


async def get_pages(request: Request) -> PageBoard:
    pages: PageBoard = request.app.state.pages
    return pages


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
RunsDep = Annotated[RunRegistry, Depends(get_runs)]
CollectorRegistryDep = Annotated[CollectorRegistry, Depends(get_collector_registry)]
ServingDep = Annotated[Serving, Depends(get_serving)]
PagesDep = Annotated[PageBoard, Depends(get_pages)]


def _bearer(request: Request) -> str | None:
    h = request.headers.get("authorization", "")
    return h[7:].strip() if h[:7].lower() == "bearer " else None


def _matches(given: str | None, *expected: str | None) -> bool:
    """Constant-time comparison against every configured token."""
    return given is not None and any(
        e is not None and hmac.compare_digest(given.encode(), e.encode()) for e in expected
    )


async def require_write(request: Request, settings: SettingsDep) -> None:
    """401 unless the write token is unset or given; a refused ingest counts as
    ``unauthorized``."""
    if settings.token and not _matches(_bearer(request), settings.token):
        reason = "unauthorized" if request.url.path.endswith("/batches") else None
        if request.url.path.endswith("/scalars"):
            request.app.state.runs.reject_scalars("unauthorized")
        raise ApiError(401, "unauthorized", reason=reason, headers={"WWW-Authenticate": "Bearer"})


async def require_read(request: Request, settings: SettingsDep) -> None:
    """401 unless the read token is unset, or the read or the write token is given."""
    if settings.read_token and not _matches(_bearer(request), settings.read_token, settings.token):
        raise ApiError(401, "unauthorized", headers={"WWW-Authenticate": "Bearer"})


async def read_body(request: Request, limit: int, reason: str | None, held: Reservation) -> bytes:
    """The request body, refused with 413 as soon as the declared or the streamed size passes
    `limit` (a body is never held past it), counted under `reason` when one is given.

    Its bytes are reserved in `held` (the server's in-flight budget): a declared length all at
    once before anything is read, a chunked body chunk by chunk; 503 + ``Retry-After`` when they
    do not fit. The caller releases `held` when the request is done.

    A plain function the route awaits, not a dependency, so the route's cheaper checks
    (run id, policy names) answer first, as they always have."""
    declared = request.headers.get("content-length")
    length = int(declared) if declared is not None and declared.isdigit() else None
    if length is not None and length > limit:
        raise ApiError(413, f"body exceeds {limit} bytes", reason=reason)
    if length is not None:
        held.take(length)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"body exceeds {limit} bytes", reason=reason)
        if length is None:
            held.take(len(chunk))
        chunks.append(chunk)
    return b"".join(chunks)


async def policy_params(
    settings: SettingsDep, query: Annotated[PolicyQuery, Query()]
) -> PolicyParams:
    """The server's `PolicyParams` with those the query names replaced (422 names a bad one)."""
    return apply_query(settings.params, query)


PolicyParamsDep = Annotated[PolicyParams, Depends(policy_params)]
