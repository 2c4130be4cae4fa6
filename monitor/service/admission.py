"""Admission control: what the service refuses with 503 + ``Retry-After`` before it is swamped.

Two bounds, both kept on the event loop (every method is called from async code of one loop, so
plain integers need no lock):

* `InflightBudget`: a server-wide budget of request-body bytes being read or processed. A body
  whose declared ``Content-Length`` does not fit what is left is refused before a byte of it is
  read; a chunked body reserves as it streams. A `Reservation` gives its bytes back when the
  request ends, whatever the ending (answer, error, disconnect).
* `IngestSlots`: how many ingests may be in the threadpool (parsing, kernel, waiting for the
  store) at once. A stuck store then holds at most that many threads; the next ingest waits
  `SLOT_WAIT_S` for a slot (not at all while the store's last write failed), then gets 503
  instead of queueing without bound, and ``/metrics``, ``/healthz`` and reads keep their threads.

A refused body is never buffered: uvicorn reads the rest of an upload it already answered and
drops it (closing instead would reset the connection before the client reads the 503).
Both refusals count as ``overloaded`` in ``timwatch_rejected_batches_total{reason}`` when they
hit an ingest.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType

from ..core.errors import ApiError

__all__ = [
    "INGEST_SLOTS",
    "RETRY_AFTER_S",
    "SLOT_WAIT_S",
    "InflightBudget",
    "IngestSlots",
    "Reservation",
]

RETRY_AFTER_S = "1"

#: seconds an ingest waits for a free slot before its 503 (with the request overhead, every
#: writer behind a stuck store has its answer within 1 s)
SLOT_WAIT_S = 0.75

#: ingests admitted into the threadpool at once: AnyIO's default 40 worker threads minus 8
#: kept for scrapes of other apps, history reads and mask requests
INGEST_SLOTS = 32


def overloaded(detail: str, reason: str | None) -> ApiError:
    return ApiError(503, detail, reason=reason, headers={"Retry-After": RETRY_AFTER_S})


class InflightBudget:
    """`capacity` bytes shared by every request body being read or processed."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"in-flight budget must be positive, got {capacity}")
        self.capacity = capacity
        self.used = 0

    @property
    def left(self) -> int:
        return self.capacity - self.used

    def reservation(self, reason: str | None) -> Reservation:
        return Reservation(self, reason)


class Reservation:
    """The bytes one request holds of an `InflightBudget`; a context manager that gives them
    back on exit. `take` raises the 503 (counted under `reason`) when they do not fit."""

    def __init__(self, budget: InflightBudget, reason: str | None) -> None:
        self.budget, self.reason, self.held = budget, reason, 0

    def take(self, n: int) -> None:
        if n > self.budget.left:
            raise overloaded(
                f"server busy: {self.budget.used} of {self.budget.capacity} in-flight body bytes"
                f" in use, {n} more do not fit (--max-inflight); retry shortly",
                self.reason,
            )
        self.budget.used += n
        self.held += n

    def release(self) -> None:
        self.budget.used -= self.held
        self.held = 0

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class IngestSlots:
    """At most `limit` ingests at once in the threadpool. `enter` waits up to `wait` seconds
    for a free slot (slots turn over in milliseconds on a healthy store), then refuses with 503;
    a stuck store thus costs each writer past the limit `wait`, not a thread."""

    def __init__(self, limit: int = INGEST_SLOTS, wait: float = SLOT_WAIT_S) -> None:
        self.limit, self.wait = limit, wait
        self.busy = 0
        self._free: asyncio.Semaphore | None = None  # made on the serving loop, on first use

    def _refused(self) -> ApiError:
        return overloaded(
            f"server busy: {self.limit} ingests already wait for the store; retry shortly",
            "overloaded",
        )

    @asynccontextmanager
    async def enter(self, wait: float | None = None) -> AsyncIterator[None]:
        """Hold a slot for the block; `wait` (default `self.wait`) 0 refuses at once when none
        is free (the route passes 0 while the store's last write failed)."""
        if self._free is None:
            self._free = asyncio.Semaphore(self.limit)
        wait = self.wait if wait is None else wait
        if not self._free.locked():
            await self._free.acquire()  # a free slot: returns at once
        elif wait <= 0:
            raise self._refused()
        else:
            try:
                await asyncio.wait_for(self._free.acquire(), wait)
            except TimeoutError:
                raise self._refused() from None
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            self._free.release()
