"""A batch that got 200 survives kill -9 of the server (issue 3, durability)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.helpers.batches import RawBatch
from tests.helpers.procs import ServerProc
from tests.helpers.wire import SAFETENSORS, as_batch, fresh_run, norm, raw_batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.jsoncodec import dumps
from timwatch.monitor.core.row import derive_row


def _kill_after_ack_then_query(srv: ServerProc) -> None:
    run = fresh_run("dur")
    raws = [raw_batch(s, step=s, batch_id=f"d{s}") for s in range(3)]
    with srv.client() as c:
        for raw in raws[:2]:
            assert (
                c.post(f"/v1/runs/{run}/batches", content=dumps(raw.to_json_obj())).status_code
                == 200
            )
        last = c.post(
            f"/v1/runs/{run}/batches", content=raws[2].to_safetensors_bytes(), headers=SAFETENSORS
        )
        assert last.status_code == 200
        srv.kill9()  # immediately after the answer: no graceful shutdown, no flush
    # restart on the same port and database
    srv.start()
    with srv.client() as c:
        steps = c.get(f"/v1/runs/{run}/metrics", params={"names": "tokens,mismatch_kl"}).json()
        step2 = c.get(f"/v1/runs/{run}/steps/2").json()
        replay = c.post(
            f"/v1/runs/{run}/batches", content=raws[2].to_safetensors_bytes(), headers=SAFETENSORS
        )
    assert steps["steps"] == [0, 1, 2]
    assert step2["row"] == norm(derive_row(accumulate(as_batch(raws[2]))).to_dict())
    assert replay.json()["replayed"] is True  # the idempotency record survived too


def test_sqlite_batch_survives_kill9(shared_server: ServerProc) -> None:
    _kill_after_ack_then_query(shared_server)


def test_postgres_batch_survives_kill9(server_factory: Any, pg_url: str) -> None:
    _kill_after_ack_then_query(server_factory(db=pg_url))


PRODUCERS, PER_PRODUCER, KILL_AFTER = 32, 6, 60


def _send_until_error(c: httpx.Client, run: str, raws: list[RawBatch], acked: list[str]) -> None:
    for raw in raws:
        for _ in range(1200):  # bounded: a store busy for a minute leaves the batch unacked
            try:
                r = c.post(f"/v1/runs/{run}/batches", content=dumps(raw.to_json_obj()))
            except httpx.HTTPError:
                return  # the server died under this request: it is not acked
            if r.status_code != 503:
                break
            # a busy store (lock timeout) answers 503 + Retry-After: retry as the tap does
            time.sleep(0.05)
        if r.status_code != 200:
            return
        assert raw.batch_id is not None
        acked.append(raw.batch_id)


def _kill9_under_producers(srv: ServerProc) -> None:
    """32 producers post while the server is killed; after a restart every acked batch is a
    replay (it was stored), every batch is sent again, and each step holds each batch once."""
    run = fresh_run("kill32")
    raws = {
        p: [
            raw_batch(p * 100 + k, step=k, batch_id=f"p{p}-k{k}", n_seq=3)
            for k in range(PER_PRODUCER)
        ]
        for p in range(PRODUCERS)
    }
    acked: list[str] = []  # list.append is atomic under the GIL
    clients = [srv.client() for _ in range(PRODUCERS)]
    with ThreadPoolExecutor(PRODUCERS) as pool:
        futures = [
            pool.submit(_send_until_error, clients[p], run, raws[p], acked)
            for p in range(PRODUCERS)
        ]
        deadline = time.monotonic() + 120
        while len(acked) < KILL_AFTER and time.monotonic() < deadline:
            time.sleep(0.005)
        srv.kill9()
        for f in futures:
            f.result()
    for c in clients:
        c.close()
    assert KILL_AFTER <= len(acked) < PRODUCERS * PER_PRODUCER, "the kill must land mid-run"
    srv.start()
    by_id = {raw.batch_id: raw for batches in raws.values() for raw in batches}
    with srv.client() as c:
        for batch_id in acked:  # acked = stored: each one is known to the restarted server
            r = c.post(f"/v1/runs/{run}/batches", content=dumps(by_id[batch_id].to_json_obj()))
            assert r.status_code == 200 and r.json()["replayed"] is True, batch_id
        for batch_id, raw in by_id.items():
            if batch_id not in acked:
                r = c.post(f"/v1/runs/{run}/batches", content=dumps(raw.to_json_obj()))
                assert r.status_code == 200, r.text
        for k in range(PER_PRODUCER):
            step = c.get(f"/v1/runs/{run}/steps/{k}").json()
            tokens = sum(
                derive_row(accumulate(as_batch(raws[p][k]))).tokens for p in range(PRODUCERS)
            )
            assert step["batches"] == PRODUCERS  # none lost, none doubled
            assert step["row"]["tokens"] == tokens


@pytest.mark.slow  # a load test: the full suite runs it, the quick tier does not
def test_sqlite_kill9_under_32_producers(server_factory: Any) -> None:
    _kill9_under_producers(server_factory())


@pytest.mark.slow  # a load test: the full suite runs it, the quick tier does not
def test_postgres_kill9_under_32_producers(server_factory: Any, pg_url: str) -> None:
    _kill9_under_producers(server_factory(db=pg_url))
