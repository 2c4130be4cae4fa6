"""The clock that timed behaviour reads (run TTL and finish grace, the store's writer lock, the
tap's retry backoff), passed in so tests advance time instead of sleeping.

`SYSTEM_CLOCK` reads ``time.monotonic`` (intervals: TTLs, timeouts, backoff) and ``time.time``
(wall time that is stored or exported), and its ``sleep`` is ``time.sleep``. A test's clock
returns what it was set to and ``sleep`` advances it (``tests/helpers/clock.py``).
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "SystemClock"]


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The process's clocks: ``time.monotonic``, ``time.time``, ``time.sleep``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM_CLOCK: Clock = SystemClock()
