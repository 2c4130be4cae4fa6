"""The tap's queue: drop-oldest, bounded by batch count and by snapshot bytes, and its drop log.

Invariants:
- After `DropQueue.put` returns, ``len(queue) <= max_items`` and ``queue.nbytes <= max_bytes``;
  a batch larger than ``max_bytes`` on its own is never queued. Every batch that leaves the
  queue without being taken by the shipper is returned to the caller, which counts it and frees
  it after releasing its lock (freeing a large batch unmaps memory).
- Not thread-safe by itself: the `Tap` holds its lock around every call, and holds it for
  nothing slower than a deque operation.
- `DropLog` lets through at most one warning per ``interval_s`` and each warning carries the
  drops since the previous one, so no drop goes unmentioned once `pending` is logged at close.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DropLog", "DropQueue", "Item"]


@dataclass
class Item:
    """One reported batch waiting to ship: snapshots of the arrays, not yet validated."""

    step: int
    batch_id: str | None  # the caller's id; None: generated from the content when encoded
    meta: dict[str, Any]
    arrays: dict[str, Any]
    nbytes: int  # host bytes of the snapshots
    event: Any = None  # torch.cuda.Event guarding pinned copies
    buffers: list[Any] = field(default_factory=list)  # `BufferPool` buffers the copies live in


class DropQueue:
    """A FIFO of `Item` bounded by ``max_items`` and ``max_bytes`` (see the module docstring)."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        if max_items < 1:
            raise ValueError(f"queue_size must be ≥ 1, got {max_items}")
        if max_bytes < 1:
            raise ValueError(f"max_queue_bytes must be ≥ 1, got {max_bytes}")
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: deque[Item] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Item) -> list[Item]:
        """Append `item`, dropping the oldest until both bounds hold; the dropped items."""
        if item.nbytes > self.max_bytes:
            return [item]
        dropped: list[Item] = []
        while self._items and (
            len(self._items) >= self.max_items or self.nbytes + item.nbytes > self.max_bytes
        ):
            dropped.append(self._pop())
        self._items.append(item)
        self.nbytes += item.nbytes
        return dropped

    def pop(self) -> Item:
        """The oldest item (the queue must not be empty)."""
        return self._pop()

    def clear(self) -> list[Item]:
        out = list(self._items)
        self._items.clear()
        self.nbytes = 0
        return out

    def _pop(self) -> Item:
        item = self._items.popleft()
        self.nbytes -= item.nbytes
        return item


class DropLog:
    """Rate-limits drop warnings: `add` answers the count to log now, or None to stay quiet."""

    def __init__(self, interval_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self.pending = 0  # drops not mentioned in a warning yet

    def add(self, n: int) -> int | None:
        self.pending += n
        now = self._clock()
        if self.pending and (self._last is None or now - self._last >= self.interval_s):
            self._last = now
            out, self.pending = self.pending, 0
            return out
        return None

    def take(self) -> int:
        """The drops not logged yet (at close), and forget them."""
        out, self.pending = self.pending, 0
        return out
