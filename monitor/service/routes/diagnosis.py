"""``GET /v1/runs/{run}/diagnosis``: the ranked causes of a run's mismatch with their evidence
(`timwatch.monitor.diagnosis`). Needs the read token when one is set, like the history."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from ...diagnosis import diagnose_run
from ..deps import StoreDep, require_read
from ..diagnosis_docs import DIAGNOSIS_DESCRIPTION, DIAGNOSIS_RESPONSES
from ..responses import json_response
from .history import StepQuery, check_step_range, known_run

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
    from_step: StepQuery = None,
    to_step: StepQuery = None,
) -> Response:
    known_run(store, run)
    check_step_range(from_step, to_step)
    return json_response(diagnose_run(store, run, from_step, to_step).to_dict())
