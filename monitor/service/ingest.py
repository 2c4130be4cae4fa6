"""Ingest without HTTP: bytes of one batch in, the answer out, the store and the live registry
updated. The route only checks the request and reads the body; everything here runs in the
threadpool.

Errors are `ApiError` carrying the status, the detail and the rejection reason the app's handler
counts; a batch whose ``batch_id`` was already ingested is answered from the store, and neither
the store nor the registry changes (``replayed: true``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from timwatch.monitor.core.accumulator import Accumulator
from timwatch.monitor.core.batch import Batch, NonFinitePolicy
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.errors import ApiError, BatchError
from timwatch.monitor.core.masks import PolicyParams, keep_masks
from timwatch.monitor.core.row import derive_row
from timwatch.monitor.core.runid import check_run_id
from timwatch.monitor.service.responses import encode_masks
from timwatch.monitor.service.runs import RunRegistry
from timwatch.monitor.store import Store

__all__ = ["SAFETENSORS", "check_run", "ingest_batch", "parse_batch"]

SAFETENSORS = "application/x-safetensors"


def check_run(run: str) -> None:
    """422 (counted as ``validation``) unless `run` is a valid run id."""
    problem = check_run_id(run)
    if problem:
        raise ApiError(422, problem, reason="validation", field="run")


def parse_batch(
    body: bytes, content_type: str, *, nonfinite: NonFinitePolicy, reason: str | None
) -> Batch:
    """A validated `Batch` from a JSON (also no content type) or safetensors body: 422 names
    the field and index of the first problem, 415 an unknown content type. JSON is parsed
    straight into arrays (`Batch.from_json_bytes`: bounded memory, no recursion)."""
    ctype = content_type.split(";")[0].strip().lower()
    try:
        if ctype == SAFETENSORS:
            return Batch.from_safetensors(body, nonfinite=nonfinite)
        if ctype in ("", "application/json"):
            return Batch.from_json_bytes(body, nonfinite=nonfinite)
    except BatchError as e:
        raise ApiError(422, str(e), reason=reason, field=e.field, index=e.index) from None
    raise ApiError(
        415,
        f"unsupported content type {ctype!r}; use application/json or {SAFETENSORS}",
        reason=reason,
    )


def ingest_batch(
    store: Store,
    runs: RunRegistry,
    run: str,
    body: bytes,
    content_type: str,
    *,
    params: PolicyParams,
    nonfinite: NonFinitePolicy = "refuse",
    masks: Sequence[str] = (),
    tags: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Ingest one batch of `run` and answer what ``POST /v1/runs/{run}/batches`` answers.

    A new batch is accumulated, merged into its step in one store transaction and added to
    `runs`; a replay (same ``batch_id``) returns the stored answer with ``replayed: true`` and
    touches nothing. ``masks`` adds the keep masks of those policies (computed either way).
    """
    check_run(run)
    batch = parse_batch(body, content_type, nonfinite=nonfinite, reason="validation")
    stored = store.find_batch(run, batch.batch_id) if batch.batch_id is not None else None
    if stored is None:
        answer, replayed = _record(store, runs, run, batch, params, dict(tags or {}))
    else:
        answer, replayed = stored, True
    answer = {**answer, "replayed": replayed}
    if masks:
        answer["masks"] = encode_masks(keep_masks(batch, masks, params), batch.num_tokens)
    return answer


def _record(
    store: Store,
    runs: RunRegistry,
    run: str,
    batch: Batch,
    params: PolicyParams,
    tags: dict[str, str],
) -> tuple[dict[str, Any], bool]:
    acc: Accumulator = accumulate(batch, params)
    batch_row = derive_row(acc).to_dict()

    def respond(step_row: dict[str, Any]) -> dict[str, Any]:
        return {
            "run": run,
            "step": batch.step,
            "batch_id": batch.batch_id,
            "replayed": False,
            "row": batch_row,
            "step_row": step_row,
        }

    answer, replayed, _merged = store.record_batch(
        run, step=batch.step, batch_id=batch.batch_id, acc=acc,
        tokens=batch.num_tokens, respond=respond, tags=tags,
    )  # fmt: skip
    if not replayed:  # else a concurrent twin with this batch_id was stored and counted first
        runs.observe(run, acc, answer["step_row"], batch.step)
    return answer, replayed
