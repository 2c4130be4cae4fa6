"""Operations: ``GET /metrics`` (Prometheus exposition, read-protected) and ``GET /healthz``."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from timwatch.monitor.service.deps import (
    CollectorRegistryDep,
    RunsDep,
    SettingsDep,
    StoreDep,
    require_read,
)
from timwatch.monitor.service.exporter import CONTENT_TYPE, render
from timwatch.monitor.service.responses import json_response

__all__ = ["router"]

router = APIRouter(tags=["monitoring"])

_METRICS_EXAMPLE = 'timwatch_tokens_total{run="grpo-7b"} 1.048576e+06\n'


@router.get(
    "/metrics",
    summary="Prometheus exposition (docs/reference/prometheus.md)",
    responses={200: {"content": {CONTENT_TYPE: {"example": _METRICS_EXAMPLE}}}},
    dependencies=[Depends(require_read)],
)
def metrics(registry: CollectorRegistryDep) -> Response:
    return Response(render(registry), media_type=CONTENT_TYPE)


@router.get(
    "/healthz",
    summary="Liveness and store check",
    responses={200: {"content": {"application/json": {"example": {"status": "ok"}}}}},
)
def healthz(settings: SettingsDep, store: StoreDep, runs: RunsDep) -> Response:
    store.ping()
    return json_response(
        {
            "status": "ok",
            "store": store.description,
            "writes_protected": settings.writes_protected,
            "reads_protected": settings.reads_protected,
            "live_runs": len(runs),
        }
    )
