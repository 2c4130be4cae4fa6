"""Columnar copy of the step series: the fast read path of ``GET /v1/runs/{run}/metrics``.

The wide ``steps`` table is the source of truth, but reading two columns of 100k rows from it
costs a scan of every row plus one Python tuple per step. ``series_chunks`` keeps each metric
as packed arrays instead: one row per (run, metric, chunk of ``CHUNK`` steps) holding the
values of those steps, little-endian float64 (NaN = null) or int64 (``INT_NULL`` = null), plus
one row per chunk under the reserved metric ``STEPS`` with the sorted int64 step numbers they
belong to (stored once per chunk, not once per metric, which halves what a batch rewrites).

The chunks of a step are rewritten in the step's own transaction (read-modify-write: insert the
step if new, overwrite its values if batches of the step merge), so they always equal the rows.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from sqlalchemy import Connection, Table, bindparam, column, insert, select, table, update

from ..core.errors import SeriesMismatch
from .models import COUNT_COLUMNS, METRIC_COLUMNS, series_table

__all__ = [
    "CHUNK",
    "INT_COLUMNS",
    "INT_NULL",
    "STEPS",
    "SeriesMismatch",
    "backfill",
    "jsonable",
    "read_series",
    "write_step",
]

#: steps per chunk: a batch rewrites ~70 blobs of up to CHUNK * 8 bytes; 256 keeps that under
#: a millisecond on SQLite and reads 100k steps in ~10 ms (benchmarks/series_chunks.py)
CHUNK = 256
#: reserved metric name of the rows holding the step numbers of a chunk
STEPS = "@steps"
#: integer-valued metrics, stored as int64 so they read back as exact integers
INT_COLUMNS = frozenset((*COUNT_COLUMNS, "batches", "policy_version"))
INT_NULL = int(np.iinfo(np.int64).min)
_I8 = np.dtype("<i8")
_F8 = np.dtype("<f8")

_t: Table = series_table


def _dtype(name: str) -> np.dtype[Any]:
    return _I8 if name in INT_COLUMNS else _F8


_SELECT = select(_t.c.metric, _t.c.data).where(
    _t.c.run_id == bindparam("b_run"), _t.c.chunk == bindparam("b_chunk")
)
_SELECT_LOCKED = _SELECT.with_for_update()
_UPDATE = (
    update(_t)
    .where(
        _t.c.run_id == bindparam("b_run"),
        _t.c.chunk == bindparam("b_chunk"),
        _t.c.metric == bindparam("b_m"),
    )
    .values(data=bindparam("b_d"))
)
_INSERT = insert(_t)
# PostgreSQL: one upsert of all metrics from arrays (executemany would run one per metric)
_PG_UPSERT = (
    "INSERT INTO series_chunks (run_id, metric, chunk, data) "
    "SELECT %(run)s, m, %(chunk)s, d FROM unnest(%(ms)s::varchar[], %(ds)s::bytea[]) AS u(m, d) "
    "ON CONFLICT (run_id, metric, chunk) DO UPDATE SET data = EXCLUDED.data"
)
_Q = struct.Struct("<q")
_D = struct.Struct("<d")


def write_step(conn: Connection, run: str, step: int, cols: dict[str, Any], *, lock: bool) -> None:
    """Put ``step``'s values ``cols`` (every name of ``METRIC_COLUMNS``) into its chunk.

    ``lock`` takes row locks on the chunk (PostgreSQL: writers of other steps of the chunk
    wait instead of losing each other's update; a first insert race ends in IntegrityError,
    which the caller retries). Values are spliced into the packed bytes directly (one slice
    and concatenation per metric; numpy per-metric calls cost more than the statements).
    """
    chunk = step // CHUNK
    key = {"b_run": run, "b_chunk": chunk}
    found: dict[str, bytes] = {
        m: bytes(d) for m, d in conn.execute(_SELECT_LOCKED if lock else _SELECT, key)
    }
    old_steps = np.frombuffer(found[STEPS], _I8) if STEPS in found else np.empty(0, _I8)
    n = len(old_steps)
    pos = int(np.searchsorted(old_steps, step))
    new = pos == n or int(old_steps[pos]) != step
    at, after = pos * 8, pos * 8 + (0 if new else 8)
    changed: list[tuple[str, bytes]] = []
    if new:
        old = found.get(STEPS, b"")
        changed.append((STEPS, old[:at] + _Q.pack(step) + old[at:]))
    for name in METRIC_COLUMNS:
        value = cols[name]
        if name in INT_COLUMNS:
            packed = _Q.pack(INT_NULL if value is None else int(value))
            fill = _Q.pack(INT_NULL)
        else:
            packed = _D.pack(float("nan") if value is None else float(value))
            fill = _D.pack(float("nan"))
        prev = found.get(name)
        # a metric unknown to this chunk so far: nulls for its other steps
        old = fill * n if prev is None else prev
        if len(old) != 8 * n:
            raise SeriesMismatch(f"chunk {chunk} of {run!r}: {name} has {len(old) // 8} values")
        changed.append((name, old[:at] + packed + old[after:]))
    if conn.dialect.name == "postgresql":
        ms, ds = [m for m, _ in changed], [d for _, d in changed]
        conn.exec_driver_sql(_PG_UPSERT, {"run": run, "chunk": chunk, "ms": ms, "ds": ds})
        return
    ups = [{**key, "b_m": m, "b_d": d} for m, d in changed if m in found]
    adds = [{"run_id": run, "metric": m, "chunk": chunk, "data": d} for m, d in changed
            if m not in found]  # fmt: skip
    if ups:
        conn.execute(_UPDATE, ups)
    if adds:
        conn.execute(_INSERT, adds)


def read_series(
    conn: Connection,
    run: str,
    names: Sequence[str],
    *,
    from_step: int | None,
    to_step: int | None,
    last: int | None,
) -> tuple[np.ndarray[Any, Any], dict[str, np.ndarray[Any, Any]]]:
    """Steps and values of ``names`` within ``[from_step, to_step]`` (the last ``last``).

    Two statements (the step rows, then the value rows of only the chunks selected), so the
    caller must hold one snapshot across them: a transaction on SQLite, REPEATABLE READ on
    PostgreSQL. Nulls come back as NaN (float metrics) or ``INT_NULL`` (integer metrics).
    """
    sqlite = conn.dialect.name == "sqlite"
    ph = (lambda k: f":{k}") if sqlite else (lambda k: f"%({k})s")
    raw = conn.connection.dbapi_connection
    assert raw is not None
    lo = 0 if from_step is None else from_step // CHUNK
    hi = (1 << 62) if to_step is None else to_step // CHUNK
    params: dict[str, Any] = {"run": run, "m": STEPS, "lo": lo, "hi": hi}
    base = (
        f"SELECT metric, chunk, data FROM series_chunks WHERE run_id = {ph('run')} "
        f"AND chunk >= {ph('lo')} AND chunk <= {ph('hi')} AND "
    )
    cur = raw.cursor()
    try:
        cur.execute(base + f"metric = {ph('m')} ORDER BY chunk", params)
        step_rows = cur.fetchall()
        ids = [int(r[1]) for r in step_rows]
        parts = [np.frombuffer(r[2], _I8) for r in step_rows]
        steps = np.concatenate(parts) if parts else np.empty(0, _I8)
        i0 = 0 if from_step is None else int(np.searchsorted(steps, from_step, "left"))
        i1 = len(steps) if to_step is None else int(np.searchsorted(steps, to_step, "right"))
        if last is not None:
            i0 = max(i0, i1 - last)
        if i0 >= i1:
            return np.empty(0, _I8), {n: np.empty(0, _dtype(n)) for n in names}
        offsets = np.cumsum([0, *(len(p) for p in parts)])
        k0 = int(np.searchsorted(offsets, i0, "right")) - 1
        k1 = int(np.searchsorted(offsets, i1 - 1, "right")) - 1
        wanted = sorted(set(names))
        params = {"run": run, "lo": ids[k0], "hi": ids[k1]}
        params.update({f"m{i}": n for i, n in enumerate(wanted)})
        in_list = ", ".join(ph(f"m{i}") for i in range(len(wanted)))
        cur.execute(base + f"metric IN ({in_list}) ORDER BY metric, chunk", params)
        value_rows = cur.fetchall()
    finally:
        cur.close()
    by_metric: dict[str, list[tuple[int, Any]]] = {n: [] for n in wanted}
    for metric, chunk, data in value_rows:
        by_metric[metric].append((int(chunk), data))
    span = ids[k0 : k1 + 1]
    n_span = int(offsets[k1 + 1] - offsets[k0])
    out: dict[str, np.ndarray[Any, Any]] = {}
    for name in wanted:
        got = by_metric[name]
        if [c for c, _ in got] != span:
            raise SeriesMismatch(f"{name} of {run!r} lacks chunks")
        arr = np.concatenate([np.frombuffer(d, _dtype(name)) for _, d in got])
        if len(arr) != n_span:
            raise SeriesMismatch(f"{name} of {run!r}: {len(arr)} values for {n_span} steps")
        out[name] = arr[i0 - offsets[k0] : i1 - offsets[k0]]
    return steps[i0:i1], {n: out[n] for n in names}


def jsonable(name: str, values: np.ndarray[Any, Any]) -> Any:
    """``values`` of metric ``name`` as orjson encodes them like the row path's lists.

    Float arrays go as they are (orjson writes NaN as ``null``, the bytes of every other value
    as for a Python float); integer arrays with nulls become lists with ``None``.
    """
    if name not in INT_COLUMNS:
        return values
    nulls = np.flatnonzero(values == INT_NULL)
    if not len(nulls):
        return values
    out: list[Any] = values.tolist()
    for i in nulls.tolist():
        out[i] = None
    return out


def backfill(
    conn: Connection,
    names: Iterable[str] = METRIC_COLUMNS,
    int_names: Iterable[str] = INT_COLUMNS,
    runs: Iterable[str] | None = None,
) -> int:
    """Build the chunks of ``runs`` (default: every run) from ``steps``; returns steps read.

    Used by migration 0002 with its frozen column lists, and by benchmarks that write rows in
    bulk. Replaces whatever chunks those runs had.
    """
    names = list(names)
    ints = set(int_names)
    if runs is None:
        runs = [r for (r,) in conn.exec_driver_sql("SELECT DISTINCT run_id FROM steps")]
    total = 0
    # lightweight table clause: the migration's frozen names, not whatever the model has now
    steps = table("steps", column("run_id"), column("step"), *(column(n) for n in names))
    for run in runs:
        conn.execute(_t.delete().where(_t.c.run_id == run))
        rows = conn.execute(
            select(steps.c.step, *(steps.c[n] for n in names))
            .where(steps.c.run_id == run)
            .order_by(steps.c.step)
        ).all()
        total += len(rows)
        if not rows:
            continue
        step_arr = np.array([r[0] for r in rows], _I8)
        chunk_of = step_arr // CHUNK
        cuts = np.flatnonzero(np.diff(chunk_of)) + 1
        bounds = [0, *cuts.tolist(), len(step_arr)]
        columns: list[tuple[str, np.ndarray[Any, Any]]] = [(STEPS, step_arr)]
        for j, n in enumerate(names, 1):
            if n in ints:
                columns.append((n, np.array([INT_NULL if r[j] is None else int(r[j])
                                             for r in rows], _I8)))  # fmt: skip
            else:
                columns.append((n, np.array([np.nan if r[j] is None else float(r[j])
                                             for r in rows], _F8)))  # fmt: skip
        batch: list[dict[str, Any]] = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            c = int(chunk_of[a])
            batch.extend(
                {"run_id": run, "metric": n, "chunk": c, "data": arr[a:b].tobytes()}
                for n, arr in columns
            )
            if len(batch) >= 5000:
                conn.execute(insert(_t), batch)
                batch = []
        if batch:
            conn.execute(insert(_t), batch)
    return total
