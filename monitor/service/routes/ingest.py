"""``POST /v1/runs/{run}/batches``: the HTTP side of `timwatch.monitor.service.ingest`.

Admission (`timwatch.monitor.service.admission`): the body's bytes in the in-flight budget, then
a free ingest slot, both held until the answer; either refusal is 503 + ``Retry-After``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from timwatch.monitor.service import openapi_examples as ex
from timwatch.monitor.service.deps import (
    RunsDep,
    ServingDep,
    SettingsDep,
    StoreDep,
    read_body,
    require_write,
)
from timwatch.monitor.service.ingest import check_run, ingest_batch
from timwatch.monitor.service.params import policy_names
from timwatch.monitor.service.responses import json_response

__all__ = ["router"]

router = APIRouter()


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
    masks: Annotated[str | None, Query(description="policies (comma-separated) or 'all'")] = None,
    tag: Annotated[list[str] | None, Query(description="key=value tags for the run")] = None,
) -> Response:
    check_run(run)  # before the body is read: a bad id costs no upload
    wanted = policy_names(masks)
    tags = {k: v for k, _, v in (t.partition("=") for t in tag or [])}
    with serving.budget.reservation("overloaded") as held:
        body = await read_body(request, settings.max_body, "too_large", held)
        async with serving.slots.enter(0.0 if store.health.failing else None):
            answer = await run_in_threadpool(
                ingest_batch, store, runs, run, body, request.headers.get("content-type", ""),
                params=settings.params, nonfinite=settings.nonfinite, masks=wanted, tags=tags,
            )  # fmt: skip
    return json_response(answer)
