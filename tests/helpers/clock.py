"""`FakeClock`: a `timwatch.monitor.core.clock.Clock` that moves only when told to.

``advance(s)`` moves both its monotonic and its wall time by ``s``; ``sleep(s)`` advances it
(and records the request in ``slept``), so code that backs off returns at once."""

from __future__ import annotations

__all__ = ["FakeClock"]


class FakeClock:
    def __init__(self, monotonic: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._m, self._w = monotonic, wall
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self._m

    def time(self) -> float:
        return self._w

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        self._m += seconds
        self._w += seconds
