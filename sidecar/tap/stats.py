"""The trainer tap's counters (`Tap.stats()`), apart from the shipper that keeps them."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TapStats"]


@dataclass
class TapStats:
    """Counters of one tap; `Tap.stats()` returns them as a dict with the queue's state."""

    reported: int = 0  # report() calls that enqueued a batch
    sent: int = 0  # batches the monitor accepted (2xx)
    dropped: int = 0  # batches dropped from the queue (oldest first) or too large to queue
    oversized: int = 0  # of `dropped`: single batches larger than max_queue_bytes
    refused: int = 0  # 4xx answers (never retried)
    invalid: int = 0  # failed local validation, never sent
    failed: int = 0  # gave up after max_retries (or at close)
    retries: int = 0  # retried attempts
    errors: int = 0  # exceptions swallowed inside report()
    unreported_drops: int = 0  # dropped + failed not yet counted by the monitor (the header)
    finished: bool | None = None  # the finish POST of close(): None = not sent
    last_error: str | None = None
    refused_statuses: dict[int, int] = field(default_factory=dict)
