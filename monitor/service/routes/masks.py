"""``POST /v1/masks``: keep masks of a batch under the server's or the request's parameters;
stores nothing."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ...core.batch import NonFinitePolicy
from ...core.masks import PolicyParams, keep_masks
from .. import openapi_examples as ex
from ..deps import (
    PolicyParamsDep,
    ServingDep,
    SettingsDep,
    read_body,
    require_write,
)
from ..ingest import parse_batch
from ..params import policy_names
from ..responses import encode_masks, json_response

__all__ = ["router"]

router = APIRouter()


def compute_masks(
    body: bytes,
    content_type: str,
    policies: list[str],
    params: PolicyParams,
    nonfinite: NonFinitePolicy,
) -> dict[str, object]:
    """The endpoint's answer: encoded masks plus the parameters they were computed with."""
    batch = parse_batch(body, content_type, nonfinite=nonfinite, reason=None)
    out = encode_masks(keep_masks(batch, policies, params), batch.num_tokens)
    return {**out, "params": asdict(params)}


@router.post(
    "/v1/masks",
    tags=["masks"],
    summary="Compute keep masks (stateless)",
    description=ex.MASKS_DESCRIPTION,
    responses=ex.MASKS_RESPONSES,
    openapi_extra={"requestBody": ex.BATCH_BODY},
    dependencies=[Depends(require_write)],
)
async def masks_endpoint(
    request: Request,
    settings: SettingsDep,
    params: PolicyParamsDep,
    serving: ServingDep,
    policies: Annotated[str, Query(description="comma-separated policies, or 'all'")] = "all",
) -> Response:
    wanted = policy_names(policies)
    ctype = request.headers.get("content-type", "")
    with serving.budget.reservation(None) as held:
        body = await read_body(request, settings.max_body, None, held)
        answer = await run_in_threadpool(
            compute_masks, body, ctype, wanted, params, settings.nonfinite
        )
    return json_response(answer)
