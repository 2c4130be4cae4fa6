"""Counters that survive ``kill -9``: replicas started with ``--replica-id`` count each new batch
in the store, in the batch's own transaction, and a replica restarted under the same id
continues from what it had committed.

Real ``timwatch serve`` processes on the real PostgreSQL (and on SQLite): producers post
through both replicas (retrying on errors as the tap does, some batches posted again to the
other replica to replay, some with a tap-drop count), one replica is killed with SIGKILL
mid-load and restarted with the same id. At quiescence the sum over the replicas of every
additive ``/metrics`` sample equals the totals recomputed from the batches the store holds:
exactly for every integer sample (``_total``, ``_count``, ``_bucket``), to 1e-9 relative for
float ``_sum`` samples (the replicas add the same batches in another order).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, select

from tests.helpers.batches import RawBatch
from tests.helpers.pg import fresh_database
from tests.helpers.procs import REPO, ServerProc, free_port, server_env
from tests.helpers.scaleout import (
    Sample,
    additive_mismatches,
    additive_samples,
    exposed_additive,
)
from tests.helpers.wire import as_batch, raw_batch
from timwatch.monitor.core.accumulator import Accumulator
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.jsoncodec import dumps
from timwatch.monitor.service.runs import RunRegistry
from timwatch.monitor.store import Store
from timwatch.monitor.store.models import BatchRecord, StepDetail
from timwatch.monitor.store.totals import Tally

RUNS = ("tot-a", "tot-b")
THREADS, PER_THREAD = 4, 14


def _drops(batch_id: str) -> int:
    """The tap-drop count posted with `batch_id` (the same on every retry and replay)."""
    return sum(map(ord, batch_id)) % 3


class Load:
    """`THREADS` producers per run posting `PER_THREAD` batches each, alternating replicas; a
    post that fails (transport error, 5xx) is retried on the next replica; every third batch
    is posted again to the other replica and must replay. The victim is killed once a third
    of the batches are answered; the last third of each producer waits for its restart."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.raws: dict[tuple[str, str], RawBatch] = {}
        self.errors: list[str] = []
        self.acked = 0
        self.killed = False
        self.restarted = threading.Event()
        self.before_kill = [0] * len(urls)  # new batches answered by each replica
        self.after_kill = [0] * len(urls)
        self._lock = threading.Lock()

    def _send(self, c: httpx.Client, url: str, run: str, raw: RawBatch) -> httpx.Response:
        headers = {"Timwatch-Tap-Dropped": str(_drops(str(raw.batch_id)))}
        return c.post(f"{url}/v1/runs/{run}/batches", content=dumps(raw.to_json_obj()),
                      headers=headers)  # fmt: skip

    def _post(self, c: httpx.Client, k: int, run: str, raw: RawBatch) -> int | None:
        for attempt in range(200):
            i = (k + attempt) % len(self.urls)
            try:
                r = self._send(c, self.urls[i], run, raw)
                if r.status_code == 200:
                    if not r.json()["replayed"]:
                        with self._lock:
                            (self.after_kill if self.killed else self.before_kill)[i] += 1
                    return i
                if r.status_code < 500:
                    self.errors.append(f"{raw.batch_id}: {r.status_code} {r.text[:200]}")
                    return None
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.errors.append(f"{raw.batch_id}: never answered")
        return None

    def producer(self, run: str, t: int) -> None:
        with httpx.Client(timeout=60.0) as c:
            for i in range(PER_THREAD):
                if i == PER_THREAD * 2 // 3:  # the last third once the killed one is back
                    self.restarted.wait(120)
                seed = zlib.crc32(f"{run}/{t}/{i}".encode())
                raw = raw_batch(seed, step=i // 2, batch_id=f"{run}-t{t}-{i}", n_seq=4)
                self.raws[(run, str(raw.batch_id))] = raw
                got = self._post(c, t + i, run, raw)
                if got is not None and i % 3 == 0:
                    try:
                        r = self._send(c, self.urls[1 - got], run, raw)
                        if r.status_code == 200 and r.json()["replayed"] is not True:
                            self.errors.append(f"{raw.batch_id}: not a replay on the other one")
                    except httpx.TransportError:
                        pass  # that one is down right now
                with self._lock:
                    self.acked += got is not None

    def run(self, victim: ServerProc, kill_after: int) -> None:
        threads = [threading.Thread(target=self.producer, args=(run, t), daemon=True)
                   for run, t in itertools.product(RUNS, range(THREADS))]  # fmt: skip
        for th in threads:
            th.start()
        deadline = time.monotonic() + 120
        while self.acked < kill_after and time.monotonic() < deadline:
            time.sleep(0.01)
        victim.kill9()  # mid-load: the other producers keep posting
        with self._lock:
            self.killed = True
        # the restart waits until the survivor has answered new batches meanwhile (bounded)
        deadline = time.monotonic() + 60
        while sum(self.after_kill) < THREADS and time.monotonic() < deadline:
            time.sleep(0.01)
        victim.start()  # same --replica-id
        self.restarted.set()
        for th in threads:
            th.join(180)


def _fleet(servers: list[ServerProc]) -> dict[Sample, float]:
    total: dict[Sample, float] = {}
    for srv in servers:
        for key, v in exposed_additive(httpx.get(f"{srv.url}/metrics", timeout=30).text).items():
            total[key] = total.get(key, 0.0) + v
    return total


def _stored(db: str, load: Load) -> tuple[dict[Sample, float], dict[str, Accumulator]]:
    """The additive samples of every batch the store holds, recomputed from the posted
    content (not from any total the service kept), and each run's merged step states."""
    engine = create_engine(db)
    try:
        with engine.connect() as conn:
            stored = list(conn.execute(select(BatchRecord.run_id, BatchRecord.batch_id)))
            states = list(conn.execute(select(StepDetail.run_id, StepDetail.state)))
    finally:
        engine.dispose()
    want: dict[Sample, float] = {}
    steps: dict[str, Accumulator] = {}
    for run in RUNS:
        ids = sorted(b for r, b in stored if r == run)
        acc = Accumulator()
        for bid in ids:
            acc = acc.merge(accumulate(as_batch(load.raws[(run, bid)])))
        want |= additive_samples(run, acc, sum(_drops(b) for b in ids))
        steps[run] = Accumulator()
        for r, state in states:
            if r == run:
                steps[run] = steps[run].merge(Accumulator.from_state(state))
    return want, steps


def _assert_equal(got: dict[Sample, float], want: dict[Sample, float]) -> None:
    wrong = additive_mismatches(got, want)
    assert not wrong, f"{len(wrong)} samples differ, e.g. {wrong[:10]}"
    assert sum(not k[0].endswith("_sum") for k in want) > 100  # every family, not a handful
    assert any(k[0].endswith("_sum") for k in want)


def _kill_and_check(db: str, tmp: Path, kill_after: int, via_env: bool = False) -> None:
    """Two replicas with ids (``--replica-id``, or ``TIMWATCH_REPLICA_ID`` with `via_env`)."""
    servers = [
        ServerProc(db, free_port(), [] if via_env else ["--replica-id", f"rep-{k}"],
                   server_env({"TIMWATCH_REPLICA_ID": f"rep-{k}"} if via_env else None),
                   tmp / f"rep-{k}.log")
        for k in range(2)
    ]  # fmt: skip
    try:
        for s in servers:
            s.start()
        load = Load([s.url for s in servers])
        load.run(servers[1], kill_after)
        assert not load.errors, load.errors[:5]
        assert load.acked == len(RUNS) * THREADS * PER_THREAD
        want, steps = _stored(db, load)
        assert sum(v for (n, labels), v in want.items() if n == "timwatch_batches_total") == (
            load.acked
        )
        _assert_equal(_fleet(servers), want)
        for run in RUNS:  # the store's steps hold every batch once
            assert steps[run].batches == THREADS * PER_THREAD
            assert steps[run].tokens == sum(
                int(v) for (n, labels), v in want.items()
                if n == "timwatch_tokens_total" and dict(labels)["run"] == run
            )  # fmt: skip
        # the killed process had answered batches: the sum holds only if its restart loaded them
        assert load.before_kill[1] > 0 and load.after_kill[1] > 0, (
            load.before_kill,
            load.after_kill,
        )
    finally:
        for s in servers:
            s.stop()


@pytest.mark.slow  # a load test: the full suite runs it, the quick tier does not
@pytest.mark.postgres
def test_pg_replica_killed_mid_load_restarts_with_its_counters(tmp_path: Path) -> None:
    with fresh_database("totals") as db:
        _kill_and_check(db, tmp_path, kill_after=len(RUNS) * THREADS * PER_THREAD // 3)


@pytest.mark.slow  # a load test: the full suite runs it, the quick tier does not
def test_sqlite_replica_killed_mid_load_restarts_with_its_counters(tmp_path: Path) -> None:
    _kill_and_check(f"sqlite:///{tmp_path / 'tw.db'}", tmp_path,
                    kill_after=len(RUNS) * THREADS * PER_THREAD // 3, via_env=True)  # fmt: skip


def test_a_replica_id_outside_the_alphabet_is_refused_at_start(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "timwatch", "serve", "--db", f"sqlite:///{tmp_path / 'x.db'}",
         "--replica-id", "two words"],
        capture_output=True, text=True, timeout=120, env=server_env(None), cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2 and "--replica-id" in proc.stderr, proc.stderr
    assert not (tmp_path / "x.db").exists()  # refused before the store was opened


# ---- the store and the registry, in process ------------------------------------------------


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'tw.db'}")
    yield s
    s.close()


def _record(store: Store, run: str, raw: RawBatch, tally: Tally | None) -> Any:
    acc = accumulate(as_batch(raw))
    return store.record_batch(
        run, step=raw.step, batch_id=raw.batch_id, acc=acc, tokens=1,
        respond=lambda row: {"step_row": row}, tally=tally,
    )  # fmt: skip


def test_totals_count_new_batches_only_per_replica(sqlite_store: Store) -> None:
    raws = [raw_batch(10 + i, step=i % 2, batch_id=f"b{i}", n_seq=3) for i in range(5)]
    tallies = []
    for i, raw in enumerate(raws):
        t = Tally(f"r{i % 2}", tap_dropped=i)
        _record(sqlite_store, "run", raw, t)
        tallies.append(t)
    replay = Tally("r0", tap_dropped=7)
    _, replayed, _ = _record(sqlite_store, "run", raws[0], replay)
    assert replayed and replay.totals is None  # a replay is not counted again
    _record(sqlite_store, "other", raw_batch(99, batch_id="x"), None)  # no id: no totals row
    seeds = {r0: sqlite_store.replica_seed(r0, 0.0) for r0 in ("r0", "r1")}
    for k, rid in enumerate(("r0", "r1")):
        (row,) = seeds[rid]
        mine = [accumulate(as_batch(raw)) for i, raw in enumerate(raws) if i % 2 == k]
        want = mine[0]
        for a in mine[1:]:
            want = want.merge(a)
        assert row.run == "run" and row.totals.batches == len(mine)
        assert row.totals.to_state() == want.to_state()  # same order of addition: exact
        assert row.tap_dropped == sum(i for i in range(5) if i % 2 == k)
        got = sqlite_store.get_step("run", k)
        assert got is not None and row.step == k and row.row == got["row"]
        assert row.finished_at is None
        assert tallies[-2 + k].totals is not None
    assert sqlite_store.replica_seed("r0", time.time() + 60) == []  # older than `since`
    sqlite_store.finish_run("run")
    assert sqlite_store.replica_seed("r0", 0.0)[0].finished_at is not None


def test_registry_keeps_the_totals_with_most_batches() -> None:
    a, b = (accumulate(as_batch(raw_batch(s, n_seq=3))) for s in (1, 2))
    ab = a.merge(b)
    runs = RunRegistry()
    runs.observe("r", b, {}, 1, 0, (ab, 3))  # the later commit observed first
    runs.observe("r", a, {}, 1, 0, (a, 1))  # older totals: already included
    (s,) = runs.snapshot()
    assert s.acc.batches == 2 and s.acc.to_state() == ab.to_state() and s.tap_dropped == 3
    runs.add_tap_dropped("r", 5)  # reported at a finish: kept beside the stored totals
    c = accumulate(as_batch(raw_batch(3, n_seq=3)))
    runs.observe("r", c, {}, 2, 1, (ab.merge(c), 4))
    (s,) = runs.snapshot()
    assert s.acc.batches == 3 and s.tap_dropped == 9


def test_seed_respects_ttl_and_finish_grace() -> None:
    acc = accumulate(as_batch(raw_batch(1, n_seq=3)))
    runs = RunRegistry(ttl=100.0, finish_grace=10.0)
    now = time.time()
    assert runs.seed("live", (acc, 2), {"k": 1}, 4, now - 50, None)
    assert not runs.seed("stale", (acc, 0), {}, 1, now - 150, None)
    assert not runs.seed("done", (acc, 0), {}, 1, now - 50, now - 20)  # past its grace
    assert runs.seed("ending", (acc, 0), {}, 1, now - 50, now - 5)
    assert not runs.seed("live", (acc, 0), {}, 1, now, None)  # already live
    states = {s.run: s for s in runs.snapshot()}
    assert set(states) == {"live", "ending"}
    assert states["live"].tap_dropped == 2 and states["live"].step == 4
    assert states["live"].last_batch_ts == now - 50
    assert runs.unfinished() == ["live"]
