"""In-memory store of finished rollout records awaiting their trainer report.

The join finds a record either by the engine's request id (frameworks that keep SGLang's
``meta_info.id``) or by the sampled token ids (frameworks that only keep tokens). Records that
no trainer report claims within ``ttl_s`` expire and are counted, so a sidecar in front of an
engine whose samples are filtered out (rejected rollouts, eval traffic) stays bounded; the
`MAX_RECORDS` cap and the ``max_held_bytes`` bound evict the oldest first for the same reason
(``evicted`` counts them, ``evicted_bytes`` their bytes; ``held_bytes`` is what is held now).
A record's arrays take about 28 bytes per token (`RolloutRecord.nbytes`), so the byte bound
is what the records really cost.

Thread-safe: the proxy's event loop adds records while the joiner may pop from another thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .records import RolloutRecord

__all__ = ["CaptureStore", "CaptureCounters", "DEFAULT_MAX_HELD_BYTES"]

DEFAULT_MAX_HELD_BYTES = 2 << 30
#: records held at most, whatever their bytes
MAX_RECORDS = 200_000


@dataclass
class CaptureCounters:
    captured: int = 0
    replaced: int = 0
    popped: int = 0
    expired: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    held_bytes: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class CaptureStore:
    """Finished records keyed by rid and by output-token tuple, oldest first."""

    def __init__(
        self,
        *,
        ttl_s: float = 900.0,
        max_held_bytes: int = DEFAULT_MAX_HELD_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_held_bytes <= 0:
            raise ValueError(f"max_held_bytes must be > 0, got {max_held_bytes}")
        self.ttl_s = ttl_s
        self.max_held_bytes = max_held_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._by_rid: OrderedDict[str, tuple[float, RolloutRecord]] = OrderedDict()
        # hash of the output ids' bytes -> rids; a hit is confirmed by comparing the arrays
        self._by_tokens: dict[int, deque[str]] = {}
        self.counters = CaptureCounters()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_rid)

    def add(self, record: RolloutRecord) -> None:
        """Store a record; a second record with the same rid replaces the first. Then the
        oldest records are evicted until both `MAX_RECORDS` and ``max_held_bytes`` hold (a
        single record larger than the byte bound is evicted at once, and counted)."""
        key = hash(record.token_key())
        with self._lock:
            self._expire_locked(self._clock())
            if record.rid in self._by_rid:
                self._remove_locked(record.rid)
                self.counters.replaced += 1
            self._by_rid[record.rid] = (self._clock(), record)
            self._by_tokens.setdefault(key, deque()).append(record.rid)
            self.counters.captured += 1
            self.counters.held_bytes += record.nbytes
            while self._by_rid and (
                len(self._by_rid) > MAX_RECORDS or self.counters.held_bytes > self.max_held_bytes
            ):
                gone = self._remove_locked(next(iter(self._by_rid)))
                self.counters.evicted += 1
                self.counters.evicted_bytes += gone.nbytes if gone is not None else 0

    def pop_by_rid(self, rid: str) -> RolloutRecord | None:
        with self._lock:
            self._expire_locked(self._clock())
            held = self._remove_locked(rid)
            self.counters.popped += held is not None
        return held

    def pop_by_tokens(self, output_ids: Sequence[int]) -> RolloutRecord | None:
        """Oldest unclaimed record whose sampled tokens equal ``output_ids`` exactly."""
        want = np.asarray(output_ids, dtype=np.int64)
        key = hash(want.tobytes())
        with self._lock:
            self._expire_locked(self._clock())
            for rid in self._by_tokens.get(key, ()):
                held = self._by_rid[rid][1]
                if np.array_equal(held.output_ids, want):
                    self._remove_locked(rid)
                    self.counters.popped += 1
                    break
            else:
                return None
        return held

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
        self.counters.held_bytes -= record.nbytes
        key = hash(record.token_key())
        rids = self._by_tokens.get(key)
        if rids is not None:
            if rid in rids:
                rids.remove(rid)
            if not rids:
                del self._by_tokens[key]
        return record
