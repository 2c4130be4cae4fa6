"""A batch that got 200 survives kill -9 of the server (issue 3, durability)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tests.helpers.batches import random_batch
from tests.helpers.procs import ServerProc
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.jsoncodec import dumps, loads
from timwatch.monitor.core.row import derive_row

SAFETENSORS = {"Content-Type": "application/x-safetensors"}


def _kill_after_ack_then_query(srv: ServerProc) -> None:
    raws = [
        dataclasses.replace(
            random_batch(np.random.default_rng(s), n_seq=12, optional="all"),
            step=s,
            batch_id=f"d{s}",
        )  # fmt: skip
        for s in range(3)
    ]
    with srv.client() as c:
        for raw in raws[:2]:
            assert (
                c.post("/v1/runs/dur/batches", content=dumps(raw.to_json_obj())).status_code == 200
            )
        last = c.post(
            "/v1/runs/dur/batches", content=raws[2].to_safetensors_bytes(), headers=SAFETENSORS
        )
        assert last.status_code == 200
        srv.kill9()  # immediately after the answer: no graceful shutdown, no flush
    # restart on the same port and database
    srv.start()
    with srv.client() as c:
        steps = c.get("/v1/runs/dur/metrics", params={"names": "tokens,mismatch_kl"}).json()
        step2 = c.get("/v1/runs/dur/steps/2").json()
        replay = c.post(
            "/v1/runs/dur/batches", content=raws[2].to_safetensors_bytes(), headers=SAFETENSORS
        )
    assert steps["steps"] == [0, 1, 2]
    want = loads(
        dumps(derive_row(accumulate(Batch.from_arrays(**raws[2].from_arrays_kwargs()))).to_dict())
    )
    assert step2["row"] == want
    assert replay.json()["replayed"] is True  # the idempotency record survived too


def test_sqlite_batch_survives_kill9(server: ServerProc) -> None:
    _kill_after_ack_then_query(server)


def test_postgres_batch_survives_kill9(server_factory: Any, pg_url: str) -> None:
    _kill_after_ack_then_query(server_factory(db=pg_url))
