"""The clock that timed behaviour reads (run TTL and finish grace, the store's writer lock, the
tap's retry backoff), passed in so tests advance time instead of sleeping.

`SYSTEM_CLOCK` reads ``time.monotonic`` (intervals: TTLs, timeouts) and ``time.time`` (wall
time that is stored or exported); its ``wait(event, seconds)`` is ``event.wait(seconds)``: a
pause that ends early when the event is set (a backoff that ``close()`` interrupts). A test's
clock returns what it was set to and ``wait`` advances it (``tests/helpers/clock.py``).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "SystemClock"]


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    def wait(self, event: threading.Event, seconds: float) -> bool: ...


class SystemClock:
    """The process's clocks: ``time.monotonic``, ``time.time``, ``Event.wait``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Until ``event`` is set or ``seconds`` pass; whether it was set."""
        return event.wait(seconds)


SYSTEM_CLOCK: Clock = SystemClock()
