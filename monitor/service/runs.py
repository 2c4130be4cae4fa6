"""The live per-run state the Prometheus exporter reads (run ids: `timwatch.monitor.core.runid`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from timwatch.monitor.core.accumulator import Accumulator

__all__ = [
    "REJECT_REASONS",
    "RunRegistry",
    "RunState",
]

#: the fixed label set of ``timwatch_rejected_batches_total{reason}``
REJECT_REASONS = ("validation", "too_large", "unauthorized", "store_unavailable", "overloaded")


@dataclass
class RunState:
    """What the exporter needs about one run: cumulative sums and the latest step row."""

    run: str
    acc: Accumulator  # every accepted batch since this process started
    row: dict[str, Any]  # the step row answered for the most recent batch (gauges)
    step: int
    last_seen: float  # time.monotonic() of the last accepted batch (TTL)
    last_batch_ts: float  # wall clock of the last accepted batch
    version: int = 0  # registry-wide counter value of the last change (render cache key)


@dataclass
class RunRegistry:
    """Thread-safe map run → RunState plus rejection counters; idle runs expire after ``ttl``.

    Every change to a run's state gives it a fresh ``version`` from one registry-wide counter,
    so a (run, version) pair names one exact state even across eviction and re-creation.
    """

    ttl: float = 3600.0
    _runs: dict[str, RunState] = field(default_factory=dict)
    _rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _clock: int = 0

    def observe(self, run: str, acc: Accumulator, row: dict[str, Any], step: int) -> None:
        """Add one newly accepted batch (never a replay) to ``run``'s live state.

        Counters take every batch; the gauges follow the highest step seen, so a late batch of
        an older step does not move ``timwatch_step`` backwards.
        """
        now_m, now_w = time.monotonic(), time.time()
        with self._lock:
            self._clock += 1
            cur = self._runs.get(run)
            if cur is None:
                self._runs[run] = RunState(run, acc, row, step, now_m, now_w, self._clock)
            else:
                cur.version = self._clock
                cur.acc = cur.acc.merge(acc)
                cur.last_seen, cur.last_batch_ts = now_m, now_w
                if step >= cur.step:
                    cur.row, cur.step = row, step

    def reject(self, reason: str) -> None:
        if reason not in self._rejected:
            raise ValueError(f"unknown rejection reason {reason!r}")
        with self._lock:
            self._rejected[reason] += 1

    def rejected(self) -> dict[str, int]:
        with self._lock:
            return dict(self._rejected)

    def evict(self, now: float | None = None) -> list[str]:
        """Drop runs idle longer than the TTL; returns their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [r for r, s in self._runs.items() if now - s.last_seen > self.ttl]
            for r in gone:
                del self._runs[r]
        return gone

    def snapshot(self) -> list[RunState]:
        """A consistent copy of the live runs (after evicting idle ones), sorted by id."""
        self.evict()
        with self._lock:
            return [
                RunState(s.run, s.acc, s.row, s.step, s.last_seen, s.last_batch_ts, s.version)
                for _, s in sorted(self._runs.items())
            ]

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._runs))

    def __len__(self) -> int:
        with self._lock:
            return len(self._runs)
