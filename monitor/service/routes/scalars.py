"""``POST /v1/runs/{run}/scalars`` (a trainer's per-step scalars, mapped onto timwatch's names by
`timwatch.monitor.core.scalars`; needs the write token when one is set) and
``GET /v1/runs/{run}/scalars/series`` (their history; the read token; its own path, so
that a method neither route takes answers 405 with the right ``Allow``).

The body is JSON: ``{"step": int, "scalars": {name: number}, "source": framework or absent,
"nonfinite": [names the sender had NaN or ±inf for]}``. Bad input is a 422 naming the field
(``step``, ``source``, ``scalars``, ``scalars.<name>``, ``nonfinite[i]``), counted in
``timwatch_rejected_scalar_posts_total{reason}``; nothing is stored then. A step posted again
is not counted twice (`timwatch.monitor.store.scalars`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ...core.errors import ApiError, InputError
from ...core.scalars import (
    CANONICAL,
    MAX_NAME_CHARS,
    MAX_NAMES,
    check_source,
    check_step,
    map_scalars,
)
from .. import openapi_examples as ex
from ..deps import PagesDep, RunsDep, StoreDep, require_read, require_write
from ..ingest import TAP_DROPPED_HEADER, check_run, parse_tap_dropped
from ..responses import json_response, split_list
from .guard import page_headers
from .history import MAX_LAST, StepQuery, check_step_range, known_run

__all__ = ["MAX_SCALARS_BODY", "router"]

router = APIRouter(tags=["scalars"])

#: largest accepted body, bytes
MAX_SCALARS_BODY = 256 * 1024

_POST_DESCRIPTION = (
    "One step's scalars from the trainer's own logs. `scalars` maps names to numbers: "
    "canonical timwatch names when `source` is absent, else the framework's own names "
    "(`trl`, `verl`, ... see docs/integrations.md, Scalars). Names no map knows are kept "
    "(at most 64 per step) and listed as `unmapped`. Non-finite numbers are not JSON: list "
    "their names in `nonfinite` (stored as null). At most "
    f"{MAX_NAMES} names of at most {MAX_NAME_CHARS} characters. A step sent again overwrites "
    "its values (`replayed: true` when none changed): nothing is counted twice."
)


def _refuse(runs: Any, field: str, message: str, status: int = 422) -> ApiError:
    runs.reject_scalars("validation" if status == 422 else "too_large")
    return ApiError(status, message, field=field)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number: list the name in nonfinite")


def parse_body(raw: bytes) -> tuple[int, str | None, dict[str, Any]]:
    """``(step, source, scalars)`` of a body, non-finite names folded in as NaN; `InputError`
    naming the field otherwise."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError("body", f"body is not JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise InputError("body", "body must be a JSON object")
    extra = sorted(set(body) - {"step", "source", "scalars", "nonfinite"})
    if extra:
        raise InputError(extra[0], f"unknown field {extra[0]!r:.60}")
    step = check_step(body.get("step"))
    source = body.get("source")
    check_source(source)
    scalars = body.get("scalars", {})
    if not isinstance(scalars, dict):
        raise InputError("scalars", "scalars must be an object of name: number")
    nonfinite = body.get("nonfinite", [])
    if not isinstance(nonfinite, list) or len(nonfinite) > MAX_NAMES:
        raise InputError("nonfinite", f"nonfinite must be a list of at most {MAX_NAMES} names")
    values: dict[str, Any] = dict(scalars)
    for i, name in enumerate(nonfinite):
        if not isinstance(name, str) or name in values:
            why = "a name also in scalars" if isinstance(name, str) else "not a string"
            raise InputError(f"nonfinite[{i}]", f"nonfinite[{i}] is {why}")
        values[name] = float("nan")
    if not values:
        raise InputError("scalars", "scalars and nonfinite are both empty")
    return step, source, values


@router.post(
    "/v1/runs/{run}/scalars",
    summary="Ingest one step's trainer scalars",
    description=_POST_DESCRIPTION,
    responses=ex.SCALARS_POST_RESPONSES,
    dependencies=[Depends(require_write)],
)
async def post_scalars(
    run: str,
    request: Request,
    store: StoreDep,
    runs: RunsDep,
    pages: PagesDep,
    tap_dropped_header: Annotated[
        str | None,
        Header(
            alias=TAP_DROPPED_HEADER,
            description="posts the sending tap dropped since its last accepted post",
        ),
    ] = None,
) -> Response:
    try:
        check_run(run)
        tap_dropped = parse_tap_dropped(tap_dropped_header)
    except ApiError as e:
        runs.reject_scalars("validation")
        raise ApiError(e.status, e.detail, **e.extra) from None
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_SCALARS_BODY:
        raise _refuse(runs, "body", f"body exceeds {MAX_SCALARS_BODY} bytes", 413)
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_SCALARS_BODY:
            raise _refuse(runs, "body", f"body exceeds {MAX_SCALARS_BODY} bytes", 413)
    try:
        step, source, values = parse_body(raw)
        mapped = map_scalars(values, source)
    except InputError as e:
        raise _refuse(runs, e.field, e.message) from None
    answer = await run_in_threadpool(store.record_scalars, run, step, source, mapped)
    if tap_dropped and not answer["replayed"]:
        runs.add_tap_dropped(run, tap_dropped)
    runs.observe_scalars(run, step, source, mapped, answer)
    return json_response(answer, headers=page_headers(pages, run))


@router.get(
    "/v1/runs/{run}/scalars/series",
    summary="A run's trainer scalars by step",
    responses=ex.SCALARS_GET_RESPONSES,
    dependencies=[Depends(require_read)],
)
def get_scalars(
    run: str,
    store: StoreDep,
    names: Annotated[str | None, Query(description="canonical names, comma-separated")] = None,
    from_step: StepQuery = None,
    to_step: StepQuery = None,
    last: Annotated[int | None, Query(ge=1, le=MAX_LAST)] = None,
) -> Response:
    check_step_range(from_step, to_step)
    known_run(store, run)
    wanted = split_list(names) if names else None
    unknown = [n for n in wanted or () if n not in CANONICAL]
    if unknown:
        raise ApiError(
            422, f"unknown scalar {unknown[0]!r:.80}; known: {', '.join(CANONICAL)}", field="names"
        )
    out = store.query_scalars(run, wanted, from_step=from_step, to_step=to_step, last=last)
    return json_response({"run": run, **out})
