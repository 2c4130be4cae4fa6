"""`FakeClock`: a `timwatch.monitor.core.clock.Clock` that moves only when told to.

``advance(s)`` moves both its monotonic and its wall time by ``s``; ``wait(event, s)`` records
``s`` in ``waited``, advances by it and returns at once (whether ``event`` is set), so code
that backs off goes on without real time passing."""

from __future__ import annotations

import threading

__all__ = ["FakeClock"]


class FakeClock:
    def __init__(self, monotonic: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._m, self._w = monotonic, wall
        self.waited: list[float] = []

    def monotonic(self) -> float:
        return self._m

    def time(self) -> float:
        return self._w

    def wait(self, event: threading.Event, seconds: float) -> bool:
        self.waited.append(seconds)
        self.advance(seconds)
        return event.is_set()

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        self._m += seconds
        self._w += seconds
