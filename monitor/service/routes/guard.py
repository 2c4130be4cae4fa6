"""The guard's side of the API: ``POST /v1/alertmanager`` (Alertmanager's webhook, write token)
records which runs are paged (`timwatch.monitor.service.pages`), and ``GET /v1/runs/{run}/page``
(read token) says whether one is. Both answers, and every batch POST's, carry the
``Timwatch-Page`` header while the run is paged (`timwatch.monitor.core.page`): that is how a
trainer's `Tap` learns of its page without a request of its own.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ...core.errors import ApiError, InputError
from ...core.jsoncodec import loads
from ...core.page import PAGE_HEADER, format_page
from ...core.runid import check_run_id
from .. import openapi_examples as ex
from ..deps import PagesDep, ServingDep, SettingsDep, read_body, require_read, require_write
from ..pages import PageBoard
from ..responses import json_response

__all__ = ["page_headers", "router"]

router = APIRouter(tags=["guard"])

_MAX_WEBHOOK = 16 * 2**20


def page_headers(pages: PageBoard, run: str) -> dict[str, str] | None:
    """``{Timwatch-Page: …}`` while `run` is paged, else None."""
    page = pages.page(run)
    return None if page is None else {PAGE_HEADER: format_page(page)}


@router.post(
    "/v1/alertmanager",
    summary="Alertmanager webhook: page runs for the guard",
    description=ex.ALERTMANAGER_DESCRIPTION,
    responses=ex.ALERTMANAGER_RESPONSES,
    openapi_extra={"requestBody": ex.ALERTMANAGER_BODY},
    dependencies=[Depends(require_write)],
)
async def alertmanager(
    request: Request, settings: SettingsDep, pages: PagesDep, serving: ServingDep
) -> Response:
    with serving.budget.reservation(None) as held:  # not a batch: counted in no batch reason
        body = await read_body(request, min(settings.max_body, _MAX_WEBHOOK), None, held)
    try:
        payload = loads(body)
    except ValueError as exc:
        raise ApiError(422, f"body: not JSON: {str(exc)[:200]}") from None
    try:
        answer = pages.apply(payload)
    except InputError as exc:
        raise ApiError(422, str(exc), field=exc.field) from None
    return json_response(answer)


@router.get(
    "/v1/runs/{run}/page",
    summary="Whether a run is paged",
    description=ex.PAGE_DESCRIPTION,
    responses=ex.PAGE_RESPONSES,
    dependencies=[Depends(require_read)],
)
async def page(run: str, pages: PagesDep) -> Response:
    problem = check_run_id(run)
    if problem:
        raise ApiError(422, problem)
    state = pages.page(run)
    body = {
        "run": run,
        "paged": state is not None,
        "alerts": list(state.alerts) if state else [],
        "since": state.since if state else None,
    }
    return json_response(body, headers=page_headers(pages, run))
