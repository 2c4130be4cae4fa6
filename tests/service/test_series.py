"""The columnar series chunks answer exactly what the ``steps`` rows answer (issue 3's fast
metrics query), on SQLite and on a real PostgreSQL: same steps, bit-identical float64 values,
same nulls, same JSON bytes; whether the chunks were written batch by batch or backfilled by
migration 0002 from rows that existed before it."""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select

import timwatch.monitor.store.series as series
from tests.helpers.batches import random_batch
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.jsoncodec import dumps
from timwatch.monitor.store import METRIC_COLUMNS, Store
from timwatch.monitor.store.db import MIGRATIONS_DIR
from timwatch.monitor.store.models import (
    MASK_POLICIES,
    SEQ_POLICIES,
    VERL_COLUMNS,
    series_table,
)

RUNS = ("alpha", 'we"ird\nrun', "gamma")
VERL_NEW = {
    *VERL_COLUMNS,
    *(f"mask_ratio_{p}" for p in MASK_POLICIES[8:]),
    *(f"seq_reject_ratio_{p}" for p in SEQ_POLICIES[3:]),
}  # the metric columns of migration 0003


def fill(store: Store, seed: int, batches: int) -> None:
    """Random batches: out-of-order sparse steps, repeated steps (merging), optional metrics
    present or absent (nulls), several runs interleaved."""
    rng = np.random.default_rng(seed)
    steps = rng.choice(60, size=25, replace=False)  # CHUNK=8 in the tests: 8 chunks, some empty
    for i in range(batches):
        run = RUNS[int(rng.integers(len(RUNS)))]
        step = int(rng.choice(steps))
        raw = random_batch(rng, n_seq=int(rng.integers(1, 5)), max_len=12)
        raw = dataclasses.replace(raw, step=step, batch_id=f"b{i}")
        batch = Batch.from_arrays(**raw.from_arrays_kwargs())
        store.record_batch(
            run, step=step, batch_id=batch.batch_id, acc=accumulate(batch),
            tokens=batch.num_tokens, respond=lambda row: {},
        )  # fmt: skip


RANGES: list[dict[str, int]] = [
    {},
    {"from_step": 7, "to_step": 33},
    {"from_step": 8, "to_step": 15},  # exactly one chunk
    {"to_step": 0},
    {"from_step": 41},
    {"last": 5},
    {"last": 1},
    {"from_step": 3, "to_step": 50, "last": 9},
    {"last": 10_000},
    {"from_step": 30, "to_step": 29},  # empty
    {"from_step": 10_000},  # past the end
]


def bits(v: Any) -> bytes | None:
    """A value as the JSON sees it: None for null and non-finite, else its exact float64 bits."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return None
    return struct.pack("<d", float(v)) if isinstance(v, float) else str(int(v)).encode()


def assert_same(store: Store, run: str, kw: dict[str, int]) -> int:
    names = list(METRIC_COLUMNS)
    steps, rows = store.query_metrics(run, names, **kw)
    csteps, cols = store.query_series(run, names, **kw)
    assert list(np.asarray(csteps, dtype=np.int64).tolist()) == steps, (run, kw)
    for name in names:
        got = cols[name]
        got = got.tolist() if isinstance(got, np.ndarray) else got
        assert len(got) == len(steps), (run, kw, name)
        if name in series.INT_COLUMNS:
            assert all(isinstance(g, int) or g is None for g in got), name
        assert [bits(g) for g in got] == [bits(r) for r in rows[name]], (run, kw, name)
    assert dumps({"steps": csteps, "series": cols}) == dumps({"steps": steps, "series": rows})
    return len(steps)


def assert_all_same(store: Store) -> None:
    seen = 0
    for run in (*RUNS, "no-such-run"):
        for kw in RANGES:
            seen += assert_same(store, run, kw)
    assert seen > 0
    _, rows = store.query_metrics(RUNS[0], list(METRIC_COLUMNS))
    nulls = {n for n, v in rows.items() if any(x is None for x in v)}
    assert nulls, "no null metric exercised"


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(series, "CHUNK", 8)


def test_chunks_equal_rows_for_random_runs(db_url: str, small_chunks: None) -> None:
    store = Store(db_url)
    try:
        fill(store, seed=11, batches=70)
        _, rows = store.query_metrics(RUNS[0], ["batches"])
        assert max(rows["batches"]) > 1, "no step merged several batches"
        assert_all_same(store)
    finally:
        store.close()


def test_migration_backfills_rows_written_before_it(db_url: str, small_chunks: None) -> None:
    """Chunks written batch by batch equal the ones migration 0002 builds from the rows."""
    from alembic import command
    from alembic.config import Config

    store = Store(db_url)
    try:
        fill(store, seed=12, batches=40)
        with store.engine.connect() as conn:
            stmt = select(series_table).order_by(*series_table.primary_key.columns)
            incremental = [tuple(r) for r in conn.execute(stmt)]
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
        with store.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0001")  # drops the chunks; the rows stay
        store.close()
        store = Store(db_url)  # upgrade to head: 0002 backfills
        with store.engine.connect() as conn:
            rebuilt = [tuple(r) for r in conn.execute(stmt)]
        assert len(rebuilt) > 3 * len(METRIC_COLUMNS)
        # metrics of migration 0003 come back null (their columns were dropped on the way down)
        for r in rebuilt:
            if r[1] in VERL_NEW:
                assert np.isnan(np.frombuffer(bytes(r[3]), "<f8")).all(), r[:3]
        assert [(r[:3], bytes(r[3])) for r in rebuilt if r[1] not in VERL_NEW] == [
            (r[:3], bytes(r[3])) for r in incremental if r[1] not in VERL_NEW
        ]
        assert_all_same(store)
    finally:
        store.close()


def test_migration_0003_gives_old_steps_null_new_metrics(db_url: str, small_chunks: None) -> None:
    """Steps stored before 0003 read the new metrics as null through both paths; batches that
    arrive afterwards (into old steps and new ones) fill them, and chunks still equal rows."""
    from alembic import command
    from alembic.config import Config

    store = Store(db_url)
    try:
        fill(store, seed=14, batches=30)
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
        with store.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0002")
        store.close()
        store = Store(db_url)
        steps, rows = store.query_metrics(RUNS[0], sorted(VERL_NEW))
        assert steps and all(v is None for name in VERL_NEW for v in rows[name])
        assert_all_same(store)
        fill(store, seed=15, batches=30)
        _, rows = store.query_metrics(RUNS[0], ["training_ppl", "mask_ratio_token_k1"])
        assert any(v is not None for v in rows["training_ppl"])
        assert_all_same(store)
    finally:
        store.close()


def test_inconsistent_chunks_fall_back_to_rows(db_url: str, small_chunks: None) -> None:
    store = Store(db_url)
    try:
        fill(store, seed=13, batches=10)
        with store.engine.begin() as conn:
            conn.execute(series_table.delete().where(series_table.c.metric == "mismatch_kl"))
        for run in RUNS:
            assert_same(store, run, {})
    finally:
        store.close()
