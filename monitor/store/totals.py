"""Per-replica run totals (table ``replica_totals``, migration 0006).

A replica started with an id (``timwatch serve --replica-id``) merges each batch it stores new
into its (replica, run) row in that batch's own transaction: the row is, at every commit, the
merge of exactly the batches this id has acknowledged as new, which is what its counters
export. The row is locked for the rest of the transaction (``SELECT … FOR UPDATE`` on
PostgreSQL; SQLite's single writer serialises anyway), so its batch count only grows and two
transactions of one replica never both read the same row. Two first batches of a run racing
on the INSERT: the loser gets an IntegrityError and its whole transaction is retried by
`Store.record_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from sqlalchemy import Connection, Table, insert, select, update

from ..core.accumulator import Accumulator
from .models import ReplicaTotals, Run, StepDetail

__all__ = ["SeedRow", "Tally", "add_to_totals", "seed_rows"]

_totals = cast(Table, ReplicaTotals.__table__)
_runs = cast(Table, Run.__table__)
_details = cast(Table, StepDetail.__table__)


@dataclass
class Tally:
    """A batch counted under ``replica_id``: in, the drops its tap reported with it; out (read
    after `Store.record_batch` returned, i.e. after the commit), the replica's run totals."""

    replica_id: str
    tap_dropped: int = 0
    totals: Accumulator | None = None
    tap_dropped_total: int = 0


def add_to_totals(
    conn: Connection, run: str, step: int, ts: float, acc: Accumulator, tally: Tally, sqlite: bool
) -> None:
    """Merge `acc` into `tally.replica_id`'s row of `run` (created on its first batch) and
    leave the merged totals in `tally`."""
    key = (_totals.c.replica_id == tally.replica_id) & (_totals.c.run_id == run)
    stmt = select(_totals.c.state, _totals.c.step, _totals.c.tap_dropped).where(key)
    if not sqlite:
        stmt = stmt.with_for_update()
    cur = conn.execute(stmt).first()
    if cur is None:
        merged, top, dropped = acc, step, tally.tap_dropped
        conn.execute(
            insert(_totals).values(
                replica_id=tally.replica_id, run_id=run, state=merged.to_state(), step=top,
                tap_dropped=dropped, updated_at=ts,
            )
        )  # fmt: skip
    else:
        merged = Accumulator.from_state(cur.state).merge(acc)
        top, dropped = max(int(cur.step), step), int(cur.tap_dropped) + tally.tap_dropped
        conn.execute(
            update(_totals)
            .where(key)
            .values(state=merged.to_state(), step=top, tap_dropped=dropped, updated_at=ts)
        )
    tally.totals, tally.tap_dropped_total = merged, dropped


class SeedRow(NamedTuple):
    """One run a replica had counted: its totals, the stored row of the highest step it took
    a batch of (the gauges), when it took its last batch and when the run was finished."""

    run: str
    totals: Accumulator
    step: int
    row: dict[str, Any]
    tap_dropped: int
    updated_at: float
    finished_at: float | None


def seed_rows(conn: Connection, replica_id: str, since: float) -> list[SeedRow]:
    """`replica_id`'s runs with a batch at or after the wall time `since`, sorted by run."""
    q = (
        select(
            _totals.c.run_id,
            _totals.c.state,
            _totals.c.step,
            _totals.c.tap_dropped,
            _totals.c.updated_at,
            _runs.c.finished_at,
            _details.c.row,
        )  # fmt: skip
        .join(_runs, _runs.c.id == _totals.c.run_id)
        .outerjoin(
            _details, (_details.c.run_id == _totals.c.run_id) & (_details.c.step == _totals.c.step)
        )
        .where(_totals.c.replica_id == replica_id, _totals.c.updated_at >= since)
        .order_by(_totals.c.run_id)
    )
    return [
        SeedRow(
            r.run_id,
            Accumulator.from_state(r.state),
            int(r.step),
            r.row or {},
            int(r.tap_dropped),
            float(r.updated_at),
            None if r.finished_at is None else float(r.finished_at),
        )  # fmt: skip
        for r in conn.execute(q)
    ]
