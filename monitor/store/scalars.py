"""Reads and writes of ``step_scalars``: the per-step scalars a trainer logged.

Invariants:
- `write_scalars` runs in one transaction with the run's bookkeeping: a step's values are
  upserted under (run, step, kind, name), so a post sent again (a retry, a resumed trainer
  logging the same step) changes nothing when its values are the same and overwrites them when
  they differ; nothing is ever added up. ``replayed`` is true exactly when nothing changed.
- At most `MAX_UNMAPPED` unmapped names are kept per (run, step); the rest are answered as
  ``unmapped_dropped``, never stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import Connection, Table, insert, select, update

from ..core.scalars import CANONICAL, MappedScalars
from .models import StepScalar
from .writes import touch_run

__all__ = ["MAX_UNMAPPED", "UNMAPPED", "read_scalars", "write_scalars"]

_scalars = cast(Table, StepScalar.__table__)
#: the ``kind`` of a name no map knows
UNMAPPED = "unmapped"
#: unmapped names kept per (run, step)
MAX_UNMAPPED = 64


def write_scalars(
    conn: Connection, run: str, step: int, source: str | None, mapped: MappedScalars, ts: float
) -> dict[str, Any]:
    """Store one step's mapped scalars (see the module docstring); the answer."""
    touch_run(conn, run, step, ts, None)
    c = _scalars.c
    stored = {
        (r.kind, r.name): r.value
        for r in conn.execute(
            select(c.kind, c.name, c.value).where(c.run_id == run, c.step == step)
        )
    }
    rows: list[tuple[str, str, float | None, str]] = [
        (CANONICAL[name].kind, name, value, mapped.origin[name])
        for name, value in mapped.canonical.items()
    ]
    kept_unmapped = sum(1 for kind, _ in stored if kind == UNMAPPED)
    dropped = 0
    for name, value in mapped.unmapped.items():
        if (UNMAPPED, name) not in stored:
            if kept_unmapped >= MAX_UNMAPPED:
                dropped += 1
                continue
            kept_unmapped += 1
        rows.append((UNMAPPED, name, value, name))
    new = changed = 0
    for kind, name, value, origin in rows:
        key = (kind, name)
        if key not in stored:
            conn.execute(
                insert(_scalars).values(
                    run_id=run, step=step, kind=kind, name=name, value=value, source=source,
                    origin=origin, updated_at=ts,
                )
            )  # fmt: skip
            new += 1
        elif stored[key] != value:
            conn.execute(
                update(_scalars)
                .where(c.run_id == run, c.step == step, c.kind == kind, c.name == name)
                .values(value=value, source=source, origin=origin, updated_at=ts)
            )
            changed += 1
    return {
        "run": run,
        "step": step,
        "source": source,
        "stored": sorted(mapped.canonical),
        "unmapped": sorted(mapped.unmapped),
        "unmapped_dropped": dropped,
        "nonfinite": list(mapped.nonfinite),
        "new": new,
        "changed": changed,
        "replayed": new == 0 and changed == 0,
    }


def read_scalars(
    conn: Connection,
    run: str,
    names: Sequence[str] | None = None,
    *,
    from_step: int | None = None,
    to_step: int | None = None,
    last: int | None = None,
) -> dict[str, Any]:
    """``{"steps": [...], "scalars": {name: [value or None per step]}, "sources": {name:
    source}}`` of `run`'s canonical scalars (`names`, default all stored), ordered by step;
    ``last`` keeps the last steps that have any of them."""
    c = _scalars.c
    where = [c.run_id == run, c.kind != UNMAPPED]
    if names is not None:
        where.append(c.name.in_(list(names)))
    if from_step is not None:
        where.append(c.step >= from_step)
    if to_step is not None:
        where.append(c.step <= to_step)
    if last is not None:
        steps_q = select(c.step).where(*where).group_by(c.step).order_by(c.step.desc()).limit(last)
        kept = [r.step for r in conn.execute(steps_q)]
        where.append(c.step.in_(kept))
    rows = conn.execute(
        select(c.step, c.name, c.value, c.source).where(*where).order_by(c.step, c.name)
    ).all()
    steps = sorted({r.step for r in rows})
    index = {s: i for i, s in enumerate(steps)}
    wanted = list(names) if names is not None else sorted({r.name for r in rows})
    series: dict[str, list[float | None]] = {n: [None] * len(steps) for n in wanted}
    sources: dict[str, str | None] = {}
    for r in rows:
        series[r.name][index[r.step]] = r.value
        sources[r.name] = r.source
    return {"steps": steps, "scalars": series, "sources": sources}
