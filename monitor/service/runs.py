"""The live per-run state the Prometheus exporter reads (run ids: `timwatch.monitor.core.runid`).

Lifecycle of a run here: its first accepted batch makes it live; it stays exported while batches
arrive and for ``ttl`` seconds after the last one (default one day, so a stuck run keeps its
series and its stall alert); ``finish`` marks it finished, and a finished run leaves after
``finish_grace`` seconds. A batch accepted after ``finish`` re-opens the run (unfinished again).

Counters: without a replica id they count what this process accepted and restart at 0 with the
process, like any Prometheus counter. With one (``timwatch serve --replica-id``) every batch
comes with the replica's committed run totals (`timwatch.monitor.store.totals`), which replace
the accumulator when they hold more batches, and `seed` loads them at start: the exported
counters then equal what that id has stored, across restarts and eviction.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..core.accumulator import Accumulator

from ..core.clock import SYSTEM_CLOCK, Clock
from .settings import DEFAULT_FINISH_GRACE, DEFAULT_RUN_TTL

__all__ = [
    "REJECT_REASONS",
    "SCALAR_REJECT_REASONS",
    "ScalarState",
    "RunRegistry",
    "RunState",
]

#: the fixed label set of ``timwatch_rejected_batches_total{reason}``; ``conflict``: a known
#: ``batch_id`` posted again with different content (409); ``overloaded``: no ingest slot or
#: in-flight budget left (503)
REJECT_REASONS = (
    "validation", "too_large", "unauthorized", "store_unavailable", "conflict", "overloaded",
)  # fmt: skip

#: the fixed label set of refused scalar posts (``POST /v1/runs/{run}/scalars``)
SCALAR_REJECT_REASONS = ("validation", "too_large", "unauthorized")


@dataclass
class RunState:
    """What the exporter needs about one run: cumulative sums and the latest step row."""

    run: str
    acc: Accumulator  # every accepted batch since this process started (or the replica's totals)
    row: dict[str, Any]  # the step row answered for the most recent batch (gauges)
    step: int
    last_seen: float  # the registry clock's monotonic time of the last accepted batch (TTL)
    last_batch_ts: float  # wall clock of the last accepted batch
    tap_dropped: int = 0  # batches the run's taps reported dropping (Timwatch-Tap-Dropped)
    tap_outside: int = 0  # of which reported at a finish, not with a batch (never stored)
    finished_m: float | None = None  # monotonic time of finish; None while running
    version: int = 0  # registry-wide counter value of the last change (render cache key)


@dataclass
class ScalarState:
    """The latest scalars one run posted (``POST /v1/runs/{run}/scalars``): what the
    exporter's ``timwatch_scalar_*`` gauges show. Evicted by the same TTL and finish grace as
    `RunState`."""

    run: str
    step: int
    source: str | None
    values: dict[str, float | None]  # canonical name → value (None: non-finite)
    last_seen: float  # the registry clock's monotonic time of the last accepted post
    finished_m: float | None = None


@dataclass
class RunRegistry:
    """Thread-safe map run → RunState plus rejection counters; idle runs expire after ``ttl``,
    finished ones ``finish_grace`` after their finish, both by ``clock``.

    Every change to a run's state gives it a fresh ``version`` from one registry-wide counter,
    so a (run, version) pair names one exact state even across eviction and re-creation.
    """

    ttl: float = DEFAULT_RUN_TTL
    finish_grace: float = DEFAULT_FINISH_GRACE
    clock: Clock = SYSTEM_CLOCK
    _runs: dict[str, RunState] = field(default_factory=dict)
    _rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    _scalar_rejected: dict[str, int] = field(default_factory=dict)
    _scalars: dict[str, ScalarState] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _clock: int = 0

    def observe(
        self,
        run: str,
        acc: Accumulator,
        row: dict[str, Any],
        step: int,
        tap_dropped: int = 0,
        totals: tuple[Accumulator, int] | None = None,
    ) -> None:
        """Add one newly accepted batch (never a replay) to ``run``'s live state; a finished
        run is re-opened.

        Counters take every batch; with ``totals`` (the replica's committed run totals and tap
        drops, `store.totals.Tally`) they are set to those instead, unless they already hold
        as many batches (a concurrent batch of this replica committed after this one and was
        observed first: its totals include this batch). The gauges follow the highest step
        seen, so a late batch of an older step does not move ``timwatch_step`` backwards.
        """
        now_m, now_w = self.clock.monotonic(), self.clock.time()
        with self._lock:
            self._clock += 1
            cur = self._runs.get(run)
            if cur is None:
                acc, tap = (acc, tap_dropped) if totals is None else totals
                self._runs[run] = RunState(
                    run, acc, row, step, now_m, now_w, tap, version=self._clock
                )
                return
            cur.version = self._clock
            if totals is None:
                cur.acc = cur.acc.merge(acc)
                cur.tap_dropped += tap_dropped
            elif totals[0].batches > cur.acc.batches:
                cur.acc, cur.tap_dropped = totals[0], totals[1] + cur.tap_outside
            cur.last_seen, cur.last_batch_ts = now_m, now_w
            cur.finished_m = None
            if step >= cur.step:
                cur.row, cur.step = row, step

    def seed(
        self,
        run: str,
        totals: tuple[Accumulator, int],
        row: dict[str, Any],
        step: int,
        last_batch_ts: float,
        finished_at: float | None,
    ) -> bool:
        """Load a run a replica had counted before it started (its stored totals, the row of
        its highest step, the wall time of its last batch and of the finish, if any), aged so
        the TTL and the finish grace run from those times; False if already expired (nothing
        loaded) or already live."""
        now_m, now_w = self.clock.monotonic(), self.clock.time()
        last_m = now_m - max(0.0, now_w - last_batch_ts)
        fin_m = None if finished_at is None else now_m - max(0.0, now_w - finished_at)
        acc, tap = totals
        state = RunState(run, acc, row, step, last_m, last_batch_ts, tap, finished_m=fin_m)
        with self._lock:
            if run in self._runs or self._expired(state, now_m):
                return False
            self._clock += 1
            state.version = self._clock
            self._runs[run] = state
            return True

    def finish(self, run: str, now: float | None = None) -> bool:
        """Mark a live run finished (it leaves after ``finish_grace``); False if not live.
        Finishing again keeps the first time, so the grace is not extended."""
        now = self.clock.monotonic() if now is None else now
        with self._lock:
            sc = self._scalars.get(run)
            if sc is not None and sc.finished_m is None:
                sc.finished_m = now
            cur = self._runs.get(run)
            if cur is None:
                return sc is not None
            if cur.finished_m is None:
                cur.finished_m = now
                self._clock += 1
                cur.version = self._clock  # timwatch_run_finished changed: re-render the run
            return True

    def unfinished(self) -> list[str]:
        """Live runs not marked finished here."""
        with self._lock:
            return [r for r, s in self._runs.items() if s.finished_m is None]

    def finished_elsewhere(self, run: str, finished_at: float) -> bool:
        """Mark `run` finished as of the wall time `finished_at`, when another replica took the
        finish (read back from the store): its grace runs from that time. A run that took a
        batch here after `finished_at` stays open (that batch re-opened it in the store too)."""
        with self._lock:
            cur = self._runs.get(run)
            if cur is None or cur.finished_m is not None or cur.last_batch_ts > finished_at:
                return False
            cur.finished_m = self.clock.monotonic() - max(0.0, self.clock.time() - finished_at)
            self._clock += 1
            cur.version = self._clock
            return True

    def add_tap_dropped(self, run: str, n: int) -> bool:
        """Add `n` batches a tap reported dropping outside a batch post (its finish); False if
        `run` is not live (the count then has no series to go to)."""
        with self._lock:
            cur = self._runs.get(run)
            if cur is None:
                return False
            cur.tap_dropped += n
            cur.tap_outside += n
            self._clock += 1
            cur.version = self._clock
            return True

    def reject(self, reason: str) -> None:
        if reason not in self._rejected:
            raise ValueError(f"unknown rejection reason {reason!r}")
        with self._lock:
            self._rejected[reason] += 1

    def observe_scalars(
        self, run: str, step: int, source: str | None, mapped: Any, answer: dict[str, Any]
    ) -> None:
        """Keep the latest canonical scalars of `run` for the exporter: a later step replaces
        them, the same step adds to them, an earlier one (a resumed trainer catching up) and a
        replay change nothing but the idle clock."""
        now = self.clock.monotonic()
        with self._lock:
            cur = self._scalars.get(run)
            if cur is None or step > cur.step:
                self._scalars[run] = ScalarState(run, step, source, dict(mapped.canonical), now)
                return
            cur.last_seen, cur.finished_m = now, None
            if step == cur.step and not answer.get("replayed"):
                cur.values.update(mapped.canonical)
                cur.source = source

    def scalar_states(self) -> list[ScalarState]:
        """Copies of the live runs' latest scalars (expired ones evicted first), by run id."""
        self.evict()
        with self._lock:
            return [
                dataclasses.replace(s, values=dict(s.values))
                for _, s in sorted(self._scalars.items())
            ]

    def reject_scalars(self, reason: str) -> None:
        """Count a refused ``POST /v1/runs/{run}/scalars`` under `reason`
        (`SCALAR_REJECT_REASONS`)."""
        if reason not in SCALAR_REJECT_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        with self._lock:
            self._scalar_rejected[reason] = self._scalar_rejected.get(reason, 0) + 1

    def scalar_rejected(self) -> dict[str, int]:
        with self._lock:
            return {r: self._scalar_rejected.get(r, 0) for r in SCALAR_REJECT_REASONS}

    def rejected(self) -> dict[str, int]:
        with self._lock:
            return dict(self._rejected)

    def _expired(self, s: RunState | ScalarState, now: float) -> bool:
        if s.finished_m is not None and now - s.finished_m > self.finish_grace:
            return True
        return now - s.last_seen > self.ttl

    def evict(self, now: float | None = None) -> list[str]:
        """Drop runs idle longer than the TTL and finished runs past their grace; returns
        their ids."""
        now = self.clock.monotonic() if now is None else now
        with self._lock:
            gone = [r for r, s in self._runs.items() if self._expired(s, now)]
            for r in gone:
                del self._runs[r]
            for r in [r for r, s in self._scalars.items() if self._expired(s, now)]:
                del self._scalars[r]
        return gone

    def snapshot(self) -> list[RunState]:
        """A consistent copy of the live runs (after evicting expired ones), sorted by id."""
        self.evict()
        with self._lock:
            return [dataclasses.replace(s) for _, s in sorted(self._runs.items())]

    def __contains__(self, run: object) -> bool:
        with self._lock:
            return run in self._runs

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._runs))

    def __len__(self) -> int:
        with self._lock:
            return len(self._runs)
