"""``POST /v1/runs/{run}/batches`` (the HTTP side of `timwatch.monitor.service.ingest`) and
``POST /v1/runs/{run}/finish`` (the end of a run). Both need the write token when one is set.

Admission of a batch (`timwatch.monitor.service.admission`): the body's bytes in the in-flight
budget, then a free ingest slot, both held until the answer; either refusal is 503 +
``Retry-After``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ...core.errors import ApiError
from ...core.runid import check_run_id
from ...core.tags import MAX_TAG_KEY, MAX_TAG_VALUE, MAX_TAGS
from .. import openapi_examples as ex
from ..deps import (
    PagesDep,
    RunsDep,
    ServingDep,
    SettingsDep,
    StoreDep,
    read_body,
    require_write,
)
from ..ingest import (
    TAP_DROPPED_HEADER,
    check_run,
    check_tags,
    ingest_batch,
    parse_tap_dropped,
)
from ..params import policy_names
from ..responses import json_response
from .guard import page_headers

__all__ = ["router"]

router = APIRouter()

TAG_DESCRIPTION = (
    f"key=value tags for the run (repeatable): at most {MAX_TAGS} per run, keys of 1-{MAX_TAG_KEY} "
    f"characters [A-Za-z0-9_.:-], values of at most {MAX_TAG_VALUE} characters without control "
    "characters"
)


@router.post(
    "/v1/runs/{run}/batches",
    tags=["ingest"],
    summary="Ingest a batch",
    description=ex.INGEST_DESCRIPTION,
    responses=ex.INGEST_RESPONSES,
    openapi_extra={"requestBody": ex.BATCH_BODY},
    dependencies=[Depends(require_write)],
)
async def ingest(
    run: str,
    request: Request,
    settings: SettingsDep,
    store: StoreDep,
    runs: RunsDep,
    serving: ServingDep,
    pages: PagesDep,
    masks: Annotated[str | None, Query(description="policies (comma-separated) or 'all'")] = None,
    tag: Annotated[list[str] | None, Query(description=TAG_DESCRIPTION)] = None,
    tap_dropped_header: Annotated[
        str | None,
        Header(
            alias=TAP_DROPPED_HEADER,
            description="batches the sending tap dropped since its last accepted post "
            "(integer 0 to 2^31; adds to timwatch_tap_dropped_batches_total)",
        ),
    ] = None,
) -> Response:
    check_run(run)  # before the body is read: a bad id costs no upload
    wanted = policy_names(masks)
    tags = check_tags(tag or [])
    tap_dropped = parse_tap_dropped(tap_dropped_header)
    with serving.budget.reservation("overloaded") as held:
        body = await read_body(request, settings.max_body, "too_large", held)
        async with serving.slots.enter(0.0 if store.health.failing else None):
            answer = await run_in_threadpool(
                ingest_batch, store, runs, run, body, request.headers.get("content-type", ""),
                params=settings.params, nonfinite=settings.nonfinite, masks=wanted, tags=tags,
                tap_dropped=tap_dropped, replica_id=settings.replica_id,
            )  # fmt: skip
    return json_response(answer, headers=page_headers(pages, run))


@router.post(
    "/v1/runs/{run}/finish",
    tags=["ingest"],
    summary="Mark a run finished",
    description=ex.FINISH_DESCRIPTION,
    responses=ex.FINISH_RESPONSES,
    dependencies=[Depends(require_write)],
)
async def finish(
    run: str,
    store: StoreDep,
    runs: RunsDep,
    tap_dropped_header: Annotated[
        str | None,
        Header(
            alias=TAP_DROPPED_HEADER,
            description="batches the finishing tap dropped since its last accepted post "
            "(integer 0 to 2^31; adds to timwatch_tap_dropped_batches_total)",
        ),
    ] = None,
) -> Response:
    tap_dropped = parse_tap_dropped(tap_dropped_header)
    found = None if check_run_id(run) else await run_in_threadpool(store.finish_run, run)
    if found is None:
        raise ApiError(404, f"run {run[:200]!r} not found")
    finished_at, newly = found
    if tap_dropped:
        runs.add_tap_dropped(run, tap_dropped)
    runs.finish(run)
    return json_response({"run": run, "finished_at": finished_at, "already_finished": not newly})
