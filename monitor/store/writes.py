"""The write side of a batch's transaction: run bookkeeping, step rows, details, events.

Every function takes the open `Connection` of `Store.record_batch`, so a batch is written
whole or not at all.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, NamedTuple, cast

from sqlalchemy import Connection, Table, bindparam, insert, select, update

from ..core.accumulator import Accumulator
from ..core.errors import BatchConflict
from ..core.row import derive_row
from ..core.tags import check_tag_count
from .models import (
    COUNT_COLUMNS,
    FLOAT_COLUMNS,
    MASK_POLICIES,
    SEQ_POLICIES,
    BatchRecord,
    Event,
    Run,
    StepDetail,
    steps_table,
)
from .series import write_step as write_series
from .totals import Tally, add_to_totals

__all__ = [
    "StoredBatch",
    "find_batch",
    "finish_run",
    "flatten_row",
    "replay_of",
    "lock_step_state",
    "step_columns",
    "touch_run",
    "write_batch_events",
    "write_new_batch",
    "write_step_row",
]

_runs = cast(Table, Run.__table__)
_details = cast(Table, StepDetail.__table__)
_batches = cast(Table, BatchRecord.__table__)
_events = cast(Table, Event.__table__)


def flatten_row(row: dict[str, Any]) -> dict[str, Any]:
    """The ``steps`` columns of a metric row: scalars as-is, per-policy ratios flattened."""
    out: dict[str, Any] = {}
    for name in COUNT_COLUMNS:
        v = row.get(name)
        out[name] = None if v is None else int(v)
    for name in FLOAT_COLUMNS:
        if name.startswith(("mask_ratio_", "seq_reject_ratio_")):
            continue
        v = row.get(name)
        out[name] = None if v is None else float(v)
    mask = row.get("mask_ratio") or {}
    for p in MASK_POLICIES:
        v = mask.get(p)
        out[f"mask_ratio_{p}"] = None if v is None else float(v)
    rej = row.get("seq_reject_ratio") or {}
    for p in SEQ_POLICIES:
        v = rej.get(p)
        out[f"seq_reject_ratio_{p}"] = None if v is None else float(v)
    out["policy_version"] = row.get("policy_version")
    out["entropy_source"] = row.get("entropy_source")
    return out


class StoredBatch(NamedTuple):
    """A batch row: the answer given when it was ingested, its step and its content digest
    (None on rows stored before migration 0004)."""

    response: dict[str, Any]
    step: int
    digest: str | None


def find_batch(conn: Connection, run: str, batch_id: str) -> StoredBatch | None:
    r = conn.execute(
        select(_batches.c.response, _batches.c.step, _batches.c.digest).where(
            _batches.c.run_id == run, _batches.c.batch_id == batch_id
        )
    ).first()
    return None if r is None else StoredBatch(r.response, int(r.step), r.digest)


def replay_of(
    conn: Connection, run: str, batch_id: str, digest: str | None
) -> dict[str, Any] | None:
    """The stored answer if ``batch_id`` is known and its content is the same, None if the id
    is new; `BatchConflict` if the id is known with another digest. A stored NULL digest (a row
    from before migration 0004) or no ``digest`` to compare counts as the same content."""
    found = find_batch(conn, run, batch_id)
    if found is None:
        return None
    if digest is not None and found.digest is not None and found.digest != digest:
        raise BatchConflict(run, batch_id, found.step)
    return found.response


def touch_run(
    conn: Connection, run: str, step: int, ts: float, tags: dict[str, str] | None
) -> None:
    """Create the run or update its bookkeeping: last step, merged tags (at most `MAX_TAGS`,
    else `InputError` and the transaction rolls back) and re-opening a finished run."""
    cur = conn.execute(
        select(_runs.c.last_step, _runs.c.tags, _runs.c.finished_at).where(_runs.c.id == run)
    ).first()
    if cur is None:
        check_tag_count(tags or {}, run)
        conn.execute(
            insert(_runs).values(
                id=run, first_seen=ts, last_seen=ts, last_step=step, tags=tags or {}
            )
        )
        conn.execute(
            insert(_events).values(run_id=run, ts=ts, kind="run_created", step=step, message="")
        )
        return
    values: dict[str, Any] = {"last_seen": ts}
    if cur.last_step is None or step > cur.last_step:
        values["last_step"] = step
    if tags:
        merged = {**(cur.tags or {}), **tags}
        check_tag_count(merged, run)
        values["tags"] = merged
    if cur.finished_at is not None:
        values["finished_at"] = None
        conn.execute(
            insert(_events).values(
                run_id=run, ts=ts, kind="run_reopened", step=step,
                message="a batch arrived after the run was finished",
            )
        )  # fmt: skip
    conn.execute(update(_runs).where(_runs.c.id == run).values(**values))


def finish_run(conn: Connection, run: str, ts: float) -> tuple[float, bool] | None:
    """Mark ``run`` finished at ``ts`` (event ``run_finished``). Returns ``(finished_at,
    newly)``: an already finished run keeps its first time and gets no second event; None for
    an unknown run."""
    cur = conn.execute(
        select(_runs.c.finished_at, _runs.c.last_step).where(_runs.c.id == run)
    ).first()
    if cur is None:
        return None
    if cur.finished_at is not None:
        return float(cur.finished_at), False
    conn.execute(update(_runs).where(_runs.c.id == run).values(finished_at=ts))
    conn.execute(
        insert(_events).values(
            run_id=run, ts=ts, kind="run_finished", step=cur.last_step, message=""
        )
    )
    return ts, True


def write_batch_events(conn: Connection, run: str, step: int, ts: float, acc: Any) -> None:
    """Events worth finding weeks later, written in the batch's own transaction."""
    events = []
    if acc.tid_mismatch:
        events.append(
            ("token_id_drift", f"{acc.tid_mismatch} of {acc.tid_tokens} token ids differ",
             {"mismatched": acc.tid_mismatch, "tokens": acc.tid_tokens})
        )  # fmt: skip
    if acc.nonfinite_tokens:
        events.append(
            ("nonfinite_dropped", f"{acc.nonfinite_tokens} non-finite tokens dropped",
             {"tokens": acc.nonfinite_tokens})
        )  # fmt: skip
    if acc.impossible_tokens:
        events.append(
            ("impossible_tokens",
             f"{acc.impossible_tokens} tokens one side gives probability 0 (δ = ±∞), left out",
             {"tokens": acc.impossible_tokens})
        )  # fmt: skip
    for kind, message, data in events:
        conn.execute(
            insert(_events).values(
                run_id=run, ts=ts, kind=kind, step=step, message=message, data=data
            )
        )


