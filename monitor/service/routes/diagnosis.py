"""``GET /v1/runs/{run}/diagnosis``: the ranked causes of a run's mismatch with their evidence
(`timwatch.monitor.diagnosis`). Needs the read token when one is set, like the history."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response

from timwatch.monitor.core.errors import ApiError
from timwatch.monitor.core.runid import check_run_id
from timwatch.monitor.diagnosis import diagnose_run
from timwatch.monitor.service.deps import StoreDep, require_read
from timwatch.monitor.service.diagnosis_docs import DIAGNOSIS_DESCRIPTION, DIAGNOSIS_RESPONSES
from timwatch.monitor.service.responses import json_response
from timwatch.monitor.service.routes.history import STEP_MAX

__all__ = ["router"]

router = APIRouter(tags=["history"], dependencies=[Depends(require_read)])


@router.get(
    "/v1/runs/{run}/diagnosis",
    summary="Ranked causes of a run's mismatch",
    description=DIAGNOSIS_DESCRIPTION,
    responses=DIAGNOSIS_RESPONSES,
)
def get_diagnosis(
    run: str,
    store: StoreDep,
    from_step: Annotated[int | None, Query(ge=0, le=STEP_MAX)] = None,
    to_step: Annotated[int | None, Query(ge=0, le=STEP_MAX)] = None,
) -> Response:
    if check_run_id(run) or not store.run_exists(run):
        raise ApiError(404, f"run {run[:200]!r} not found")
    if from_step is not None and to_step is not None and from_step > to_step:
        raise ApiError(422, f"from_step {from_step} is after to_step {to_step}")
    return json_response(diagnose_run(store, run, from_step, to_step).to_dict())
