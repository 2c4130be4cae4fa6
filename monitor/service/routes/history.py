"""The history queries: ``GET /v1/runs``, ``/v1/runs/{run}/metrics``, ``/steps/{step}``,
``/events``. All need the read token when one is set."""

from __future__ import annotations

import csv
import io
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import Response

from ...core.errors import ApiError
from ...core.runid import check_run_id
from ...store import METRIC_COLUMNS, Store
from .. import openapi_examples as ex
from ..deps import StoreDep, require_read
from ..responses import json_response, metric_column, split_list

__all__ = ["MAX_LAST", "STEP_MAX", "StepQuery", "check_step_range", "known_run", "router"]

#: steps are BigInteger keys: every step parameter is bounded to [0, STEP_MAX] (a 422 naming
#: the parameter, never an overflow in the driver)
STEP_MAX = 2**63 - 1
#: the most steps ``last=N`` may ask for
MAX_LAST = 10**9
#: an optional, inclusive step bound of a query (``from_step``, ``to_step``)
StepQuery = Annotated[int | None, Query(ge=0, le=STEP_MAX)]

router = APIRouter(tags=["history"], dependencies=[Depends(require_read)])

_METRICS_DESCRIPTION = (
    "Columns by step. Names: "
    + ", ".join(METRIC_COLUMNS)
    + " (`mask_ratio.estr` and `mask_ratio[estr]` also work). `from_step`/`to_step` "
    "are inclusive; `last=N` keeps the last N steps."
)


def known_run(store: Store, run: str) -> None:
    """404 unless `run` is a valid id the store knows."""
    if check_run_id(run) or not store.run_exists(run):
        raise ApiError(404, f"run {run[:200]!r} not found")


def check_step_range(from_step: int | None, to_step: int | None) -> None:
    """422 when both bounds are given and ``from_step`` is after ``to_step``."""
    if from_step is not None and to_step is not None and from_step > to_step:
        raise ApiError(422, f"from_step {from_step} is after to_step {to_step}")


def _columns(requested: list[str]) -> list[str]:
    """Store columns of the requested names (422 for none or an unknown one)."""
    if not requested:
        raise ApiError(422, "names must list at least one metric")
    cols = [metric_column(n) for n in requested]
    bad = [n for n, c in zip(requested, cols, strict=True) if c not in METRIC_COLUMNS]
    if bad:
        raise ApiError(422, f"unknown metric {bad[0]!r}; known: {', '.join(METRIC_COLUMNS)}")
    return cols


@router.get("/v1/runs", summary="List runs", responses=ex.RUNS_RESPONSES)
def list_runs(store: StoreDep) -> Response:
    return json_response({"runs": store.list_runs()})


@router.get(
    "/v1/runs/{run}/metrics",
    summary="Metric series of a run",
    description=_METRICS_DESCRIPTION,
    responses=ex.METRICS_RESPONSES,
)
def metrics_query(
    run: str,
    store: StoreDep,
    names: Annotated[str, Query(description="comma-separated metric names")] = "mismatch_kl",
    from_step: StepQuery = None,
    to_step: StepQuery = None,
    last: Annotated[int | None, Query(ge=1, le=MAX_LAST)] = None,
    format: Annotated[str, Query(pattern="^(json|csv)$")] = "json",
) -> Response:
    requested = split_list(names)
    cols = _columns(requested)
    known_run(store, run)
    window = {"from_step": from_step, "to_step": to_step, "last": last}
    if format == "csv":
        steps, rows = store.query_metrics(run, cols, **window)
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["step", *requested])
        columns = [rows[c] for c in cols]
        for i, s in enumerate(steps):
            w.writerow([s, *("" if c[i] is None else repr(c[i]) for c in columns)])
        return Response(buf.getvalue(), media_type="text/csv")
    # columnar read path: numpy arrays straight into orjson, same JSON as the row path
    steps_arr, series = store.query_series(run, cols, **window)
    out = {n: series[c] for n, c in zip(requested, cols, strict=True)}
    return json_response({"run": run, "steps": steps_arr, "series": out})


@router.get(
    "/v1/runs/{run}/steps/{step}",
    summary="One step's row and details",
    responses=ex.STEP_RESPONSES,
)
def get_step(run: str, step: Annotated[int, Path(ge=0, le=STEP_MAX)], store: StoreDep) -> Response:
    found = None if check_run_id(run) else store.get_step(run, step)
    if found is None:
        raise ApiError(404, f"step {step} of run {run[:200]!r} not found")
    return json_response(found)


@router.get(
    "/v1/runs/{run}/events", summary="Recent events of a run", responses=ex.EVENTS_RESPONSES
)
def get_events(
    run: str, store: StoreDep, limit: Annotated[int, Query(ge=1, le=10000)] = 100
) -> Response:
    known_run(store, run)
    return json_response({"run": run, "events": store.list_events(run, limit)})
