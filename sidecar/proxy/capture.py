"""In-memory store of finished rollout records awaiting their trainer report.

The join finds a record either by the engine's request id (frameworks that keep SGLang's
``meta_info.id``) or by the sampled token ids (frameworks that only keep tokens). Records that
no trainer report claims within ``ttl_s`` expire and are counted, so a sidecar in front of an
engine whose samples are filtered out (rejected rollouts, eval traffic) stays bounded; the
``max_records`` cap evicts the oldest first for the same reason.

Thread-safe: the proxy's event loop adds records while the joiner may pop from another thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from timwatch.sidecar.proxy.records import RolloutRecord

__all__ = ["CaptureStore", "CaptureCounters"]


@dataclass
class CaptureCounters:
    captured: int = 0
    replaced: int = 0
    popped: int = 0
    expired: int = 0
    evicted: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class CaptureStore:
    """Finished records keyed by rid and by output-token tuple, oldest first."""

    def __init__(
        self,
        *,
        ttl_s: float = 900.0,
        max_records: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_records <= 0:
            raise ValueError(f"max_records must be > 0, got {max_records}")
        self.ttl_s = ttl_s
        self.max_records = max_records
        self._clock = clock
        self._lock = threading.Lock()
        self._by_rid: OrderedDict[str, tuple[float, RolloutRecord]] = OrderedDict()
        self._by_tokens: dict[tuple[int, ...], deque[str]] = {}
        self.counters = CaptureCounters()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_rid)

    def add(self, record: RolloutRecord) -> None:
        """Store a record; a second record with the same rid replaces the first."""
        with self._lock:
            self._expire_locked(self._clock())
            if record.rid in self._by_rid:
                self._remove_locked(record.rid)
                self.counters.replaced += 1
            self._by_rid[record.rid] = (self._clock(), record)
            self._by_tokens.setdefault(record.output_ids, deque()).append(record.rid)
            self.counters.captured += 1
            while len(self._by_rid) > self.max_records:
                oldest = next(iter(self._by_rid))
                self._remove_locked(oldest)
                self.counters.evicted += 1

    def pop_by_rid(self, rid: str) -> RolloutRecord | None:
        with self._lock:
            self._expire_locked(self._clock())
            record = self._remove_locked(rid)
            if record is not None:
                self.counters.popped += 1
            return record

    def pop_by_tokens(self, output_ids: Sequence[int]) -> RolloutRecord | None:
        """Oldest unclaimed record whose sampled tokens equal ``output_ids`` exactly."""
        key = tuple(int(t) for t in output_ids)
        with self._lock:
            self._expire_locked(self._clock())
            rids = self._by_tokens.get(key)
            if not rids:
                return None
            record = self._remove_locked(rids[0])
            if record is not None:
                self.counters.popped += 1
            return record

    def snapshot(self) -> list[RolloutRecord]:
        """All records still held, oldest first (read-only: nothing is popped)."""
        with self._lock:
            self._expire_locked(self._clock())
            return [rec for _, rec in self._by_rid.values()]

    def expire(self) -> int:
        """Drop records older than ``ttl_s``; returns how many were dropped now."""
        with self._lock:
            return self._expire_locked(self._clock())

    def _expire_locked(self, now: float) -> int:
        dropped = 0
        while self._by_rid:
            rid, (added, _) = next(iter(self._by_rid.items()))
            if now - added < self.ttl_s:
                break
            self._remove_locked(rid)
            dropped += 1
        self.counters.expired += dropped
        return dropped

    def _remove_locked(self, rid: str) -> RolloutRecord | None:
        entry = self._by_rid.pop(rid, None)
        if entry is None:
            return None
        record = entry[1]
        rids = self._by_tokens.get(record.output_ids)
        if rids is not None:
            try:
                rids.remove(rid)
            except ValueError:
                pass
            if not rids:
                del self._by_tokens[record.output_ids]
        return record
