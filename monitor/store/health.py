"""The write path's health, kept in memory: what ``/healthz`` reports without touching the store.

`WriteHealth` records the outcome of every write attempt (`Store.record_batch`, `Store.add_event`)
and of the service's background pings. Invariant: ``failing`` is true exactly while the most recent
write attempt, or the most recent ping, raised `StoreUnavailable`; one success of that kind clears
it. `WriterLock` is the in-process SQLite writer lock with a timeout, so a held store becomes a
503 within `WRITE_LOCK_TIMEOUT_S` instead of a queue of blocked threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy.exc import OperationalError

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.errors import StoreUnavailable

__all__ = ["WRITE_LOCK_TIMEOUT_S", "WRITE_QUEUE_CAP_S", "WriteHealth", "WriterLock"]

#: seconds one holder may keep the in-process SQLite writer lock before the writers queued behind
#: it give up; with the file's busy timeout (``db.SQLITE_BUSY_TIMEOUT_S``) every write on a held
#: store ends within 1 s
WRITE_LOCK_TIMEOUT_S = 0.5
#: seconds a writer queues behind a store that is making progress before it gives up anyway
WRITE_QUEUE_CAP_S = 5.0


class WriterLock:
    """The in-process SQLite writer lock, acquired with a timeout that tells a stuck store from
    a busy one. A queued writer gives up (`StoreUnavailable`) when the holder has held the lock
    for `stuck` seconds since the writer came, when a holder's transaction failed on the
    database (locked, full, read-only) while it waited or less than `stuck` seconds before it
    came, or after `cap` seconds in all, all timed by ``clock``. Writers
    queued behind a healthy store (holders change every few milliseconds) wait their turn;
    writers behind a locked file fail together as soon as the first of them does."""

    def __init__(
        self,
        stuck: float = WRITE_LOCK_TIMEOUT_S,
        cap: float = WRITE_QUEUE_CAP_S,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.stuck, self.cap, self._clock = stuck, cap, clock
        self._lock = threading.Lock()
        self._since = 0.0  # monotonic time the current holder took the lock
        self._failed = 0.0  # monotonic time a holder's transaction last failed on the database
        self._why = ""  # and the database's message

    @contextmanager
    def hold(self) -> Iterator[None]:
        start = self._clock.monotonic()
        # a write that failed on the database within the last `stuck` seconds counts as one
        # this writer queued behind: it would wait the same busy timeout for the same answer
        behind = start - self.stuck
        if self._failed > behind:
            raise self._behind_failure()
        while not self._lock.acquire(timeout=min(0.05, self.stuck)):
            now = self._clock.monotonic()
            if self._failed > behind:
                raise self._behind_failure()
            # a holder that took the lock before this writer came counts from its arrival
            if now - max(self._since, start) > self.stuck or now - start > self.cap:
                raise StoreUnavailable(
                    f"store busy: a write has held the lock for over {self.stuck:g} s"
                )
        if self._failed > behind:  # the lock came free because the write ahead of this failed
            self._lock.release()
            raise self._behind_failure()
        self._since = self._clock.monotonic()
        try:
            yield
        except OperationalError as e:
            lines = str(e.orig or e).strip().splitlines()
            self._why = lines[0][:200] if lines else type(e).__name__
            self._failed = self._clock.monotonic()
            raise
        finally:
            self._lock.release()

    def _behind_failure(self) -> StoreUnavailable:
        return StoreUnavailable(f"{self._why} (the write ahead of this one failed)")


@dataclass
class _Outcome:
    last_success: float | None = None  # wall clock
    last_error: float | None = None
    error: str | None = None
    consecutive_failures: int = 0

    def ok(self, now: float) -> None:
        self.last_success, self.consecutive_failures = now, 0

    def failed(self, now: float, message: str) -> None:
        self.last_error, self.error = now, message
        self.consecutive_failures += 1

    @property
    def failing(self) -> bool:
        return self.consecutive_failures > 0


class WriteHealth:
    """Thread-safe record of write and ping outcomes (wall-clock times, Unix seconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writes = _Outcome()
        self._pings = _Outcome()

    @contextmanager
    def recording(
        self, kind: Literal["write", "ping"], *, successes: bool = True
    ) -> Iterator[None]:
        """Record the outcome of the block: a `StoreUnavailable` it raises is a failure (and
        is re-raised), a normal exit a success unless `successes` is false (a read that
        starts a write, whose success says nothing of the write); other errors are not the
        store's health."""
        try:
            yield
        except StoreUnavailable as e:
            (self.write_failed if kind == "write" else self.ping_failed)(str(e))
            raise
        if successes:
            (self.write_ok if kind == "write" else self.ping_ok)()

    def write_ok(self) -> None:
        with self._lock:
            self._writes.ok(time.time())

    def write_failed(self, message: str) -> None:
        with self._lock:
            self._writes.failed(time.time(), message)

    def ping_ok(self) -> None:
        with self._lock:
            self._pings.ok(time.time())

    def ping_failed(self, message: str) -> None:
        with self._lock:
            self._pings.failed(time.time(), message)

    @property
    def failing(self) -> bool:
        with self._lock:
            return self._writes.failing or self._pings.failing

    def report(self) -> dict[str, Any]:
        """The fields ``/healthz`` shows: the last write error and success, the consecutive
        write failures, and the same for the background ping."""
        with self._lock:
            w, p = self._writes, self._pings
            return {
                "write_error": w.error if w.failing else None,
                "last_write_error": w.error,
                "last_write_error_at": w.last_error,
                "last_write_ok_at": w.last_success,
                "consecutive_write_failures": w.consecutive_failures,
                "ping_error": p.error if p.failing else None,
                "last_ping_ok_at": p.last_success,
                "consecutive_ping_failures": p.consecutive_failures,
            }
