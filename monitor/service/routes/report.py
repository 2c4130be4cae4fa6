"""``GET /v1/runs/{run}/report.html``: the incident report page of a run (monitor/report).

Read-protected like the history queries. The route is a plain function, so FastAPI runs it in
its threadpool: gathering and drawing (1.7-1.8 s for a 300-step run on a 2-core host,
`benchmarks/report_cost.py`; figures drawn before from the same data are reused,
`report.figcache`) never block the event loop that serves ``/metrics`` and ingest. With
``--tokenizer`` the worst tokens carry their text (``app.state.token_text``, loaded once by
``create_app``). A server installed without the ``[report]`` extra (matplotlib) answers 501
naming it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse

from ...core.errors import ApiError
from ...core.extras import extra_for, hint
from ...core.runid import check_run_id
from ...report import build_report
from .. import openapi_examples as ex
from ..deps import StoreDep, require_read
from .history import StepQuery, check_step_range

__all__ = ["router"]

router = APIRouter(tags=["history"], dependencies=[Depends(require_read)])


@router.get(
    "/v1/runs/{run}/report.html",
    summary="Incident report of a run (one self-contained HTML page)",
    description=ex.REPORT_DESCRIPTION,
    responses=ex.REPORT_RESPONSES,
    response_class=HTMLResponse,
)
def report_html(
    run: str,
    store: StoreDep,
    request: Request,
    from_step: StepQuery = None,
    to_step: StepQuery = None,
    against: Annotated[
        str | None, Query(description="compare with this run (a section at the top)")
    ] = None,
) -> HTMLResponse:
    check_step_range(from_step, to_step)
    if check_run_id(run):
        raise ApiError(404, f"run {run[:200]!r} not found")
    try:
        page = build_report(
            store, run, from_step=from_step, to_step=to_step,
            token_text=getattr(request.app.state, "token_text", None), against=against,
        )  # fmt: skip
    except LookupError as exc:
        missing = against if against is not None and exc.args == (against,) else run
        raise ApiError(404, f"run {missing[:200]!r} not found") from None
    except ModuleNotFoundError as exc:  # matplotlib: the server was installed without [report]
        extra = extra_for(exc.name or "")
        if extra is None:
            raise
        raise ApiError(501, hint("the incident report", extra) + " on the server") from None
    return HTMLResponse(page)
