"""Ingest without HTTP: bytes of one batch in, the answer out, the store and the live registry
updated. The route only checks the request and reads the body; everything here runs in the
threadpool.

Errors are `ApiError` carrying the status, the detail and the rejection reason the app's handler
counts. Batch identity: a batch whose ``batch_id`` was already ingested with the same content
digest (`timwatch.monitor.core.digest.batch_digest`, independent of the wire format) is answered
from the store, and neither the store nor the registry changes (``replayed: true``); the same
``batch_id`` with other content answers 409 (reason ``conflict``) and stores nothing. A row
stored before digests existed (NULL) replays whatever is posted under its id.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.accumulator import Accumulator
from ..core.batch import Batch, NonFinitePolicy
from ..core.digest import batch_digest
from ..core.engine import accumulate
from ..core.errors import ApiError, BatchConflict, BatchError, InputError
from ..core.masks import PolicyParams, keep_masks
from ..core.row import derive_row
from ..core.runid import check_run_id
from ..core.tags import parse_tags
from ..store import Store
from ..store.totals import Tally
from .responses import encode_masks
from .runs import RunRegistry

__all__ = [
    "MAX_TAP_DROPPED",
    "SAFETENSORS",
    "TAP_DROPPED_HEADER",
    "check_run",
    "check_tags",
    "ingest_batch",
    "parse_batch",
    "parse_tap_dropped",
]

SAFETENSORS = "application/x-safetensors"
#: batches the posting tap dropped since its last accepted POST (a live counter per run)
TAP_DROPPED_HEADER = "Timwatch-Tap-Dropped"
MAX_TAP_DROPPED = 2**31

log = logging.getLogger("timwatch.api")


def check_run(run: str) -> None:
    """422 (counted as ``validation``) unless `run` is a valid run id."""
    problem = check_run_id(run)
    if problem:
        raise ApiError(422, problem, reason="validation", field="run")


def check_tags(raw: Sequence[str]) -> dict[str, str]:
    """The ``?tag=key=value`` list as a dict; 422 (``validation``) names a bad tag
    (`timwatch.monitor.core.tags`)."""
    try:
        return parse_tags(raw)
    except InputError as e:
        raise ApiError(422, e.message, reason="validation", field="tag") from None


def parse_tap_dropped(value: str | None) -> int:
    """The ``Timwatch-Tap-Dropped`` header: 0 when absent, else an integer 0..2^31; 422
    (``validation``) names the header otherwise."""
    if value is None:
        return 0
    text = value.strip()
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_TAP_DROPPED:
        raise ApiError(
            422,
            f"header {TAP_DROPPED_HEADER} must be an integer from 0 to {MAX_TAP_DROPPED}, "
            f"got {value[:40]!r}",
            reason="validation",
            field=TAP_DROPPED_HEADER,
        )
    return int(text)


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
    tap_dropped: int = 0,
    replica_id: str | None = None,
) -> dict[str, Any]:
    """Ingest one batch of `run` and answer what ``POST /v1/runs/{run}/batches`` answers.

    A new batch is accumulated, merged into its step in one store transaction and added to
    `runs` (with ``tap_dropped`` added to the run's tap-drop counter); a replay (same
    ``batch_id``, same digest) returns the stored answer with ``replayed: true`` and touches
    nothing; a conflict (same ``batch_id``, other digest) is a 409 and touches nothing. ``masks``
    adds the keep masks of those policies (computed for new batches and replays). With a
    ``replica_id`` a new batch is also counted in that replica's stored run totals, in the
    same transaction, and the run's counters are set to them (`RunRegistry.observe`).
    """
    check_run(run)
    batch = parse_batch(body, content_type, nonfinite=nonfinite, reason="validation")
    bid = batch.batch_id
    # only an id can be replayed or conflict; the digest costs about as much as the kernel
    digest = batch_digest(batch) if bid is not None else None
    try:
        stored = store.find_batch(run, bid, digest) if bid is not None else None
        if stored is None:
            answer, replayed = _record(
                store, runs, run, batch, params, dict(tags or {}), digest, tap_dropped, replica_id
            )
        else:
            answer, replayed = stored, True
    except BatchConflict as e:
        raise ApiError(
            409, e.message, reason="conflict", field="batch_id", batch_id=e.batch_id, step=e.step
        ) from None
    except InputError as e:  # tags over the per-run limit, found in the store transaction
        raise ApiError(422, e.message, reason="validation", field=e.field) from None
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
    digest: str | None,
    tap_dropped: int,
    replica_id: str | None,
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

    tally = None if replica_id is None else Tally(replica_id, tap_dropped)
    answer, replayed, _merged = store.record_batch(
        run, step=batch.step, batch_id=batch.batch_id, acc=acc,
        tokens=batch.num_tokens, respond=respond, tags=tags, digest=digest, tally=tally,
    )  # fmt: skip
    if not replayed:  # else a concurrent twin with this batch_id was stored and counted first
        totals = None
        if tally is not None and tally.totals is not None:
            totals = (tally.totals, tally.tap_dropped_total)
        runs.observe(run, acc, answer["step_row"], batch.step, tap_dropped, totals)
        if tap_dropped:
            log.warning(
                "run %s: the tap reports %d batches dropped before batch %s of step %d",
                run, tap_dropped, batch.batch_id, batch.step,
            )  # fmt: skip
    return answer, replayed
