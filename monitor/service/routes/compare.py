"""``GET /v1/compare?a=…&b=…``: run B against run A (`timwatch.monitor.compare`): the headline
metrics side by side, B/A with a 95 % bootstrap interval over steps, where the difference lives
and one verdict line; ``markdown`` holds the same as a Markdown block. Read-protected like the
history. Unknown runs are a 404 naming the run, an empty step range a 422."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response

from ...compare import compare_series, comparison_markdown
from ...core.errors import ApiError
from ...diagnosis import load_series
from ..deps import StoreDep, require_read
from ..responses import json_response
from .history import StepQuery, check_step_range, known_run

__all__ = ["router"]

router = APIRouter(tags=["history"], dependencies=[Depends(require_read)])


@router.get(
    "/v1/compare",
    summary="Compare two runs",
    description="Run `b` against run `a`: each headline metric's means, the ratio b/a with a "
    "95 % percentile bootstrap interval over steps (`seed` fixes the resampling), the length "
    "and version-lag buckets both runs have, b's worst tokens, one verdict line that names a "
    "diagnosis cause firing in b and not in a, and the same as Markdown (docs/compare.md).",
    responses={
        401: {"description": "a read token is set and was not sent"},
        404: {"description": "unknown run"},
        422: {"description": "bad range or no steps"},
    },
)
def get_compare(
    store: StoreDep,
    a: Annotated[str, Query(description="the reference run")],
    b: Annotated[str, Query(description="the run compared with it")],
    from_step: StepQuery = None,
    to_step: StepQuery = None,
    seed: Annotated[int, Query(ge=0, le=2**32 - 1)] = 0,
) -> Response:
    check_step_range(from_step, to_step)
    known_run(store, a)
    known_run(store, b)
    sa = load_series(store, a, from_step, to_step)
    sb = load_series(store, b, from_step, to_step)
    for s in (sa, sb):
        if not len(s):
            raise ApiError(422, f"run {s.run!r} has no steps in the range asked")
    res = compare_series(sa, sb, seed=seed).to_dict()
    return json_response({**res, "markdown": comparison_markdown(res)})