def lock_step_state(conn: Connection, run: str, step: int, sqlite: bool) -> dict[str, Any] | None:
    stmt = select(_details.c.state).where(_details.c.run_id == run, _details.c.step == step)
    if not sqlite:
        stmt = stmt.with_for_update()
    r = conn.execute(stmt).first()
    return None if r is None else r.state


def step_columns(merged: Any, row: dict[str, Any]) -> dict[str, Any]:
    return {**flatten_row(row), "batches": int(merged.batches)}


_UPDATE_STEP = update(steps_table).where(
    (steps_table.c.run_id == bindparam("b_run")) & (steps_table.c.step == bindparam("b_step"))
)
_UPDATE_DETAILS = update(_details).where(
    (_details.c.run_id == bindparam("b_run")) & (_details.c.step == bindparam("b_step"))
)


def write_step_row(
    conn: Connection,
    run: str,
    step: int,
    ts: float,
    merged: Any,
    row: dict[str, Any],
    *,
    new: bool,
    cols: dict[str, Any],
) -> None:
    """The step's row and details; ``cols``: `step_columns` of ``merged`` and ``row`` (not
    changed here: the series is written from them too)."""
    cols = {**cols, "updated_at": ts}
    detail = {
        "state": merged.to_state(),
        "row": row,
        "length_buckets": row.get("length_buckets"),
        "lag_buckets": row.get("lag_buckets"),
        "heatmap": row.get("heatmap"),
        "worst_tokens": row.get("worst_tokens"),
    }
    # the values go as execution parameters, not `.values(**cols)`: SQLAlchemy then reuses the
    # compiled statement instead of coercing ~60 columns into a new one for every batch
    if new:
        conn.execute(insert(steps_table), {"run_id": run, "step": step, **cols})
        conn.execute(insert(_details), {"run_id": run, "step": step, **detail})
    else:
        conn.execute(_UPDATE_STEP, {"b_run": run, "b_step": step, **cols})
        conn.execute(_UPDATE_DETAILS, {"b_run": run, "b_step": step, **detail})


def write_new_batch(
    conn: Connection,
    run: str,
    *,
    step: int,
    batch_id: str | None,
    acc: Accumulator,
    tokens: int,
    respond: Callable[[dict[str, Any]], dict[str, Any]],
    tags: dict[str, str] | None,
    ts: float,
    digest: str | None,
    sqlite: bool,
    tally: Tally | None = None,
) -> tuple[dict[str, Any], Accumulator]:
    """Everything a new batch writes (run, step row, details, series, events, the batch row
    with its answer and digest, and with a `tally` the replica's run totals, last so their row
    lock is held the shortest); returns ``(answer, merged step accumulator)``."""
    touch_run(conn, run, step, ts, tags)
    prev = lock_step_state(conn, run, step, sqlite)
    merged = acc if prev is None else Accumulator.from_state(prev).merge(acc)
    row = derive_row(merged).to_dict()
    cols = step_columns(merged, row)  # flattened once, for the step row and the series
    write_step_row(conn, run, step, ts, merged, row, new=prev is None, cols=cols)
    write_series(conn, run, step, cols, lock=not sqlite)
    write_batch_events(conn, run, step, ts, acc)
    answer = respond(row)
    conn.execute(
        insert(_batches).values(
            run_id=run,
            batch_id=batch_id if batch_id is not None else f"~{uuid.uuid4()}",
            step=step,
            received_at=ts,
            tokens=tokens,
            response=answer,
            digest=digest,
        )
    )
    if tally is not None:
        add_to_totals(conn, run, step, ts, acc, tally, sqlite)
    return answer, merged
