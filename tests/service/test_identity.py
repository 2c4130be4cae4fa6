"""Batch identity (docs/reference/api.md, "A batch_id names one content"): a replay is the same
``batch_id`` with the same content digest, whatever the wire format; the same id with other
content is a 409 counted as ``conflict`` that stores nothing, decided inside the store
transaction too (concurrent twins); rows stored before migration 0004 have no digest and replay.
HTTP cases run against a real ``timwatch serve`` on SQLite and on PostgreSQL."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from sqlalchemy import inspect, select

from tests.helpers.procs import ServerProc
from tests.helpers.wire import as_batch, counters, post, raw_batch
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.digest import batch_digest
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.errors import ApiError, BatchConflict, StoreUnavailable
from timwatch.monitor.core.jsoncodec import dumps
from timwatch.monitor.core.masks import PolicyParams
from timwatch.monitor.service.ingest import ingest_batch
from timwatch.monitor.service.runs import RunRegistry
from timwatch.monitor.store import Store
from timwatch.monitor.store.db import MIGRATIONS_DIR
from timwatch.monitor.store.models import BatchRecord

Factory = Callable[..., ServerProc]
CONFLICT = "timwatch_rejected_batches_total{reason=conflict}"


def exposition(c: httpx.Client) -> dict[str, float]:
    return counters(c.get("/metrics").text)


def test_same_id_other_content_is_409_counted_and_stores_nothing(
    server_factory: Factory, db_url: str
) -> None:
    first = raw_batch(1, step=3, batch_id="dup")
    other_step = raw_batch(2, step=5, batch_id="dup")
    same_step = raw_batch(3, step=3, batch_id="dup")
    meta_only = dataclasses.replace(first, policy_version=99)  # same arrays, other metadata
    srv = server_factory(db=db_url)
    with srv.client() as c:
        r1 = post(c, "ident", first, "safetensors")
        assert r1.status_code == 200, r1.text
        before = exposition(c)
        tries = ((other_step, "json"), (same_step, "safetensors"), (meta_only, "json"))
        refused = [post(c, "ident", b, fmt) for b, fmt in tries]
        after = exposition(c)
        step3 = c.get("/v1/runs/ident/steps/3").json()
        step5 = c.get("/v1/runs/ident/steps/5")
        again = post(c, "ident", first, "json")
    for r in refused:
        assert r.status_code == 409, r.text
        body = r.json()
        assert "'dup'" in body["detail"] and "step 3" in body["detail"], body
        assert (body["field"], body["batch_id"], body["step"]) == ("batch_id", "dup", 3)
    assert after[CONFLICT] == before[CONFLICT] + 3
    for name in ("timwatch_tokens_total{run=ident}", "timwatch_batches_total{run=ident}"):
        assert after[name] == before[name], name
    assert step5.status_code == 404
    assert step3["batches"] == 1 and step3["row"] == r1.json()["step_row"]
    assert again.status_code == 200 and again.json() == {**r1.json(), "replayed": True}
    store = Store(db_url)
    try:
        assert store.count_batches("ident") == 1
    finally:
        store.close()


def test_json_and_safetensors_bodies_have_one_digest_and_replay(
    server_factory: Factory, db_url: str
) -> None:
    raw = raw_batch(4, step=2, batch_id="fmt")
    from_json = Batch.from_json(raw.json_roundtrip())
    from_st = Batch.from_safetensors(raw.to_safetensors_bytes())
    assert batch_digest(from_json) == batch_digest(from_st) == batch_digest(as_batch(raw))
    srv = server_factory(db=db_url)
    with srv.client() as c:
        r1 = post(c, "fmt", raw, "json")
        r2 = post(c, "fmt", raw, "safetensors")
        r3 = post(c, "fmt", raw, "json")
        assert exposition(c)[CONFLICT] == 0
    assert r1.status_code == r2.status_code == r3.status_code == 200
    assert (r1.json()["replayed"], r2.json()["replayed"], r3.json()["replayed"]) == (
        False, True, True,
    )  # fmt: skip
    assert {**r2.json(), "replayed": False} == r1.json()
    store = Store(db_url)
    try:
        with store.engine.connect() as conn:
            digests = conn.execute(select(BatchRecord.__table__.c.digest)).scalars().all()
    finally:
        store.close()
    assert digests == [batch_digest(from_st)]


def _record(store: Store, raw: Any) -> tuple[dict[str, Any], bool, Any]:
    batch = as_batch(raw)
    return store.record_batch(
        "race", step=batch.step, batch_id=batch.batch_id, acc=accumulate(batch),
        tokens=batch.num_tokens, respond=lambda row: {"step_row": row},
        digest=batch_digest(batch),
    )  # fmt: skip


@pytest.mark.parametrize("same_content", [True, False], ids=["twins", "rivals"])
def test_concurrent_posts_of_one_id_store_exactly_one(db_url: str, same_content: bool) -> None:
    """The in-transaction check: six writers of one batch_id race past any pre-check straight
    into `Store.record_batch`; one is stored, the others replay (same content) or conflict. A
    writer told the store is busy (a write held SQLite's lock over 0.5 s, which a loaded machine
    can make happen) tries again with the same batch, as the tap retries a 503."""
    n = 6
    raws = [
        raw_batch(7, step=1, batch_id="one") if same_content
        else raw_batch(20 + i, step=i % 2, batch_id="one")
        for i in range(n)
    ]  # fmt: skip
    store = Store(db_url)
    barrier = threading.Barrier(n)
    outcomes: list[str] = []

    def go(raw: Any) -> None:
        barrier.wait()
        for _ in range(20):
            try:
                outcomes.append("replayed" if _record(store, raw)[1] else "stored")
            except BatchConflict:
                outcomes.append("conflict")
            except StoreUnavailable:
                continue
            return

    try:
        threads = [threading.Thread(target=go, args=(r,)) for r in raws]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert store.count_batches("race") == 1
        stored_steps = [s for s in (0, 1) if store.get_step("race", s) is not None]
        assert len(stored_steps) == 1
        assert store.get_step("race", stored_steps[0])["batches"] == 1  # type: ignore[index]
    finally:
        store.close()
    rest = "replayed" if same_content else "conflict"
    assert sorted(outcomes) == sorted(["stored"] + [rest] * (n - 1))


def _ingest(store: Store, runs: RunRegistry, raw: Any) -> dict[str, Any]:
    body = dumps(raw.to_json_obj())
    return ingest_batch(store, runs, "old", body, "", params=PolicyParams(), tags={"team": "rl"})


def _alembic(store: Store, revision: str) -> None:
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with store.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def test_migration_0004_keeps_old_rows_and_a_null_digest_replays(db_url: str) -> None:
    from alembic.migration import MigrationContext

    first = raw_batch(8, step=1, batch_id="legacy")
    store = Store(db_url)
    try:
        stored = _ingest(store, RunRegistry(), first)
        _alembic(store, "0003")  # the database as revision 0003 left it
        assert "digest" not in {c["name"] for c in inspect(store.engine).get_columns("batches")}
    finally:
        store.close()
    store = Store(db_url)  # upgrades to head
    try:
        with store.engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == "0007"
            assert conn.execute(select(BatchRecord.__table__.c.digest)).scalars().all() == [None]
        assert store.count_batches("old") == 1
        assert store.list_runs()[0]["tags"] == {"team": "rl"}
        assert store.list_runs()[0]["finished_at"] is None
        assert store.get_step("old", 1)["row"] == stored["step_row"]  # type: ignore[index]
        runs = RunRegistry()
        # a NULL digest cannot be compared: other content under the old id is a replay
        replay = _ingest(store, runs, raw_batch(9, step=1, batch_id="legacy"))
        assert replay == {**stored, "replayed": True}
        assert store.count_batches("old") == 1 and len(runs) == 0
        # batches stored from now on carry a digest and are checked
        assert _ingest(store, runs, raw_batch(10, step=2, batch_id="new"))["replayed"] is False
        with pytest.raises(ApiError) as conflict:
            _ingest(store, runs, raw_batch(11, step=2, batch_id="new"))
        assert (conflict.value.status, conflict.value.reason) == (409, "conflict")
        assert store.count_batches("old") == 2
    finally:
        store.close()


def test_migration_0005_gives_old_steps_zero_impossible_tokens(db_url: str) -> None:
    from alembic.migration import MigrationContext

    store = Store(db_url)
    try:
        stored = _ingest(store, RunRegistry(), raw_batch(12, step=1, batch_id="before"))
        _alembic(store, "0004")  # the database as revision 0004 left it
        cols = {c["name"] for c in inspect(store.engine).get_columns("steps")}
        assert "impossible_tokens" not in cols and "nonfinite_tokens" in cols
    finally:
        store.close()
    store = Store(db_url)  # upgrades to head
    try:
        with store.engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == "0007"
        # before 0005 a -inf log-prob was refused: every stored step had none
        assert stored["step_row"]["impossible_tokens"] == 0
        assert store.get_step("old", 1)["row"] == stored["step_row"]  # type: ignore[index]
        steps, series = store.query_series("old", ["impossible_tokens", "tokens"])
        assert list(steps) == [1] and list(series["impossible_tokens"]) == [0]
        # a batch stored now counts its impossible tokens, read back from the chunks too
        raw = raw_batch(13, step=2, batch_id="after")
        mask = raw.arrays["loss_mask"]
        kept = [i for i in range(len(mask)) if int(mask[i]) == 1][:2]
        raw.arrays["logp_rollout"][kept] = float("-inf")
        body = raw.to_safetensors_bytes()  # JSON has no -inf; safetensors (the tap's) has
        done = ingest_batch(
            store, RunRegistry(), "old", body, "application/x-safetensors", params=PolicyParams()
        )
        assert done["step_row"]["impossible_tokens"] == 2
        steps, series = store.query_series("old", ["impossible_tokens"])
        assert list(steps) == [1, 2] and list(series["impossible_tokens"]) == [0, 2]
    finally:
        store.close()
