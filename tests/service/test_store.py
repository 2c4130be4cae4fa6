"""The history store on SQLite and on a real PostgreSQL (docs/reference/api.md, history)."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np
import pytest
from sqlalchemy import inspect

from tests.helpers.batches import RawBatch, random_batch, split_at
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import Accumulator, accumulate
from timwatch.monitor.core.errors import StoreUnavailable
from timwatch.monitor.core.jsoncodec import dumps, loads
from timwatch.monitor.core.row import derive_row
from timwatch.monitor.store import METRIC_COLUMNS, Store, flatten_row


def norm(obj: Any) -> Any:
    return loads(dumps(obj))


def raw_batch(seed: int, step: int = 0, batch_id: str | None = None, n_seq: int = 10) -> RawBatch:
    raw = random_batch(np.random.default_rng(seed), n_seq=n_seq, optional="all")
    return dataclasses.replace(raw, step=step, batch_id=batch_id)


def record(store: Store, run: str, raw: RawBatch) -> tuple[dict[str, Any], bool, Any]:
    batch = Batch.from_arrays(**raw.from_arrays_kwargs())
    acc = accumulate(batch)
    return store.record_batch(
        run, step=batch.step, batch_id=batch.batch_id, acc=acc, tokens=batch.num_tokens,
        respond=lambda row: {"step_row": row},
    )  # fmt: skip


@pytest.fixture
def store(db_url: str) -> Any:
    s = Store(db_url)
    yield s
    s.close()


def test_migrations_create_schema_and_are_rerunnable(db_url: str) -> None:
    from alembic.migration import MigrationContext

    s = Store(db_url)
    s.close()
    s = Store(db_url)  # second start: upgrade is a no-op
    tables = set(inspect(s.engine).get_table_names())
    assert {
        "runs",
        "steps",
        "step_details",
        "batches",
        "events",
        "series_chunks",
        "replica_totals",
        "step_scalars",
        "alembic_version",
    } <= tables
    cols = {c["name"] for c in inspect(s.engine).get_columns("steps")}
    assert set(METRIC_COLUMNS) <= cols
    with s.engine.connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() == "0007"
    s.close()


def test_step_row_columns_state_and_details(store: Store) -> None:
    raw = raw_batch(1, step=4, batch_id="a")
    answer, replayed, merged = record(store, "r", raw)
    want = norm(derive_row(accumulate(Batch.from_arrays(**raw.from_arrays_kwargs()))).to_dict())
    assert not replayed and norm(answer["step_row"]) == want
    got = store.get_step("r", 4)
    assert got is not None and got["row"] == want and got["batches"] == 1
    state = store.get_step_state("r", 4)
    assert state is not None
    assert norm(derive_row(Accumulator.from_state(state)).to_dict()) == want
    flat = flatten_row(want)
    steps, series = store.query_metrics("r", list(METRIC_COLUMNS))
    assert steps == [4]
    for name in METRIC_COLUMNS:
        expected = 1 if name == "batches" else flat[name]
        assert series[name] == [expected], name


def test_batches_of_one_step_merge_exactly_and_replays_change_nothing(store: Store) -> None:
    raw = raw_batch(2, step=9, n_seq=14)
    a, b = split_at(raw, 7)
    a, b = dataclasses.replace(a, batch_id="r0"), dataclasses.replace(b, batch_id="r1")
    record(store, "m", a)
    record(store, "m", b)
    again, replayed, merged = record(store, "m", b)
    assert replayed and merged is None
    acc = accumulate(Batch.from_arrays(**a.from_arrays_kwargs())).merge(
        accumulate(Batch.from_arrays(**b.from_arrays_kwargs()))
    )
    step = store.get_step("m", 9)
    assert step is not None and step["batches"] == 2
    assert step["row"] == norm(derive_row(acc).to_dict())
    assert store.count_batches("m") == 2


def test_failed_transaction_writes_nothing(store: Store) -> None:
    raw = raw_batch(3, step=1, batch_id="x")
    batch = Batch.from_arrays(**raw.from_arrays_kwargs())

    def boom(row: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("crash after the step row was written, before the batch record")

    with pytest.raises(RuntimeError):
        store.record_batch(
            "t", step=1, batch_id="x", acc=accumulate(batch), tokens=batch.num_tokens, respond=boom
        )
    assert store.list_runs() == []
    assert store.get_step("t", 1) is None
    assert store.find_batch("t", "x") is None
    answer, replayed, _ = record(store, "t", raw)
    assert not replayed and store.get_step("t", 1) is not None


def test_concurrent_writers_of_one_step(store: Store) -> None:
    raw = raw_batch(4, step=2, n_seq=16)
    parts, rest = [], raw
    for k in (2, 2, 2, 2, 2, 2, 2):
        head, rest = split_at(rest, k)
        parts.append(head)
    parts.append(rest)
    parts = [dataclasses.replace(p, step=2, batch_id=f"p{i}") for i, p in enumerate(parts)]
    # every part is posted twice concurrently: ids dedupe, each part counts once
    errors: list[BaseException] = []

    def work(p: RawBatch) -> None:
        # a busy store refuses fast (the service answers 503 + Retry-After); writers retry as
        # the tap does, and every part must still count exactly once
        for _ in range(200):
            try:
                record(store, "c", p)
                return
            except StoreUnavailable:
                time.sleep(0.05)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)
                return
        errors.append(TimeoutError(f"part {p.batch_id} still refused after 200 tries"))

    threads = [threading.Thread(target=work, args=(p,)) for p in parts + parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    step = store.get_step("c", 2)
    assert step is not None and step["batches"] == 8
    assert step["row"]["tokens"] == int(raw.arrays["loss_mask"].sum())
    assert store.count_batches("c") == 8


def test_query_ranges_runs_and_events(store: Store) -> None:
    for s in (3, 1, 2, 5):
        record(store, "q", raw_batch(10 + s, step=s))
    record(store, "other", raw_batch(20, step=0))
    steps, series = store.query_metrics("q", ["tokens"])
    assert steps == [1, 2, 3, 5] and len(series["tokens"]) == 4
    assert store.query_metrics("q", ["tokens"], from_step=2, to_step=3)[0] == [2, 3]
    assert store.query_metrics("q", ["tokens"], last=2)[0] == [3, 5]
    assert store.query_metrics("nope", ["tokens"]) == ([], {"tokens": []})
    with pytest.raises(KeyError):
        store.query_metrics("q", ["tokens; DROP TABLE steps"])
    runs = {r["run"]: r for r in store.list_runs()}
    assert runs["q"]["steps"] == 4 and runs["q"]["last_step"] == 5
    assert runs["other"]["steps"] == 1
    kinds = [e["kind"] for e in store.list_events("q")]  # newest first
    assert kinds[-1] == "run_created" and kinds.count("run_created") == 1
    assert set(kinds[:-1]) <= {"token_id_drift", "nonfinite_dropped"}
    store.add_event("q", "note", "hello", step=5, data={"k": 1})
    assert store.list_events("q")[0] == {
        "ts": store.list_events("q")[0]["ts"], "kind": "note", "step": 5, "message": "hello",
        "data": {"k": 1},
    }  # fmt: skip


def test_batches_with_token_drift_or_dropped_tokens_leave_events(store: Store) -> None:
    raw = raw_batch(5, step=3, batch_id="d")
    kw = raw.from_arrays_kwargs()
    ids = np.arange(int(kw["cu_seqlens"][-1]))
    mask = np.asarray(kw["loss_mask"]).astype(bool)
    drifted = ids.copy()
    first = int(np.flatnonzero(mask)[0])
    drifted[first] += 1
    kw.update(token_ids=ids, token_ids_train=drifted)
    logp = np.asarray(kw["logp_rollout"], dtype=np.float64).copy()
    logp[first] = np.nan
    kw["logp_rollout"] = logp
    batch = Batch.from_arrays(**kw, nonfinite="drop")
    acc = accumulate(batch)
    store.record_batch(
        "e",
        step=3,
        batch_id="d",
        acc=acc,
        tokens=batch.num_tokens,
        respond=lambda row: {"row": row},
    )
    kinds = {e["kind"]: e for e in store.list_events("e")}
    assert set(kinds) == {"run_created", "nonfinite_dropped"}  # the NaN token was the drifted one
    assert (
        kinds["nonfinite_dropped"]["data"] == {"tokens": 1}
        and kinds["nonfinite_dropped"]["step"] == 3
    )
    second = int(np.flatnonzero(mask)[1])
    drifted2 = ids.copy()
    drifted2[second] += 1
    kw2 = raw.from_arrays_kwargs() | {"token_ids": ids, "token_ids_train": drifted2}
    acc2 = accumulate(Batch.from_arrays(**kw2))
    store.record_batch("e", step=4, batch_id="d2", acc=acc2, tokens=1, respond=lambda r: {})
    drift = [e for e in store.list_events("e") if e["kind"] == "token_id_drift"]
    assert len(drift) == 1 and drift[0]["step"] == 4
    assert drift[0]["data"] == {"mismatched": 1, "tokens": int(mask.sum())}


def test_step_details_of_a_range(store: Store) -> None:
    for s in range(5):
        record(store, "d", raw_batch(60 + s, step=s, batch_id=f"d{s}"))
    got = store.step_details("d", from_step=1, to_step=3, last=2)
    assert [d["step"] for d in got] == [2, 3]
    for d in got:
        row = store.get_step("d", d["step"])
        assert row is not None
        for key in ("heatmap", "length_buckets", "lag_buckets", "worst_tokens"):
            assert norm(d[key]) == norm(row["row"][key]), key
    assert [d["step"] for d in store.step_details("d", last=10)] == [0, 1, 2, 3, 4]
    assert store.step_details("nope", last=10) == []
