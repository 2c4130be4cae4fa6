"""Two ``timwatch serve`` replicas on one PostgreSQL, posts hitting both at the same moment.

Batch identity is decided by the database (the ``batches`` primary key and the check inside the
batch's transaction), not by process memory: of two simultaneous posts of one ``batch_id``
through different replicas exactly one is stored and counted, the other replays (same content)
or is refused with 409 (other content). Two new batches of one new step racing on two replicas
both land in the step, whose row equals the row of both batches merged. Writers of one run
queue on its row; past PostgreSQL's ``lock_timeout`` the answer is a 503 that stores nothing,
and the posts here retry it as the tap does. A finish taken by one
replica reaches the other's exposition through the store (`FinishSync`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.helpers.pg import fresh_database
from tests.helpers.procs import ServerProc, free_port, server_env
from tests.helpers.wire import as_batch, counters, norm, post, raw_batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.row import derive_row
from timwatch.monitor.service.runs import RunRegistry
from timwatch.monitor.store import Store

pytestmark = pytest.mark.postgres
ROUNDS = 8


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProc]]:
    """Two servers on one fresh PostgreSQL database, shared by this module's tests (each uses
    its own run); the finish grace is long so a finished run stays exported."""
    logs = tmp_path_factory.mktemp("replicas")
    with fresh_database() as url:
        procs = [
            ServerProc(url, free_port(), ["--finish-grace", "600"], server_env(None),
                       logs / f"replica-{k}.log")
            for k in range(2)
        ]  # fmt: skip
        try:
            for p in procs:
                p.start()
            yield procs
        finally:
            for p in procs:
                p.stop()


def _at_once(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run `calls` on threads released together; their results in order."""
    barrier = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)

    def go(i: int) -> None:
        barrier.wait()
        out[i] = calls[i]()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _post(c: httpx.Client, run: str, raw: Any) -> Any:
    """`post`, retried on 503 as the tap does: writers of one run queue on its row, and on a busy
    machine a wait past PostgreSQL's ``lock_timeout`` (1 s) answers 503 and stores nothing."""
    for _ in range(20):
        r = post(c, run, raw)
        if r.status_code != 503:
            return r
        time.sleep(min(float(r.headers.get("Retry-After", "1")), 1.0))
    return r


def _sum(clients: list[httpx.Client], sample: str) -> float:
    return sum(counters(c.get("/metrics").text).get(sample, 0.0) for c in clients)


def test_twins_on_two_replicas_store_and_count_once(replicas: list[ServerProc]) -> None:
    clients = [r.client() for r in replicas]
    try:
        answers = []
        for i in range(ROUNDS):
            raw = raw_batch(100 + i, step=i, batch_id=f"twin-{i}")
            answers.append(_at_once([lambda c=c, raw=raw: _post(c, "twins", raw) for c in clients]))
        for pair in answers:
            assert [r.status_code for r in pair] == [200, 200], [r.text for r in pair]
            bodies = [r.json() for r in pair]
            assert sorted(b["replayed"] for b in bodies) == [False, True]
            assert {**bodies[0], "replayed": None} == {**bodies[1], "replayed": None}
        stored_on = {k for pair in answers for k, r in enumerate(pair) if not r.json()["replayed"]}
        batches = _sum(clients, "timwatch_batches_total{run=twins}")
        steps = [clients[0].get(f"/v1/runs/twins/steps/{i}").json() for i in range(ROUNDS)]
    finally:
        for c in clients:
            c.close()
    assert batches == ROUNDS  # counted by the replica that stored it, never by both
    assert all(s["batches"] == 1 for s in steps)
    store = Store(replicas[0].db)
    try:
        assert store.count_batches("twins") == ROUNDS
    finally:
        store.close()
    # not a test of the balancer, but a race both replicas can win
    assert stored_on <= {0, 1}


