"""The write side of a batch's transaction: run bookkeeping, step rows, details, events.

Every function takes the open `Connection` of `Store.record_batch`, so a batch is written
whole or not at all.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Connection, Table, insert, select, update

from timwatch.monitor.store.models import (
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

__all__ = [
    "find_batch",
    "flatten_row",
    "lock_step_state",
    "step_columns",
    "touch_run",
    "write_batch_events",
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


def find_batch(conn: Connection, run: str, batch_id: str) -> dict[str, Any] | None:
    r = conn.execute(
        select(_batches.c.response).where(_batches.c.run_id == run, _batches.c.batch_id == batch_id)
    ).first()
    return None if r is None else r.response


def touch_run(
    conn: Connection, run: str, step: int, ts: float, tags: dict[str, str] | None
) -> None:
    cur = conn.execute(select(_runs.c.last_step, _runs.c.tags).where(_runs.c.id == run)).first()
    if cur is None:
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
        values["tags"] = {**(cur.tags or {}), **tags}
    conn.execute(update(_runs).where(_runs.c.id == run).values(**values))


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


def write_step_row(
    conn: Connection, run: str, step: int, ts: float, merged: Any, row: dict[str, Any], *, new: bool
) -> None:
    cols = flatten_row(row)
    cols["batches"] = int(merged.batches)
    cols["updated_at"] = ts
    detail = {
        "state": merged.to_state(),
        "row": row,
        "length_buckets": row.get("length_buckets"),
        "lag_buckets": row.get("lag_buckets"),
        "heatmap": row.get("heatmap"),
        "worst_tokens": row.get("worst_tokens"),
    }
    if new:
        conn.execute(insert(steps_table).values(run_id=run, step=step, **cols))
        conn.execute(insert(_details).values(run_id=run, step=step, **detail))
    else:
        where = (steps_table.c.run_id == run) & (steps_table.c.step == step)
        conn.execute(update(steps_table).where(where).values(**cols))
        conn.execute(
            update(_details)
            .where((_details.c.run_id == run) & (_details.c.step == step))
            .values(**detail)
        )
