"""A batch that got 200 survives kill -9 of the server (issue 3, durability)."""

from __future__ import annotations

from typing import Any

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
