"""Operations: ``GET /metrics`` (Prometheus exposition, read-protected) and ``GET /healthz``.

Both are ``async`` and never call the store: ``/metrics`` renders the in-memory exposition on its
own thread (`Serving.metrics_text`), ``/healthz`` reports the write path's recorded outcomes and
the background ping (`timwatch.monitor.service.health`). Neither needs a thread of the shared
pool, so ingests blocked on a stuck store cannot delay them.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from .. import openapi_examples as ex
from ..deps import (
    RunsDep,
    ServingDep,
    SettingsDep,
    StoreDep,
    require_read,
)
from ..exporter import CONTENT_TYPE
from ..health import health_answer
from ..responses import json_response

__all__ = ["router"]

router = APIRouter(tags=["monitoring"])

_METRICS_EXAMPLE = 'timwatch_tokens_total{run="grpo-7b"} 1.048576e+06\n'


@router.get(
    "/metrics",
    summary="Prometheus exposition (docs/reference/prometheus.md)",
    responses={
        200: {"content": {CONTENT_TYPE: {"example": _METRICS_EXAMPLE}}},
        401: ex.read_errors()[401],
    },
    dependencies=[Depends(require_read)],
)
async def metrics(serving: ServingDep) -> Response:
    return Response(await serving.metrics_text(), media_type=CONTENT_TYPE)


@router.get(
    "/healthz",
    summary="Liveness and write-path health (from memory)",
    description=ex.HEALTHZ_DESCRIPTION,
    responses=ex.HEALTHZ_RESPONSES,
)
async def healthz(
    settings: SettingsDep, store: StoreDep, runs: RunsDep, serving: ServingDep
) -> Response:
    body, status = health_answer(settings, store, runs, serving.pinger, serving.budget)
    return json_response(body, status)
