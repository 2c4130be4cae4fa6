"""The write path's health, kept in memory: what ``/healthz`` reports without touching the store.

`WriteHealth` records the outcome of every write attempt (`Store.record_batch`, `Store.add_event`)
and of the service's background pings. Invariant: ``failing`` is true exactly while the most recent
write attempt, or the most recent ping, raised `StoreUnavailable`; one success of that kind clears
it. `timed_lock` is the in-process SQLite writer lock with a deadline, so a held lock becomes a
503 within `WRITE_LOCK_TIMEOUT_S` instead of a queue of blocked threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from timwatch.monitor.core.errors import StoreUnavailable

__all__ = ["WRITE_LOCK_TIMEOUT_S", "WriteHealth", "timed_lock"]

#: seconds a writer waits for the in-process SQLite writer lock before `StoreUnavailable`; with
#: the file's busy timeout (``db.SQLITE_BUSY_TIMEOUT_S``) a write on a held store ends within 1 s
WRITE_LOCK_TIMEOUT_S = 0.5


@contextmanager
def timed_lock(lock: threading.Lock, timeout: float = WRITE_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold `lock`, or raise `StoreUnavailable` if another writer keeps it past `timeout`."""
    if not lock.acquire(timeout=timeout):
        raise StoreUnavailable(f"store busy: another write held the lock for over {timeout:g} s")
    try:
        yield
    finally:
        lock.release()


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