def test_rivals_on_two_replicas_one_stored_one_409(replicas: list[ServerProc]) -> None:
    clients = [r.client() for r in replicas]
    try:
        outcomes = []
        for i in range(ROUNDS):
            raws = [raw_batch(200 + 2 * i + k, step=i, batch_id=f"rival-{i}") for k in (0, 1)]
            pair = _at_once(
                [lambda c=c, r=r: _post(c, "rivals", r) for c, r in zip(clients, raws, strict=True)]
            )
            outcomes.append(sorted(r.status_code for r in pair))
            winner = next(k for k, r in enumerate(pair) if r.status_code == 200)
            step = clients[0].get(f"/v1/runs/rivals/steps/{i}").json()
            assert step["row"] == pair[winner].json()["step_row"]  # the winner's content only
        conflicts = _sum(clients, "timwatch_rejected_batches_total{reason=conflict}")
        batches = _sum(clients, "timwatch_batches_total{run=rivals}")
    finally:
        for c in clients:
            c.close()
    assert outcomes == [[200, 409]] * ROUNDS
    assert conflicts == ROUNDS and batches == ROUNDS


def _close(a: Any, b: Any, where: str = "") -> None:
    """Equal rows, floats to 1e-12 relative (merge order of three or more batches may differ)."""
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and not (math.isnan(a) and isinstance(b, float) and math.isnan(b)):
        assert b == pytest.approx(a, rel=1e-12, abs=1e-300), where
    else:
        assert a == b, where


def test_one_new_step_on_two_replicas_merges_both_batches(replicas: list[ServerProc]) -> None:
    clients = [r.client() for r in replicas]
    try:
        for i in range(ROUNDS):
            raws = [raw_batch(300 + 2 * i + k, step=i, batch_id=f"half-{i}-{k}") for k in (0, 1)]
            pair = _at_once(
                [lambda c=c, r=r: _post(c, "halves", r) for c, r in zip(clients, raws, strict=True)]
            )
            assert [r.status_code for r in pair] == [200, 200], [r.text for r in pair]
            step = clients[1].get(f"/v1/runs/halves/steps/{i}").json()
            merged = accumulate(as_batch(raws[0])).merge(accumulate(as_batch(raws[1])))
            assert step["batches"] == 2
            _close(norm(derive_row(merged).to_dict()), step["row"], f"step {i}")
    finally:
        for c in clients:
            c.close()


def test_a_finish_on_one_replica_reaches_the_other(replicas: list[ServerProc]) -> None:
    a, b = (r.client() for r in replicas)
    try:
        for k, c in enumerate((a, b)):
            assert post(c, "ends", raw_batch(400 + k, step=1, batch_id=f"e{k}")).status_code == 200
        assert a.post("/v1/runs/ends/finish").status_code == 200
        deadline, finished = time.monotonic() + 20, 0.0
        while time.monotonic() < deadline and finished != 1.0:
            finished = counters(b.get("/metrics").text)["timwatch_run_finished{run=ends}"]
            time.sleep(0.25)
        assert counters(a.get("/metrics").text)["timwatch_run_finished{run=ends}"] == 1.0
    finally:
        a.close()
        b.close()
    assert finished == 1.0


def test_replicas_starting_together_on_a_fresh_database_all_come_up() -> None:
    """Migrations take an advisory lock: without it, concurrent first starts raced on CREATE
    TABLE (duplicate key in pg_type) and all but one replica exited."""
    with fresh_database("fresh") as url:
        stores: list[Any] = _at_once([lambda: Store(url) for _ in range(4)])
        try:
            assert all(s.count_batches("none") == 0 for s in stores)
        finally:
            for s in stores:
                s.close()


def test_a_batch_after_the_finish_keeps_the_run_open_here() -> None:
    runs = RunRegistry()
    runs.observe("r", accumulate(as_batch(raw_batch(1))), {}, 1)
    assert "r" in runs.unfinished()
    assert not runs.finished_elsewhere("r", time.time() - 60)  # finished before its last batch
    assert runs.finished_elsewhere("r", time.time() + 1)
    assert runs.unfinished() == [] and not runs.finished_elsewhere("r", time.time() + 2)
    assert not runs.finished_elsewhere("gone", time.time())
