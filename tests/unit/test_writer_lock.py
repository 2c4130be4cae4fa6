"""The in-process SQLite writer lock tells a stuck store from a busy one: writers queued behind
quick holders all get their turn; writers behind a holder stuck past the timeout, or behind a
holder whose transaction failed on the database, give up with `StoreUnavailable`."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy.exc import OperationalError

from tests.helpers.clock import FakeClock
from timwatch.monitor.core.errors import StoreUnavailable
from timwatch.monitor.store.health import WriteHealth, WriterLock


def test_a_queue_behind_quick_holders_never_gives_up() -> None:
    lock, done = WriterLock(stuck=2.0, cap=60.0), []

    def writer(i: int) -> None:
        for _ in range(20):
            with lock.hold():
                done.append(i)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(writer, range(8)))
    assert len(done) == 160


def test_writers_behind_a_stuck_holder_give_up() -> None:
    lock, taken, gave_up = WriterLock(stuck=0.2, cap=60.0), threading.Event(), threading.Event()

    def holder() -> None:
        with lock.hold():
            taken.set()
            assert gave_up.wait(30)

    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(holder)
        assert taken.wait(30)
        with pytest.raises(StoreUnavailable, match="held the lock"), lock.hold():
            pass
        gave_up.set()
        held.result()
    with lock.hold():  # free again
        pass


def test_writers_queued_behind_a_failed_transaction_give_up_with_it() -> None:
    lock, taken, waiting = WriterLock(stuck=30.0, cap=60.0), threading.Event(), threading.Event()

    def holder() -> None:
        with pytest.raises(OperationalError), lock.hold():
            taken.set()
            assert waiting.wait(30)
            threading.Event().wait(0.2)  # the waiter is inside hold() by now
            raise OperationalError("BEGIN IMMEDIATE", {}, Exception("database is locked"))

    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(holder)
        assert taken.wait(30)
        waiting.set()
        with (
            pytest.raises(
                StoreUnavailable, match=r"database is locked \(the write ahead of this one failed\)"
            ),
            lock.hold(),
        ):
            pass
        held.result()


def test_health_records_failures_until_a_success() -> None:
    health = WriteHealth()
    assert not health.failing and health.report()["write_error"] is None
    with pytest.raises(StoreUnavailable), health.recording("write"):
        raise StoreUnavailable("database or disk is full")
    with pytest.raises(StoreUnavailable), health.recording("write"):
        raise StoreUnavailable("database or disk is full")
    report = health.report()
    assert health.failing and report["write_error"] == "database or disk is full"
    assert report["consecutive_write_failures"] == 2
    with health.recording("write", successes=False):  # a read: no news about writes
        pass
    assert health.failing
    with pytest.raises(ValueError), health.recording("write"):
        raise ValueError("not the store's fault")
    assert health.report()["consecutive_write_failures"] == 2
    with health.recording("write"):
        pass
    report = health.report()
    assert not health.failing and report["write_error"] is None
    assert report["last_write_error"] == "database or disk is full"


def test_a_writer_right_after_a_failed_write_fails_fast_then_the_store_is_tried_again() -> None:
    """Within `stuck` seconds of a database failure a new writer answers at once with that
    failure (it would wait the same busy timeout for the same answer); later ones try again."""
    clock = FakeClock()
    lock = WriterLock(stuck=0.3, cap=60.0, clock=clock)
    with pytest.raises(OperationalError), lock.hold():
        raise OperationalError("INSERT", {}, Exception("database is locked"))
    clock.advance(0.29)
    with pytest.raises(StoreUnavailable, match="database is locked"), lock.hold():
        pytest.fail("the store was tried although a write failed just before")
    clock.advance(0.02)
    tried = []
    with lock.hold():
        tried.append(True)
    assert tried == [True]
