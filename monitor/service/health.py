"""``/healthz`` from memory: the write path's recorded outcomes plus a background store ping.

The route never touches the store. `Pinger` runs `Store.ping` on its own daemon thread every
`PING_INTERVAL_S` (its outcome lands in ``store.health``); a ping still unanswered after
`PING_TIMEOUT_S` counts as a failure until it returns. `health_answer` is what the route sends:
200 ``{"status": "ok", ...}``, or 503 ``{"status": "degraded", "write_error": ..., ...}`` while
the last write attempt or the last ping failed.
"""

from __future__ import annotations

import time
from typing import Any

from ..core.errors import StoreUnavailable
from ..store import Store
from .admission import InflightBudget
from .background import BackgroundThread
from .runs import RunRegistry
from .settings import Settings

__all__ = ["PING_INTERVAL_S", "PING_TIMEOUT_S", "Pinger", "health_answer"]

PING_INTERVAL_S = 5.0
PING_TIMEOUT_S = 5.0


class Pinger(BackgroundThread):
    """Pings `store` every `interval` seconds on a daemon thread until `stop`."""

    def __init__(self, store: Store, interval: float = PING_INTERVAL_S) -> None:
        super().__init__("timwatch-ping")
        self.store, self.interval = store, interval
        self._started: float | None = None  # monotonic start of the ping in flight

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._started = time.monotonic()
            try:
                self.store.ping()
            except StoreUnavailable:
                pass  # recorded in store.health
            except Exception as exc:  # a bug or an unexpected driver error: report, keep pinging
                self.store.health.ping_failed(f"{type(exc).__name__}: {exc}")
            finally:
                self._started = None
            self._stop.wait(self.interval)

    def stuck_for(self) -> float | None:
        """Seconds the ping in flight has run past `PING_TIMEOUT_S`'s start, if it has."""
        started = self._started
        if started is None:
            return None
        age = time.monotonic() - started
        return age if age > PING_TIMEOUT_S else None


def health_answer(
    settings: Settings,
    store: Store,
    runs: RunRegistry,
    pinger: Pinger | None,
    budget: InflightBudget | None = None,
) -> tuple[dict[str, Any], int]:
    """The body and status of ``GET /healthz``, from memory only (``inflight_bytes``: body
    bytes held of the ``--max-inflight`` budget right now)."""
    report = store.health.report()
    stuck = pinger.stuck_for() if pinger is not None else None
    if stuck is not None:
        report["ping_error"] = f"store ping unanswered for {stuck:.0f} s"
    degraded = report["write_error"] is not None or report["ping_error"] is not None
    body = {
        "status": "degraded" if degraded else "ok",
        "store": store.description,
        "writes_protected": settings.writes_protected,
        "reads_protected": settings.reads_protected,
        "live_runs": len(runs),
        **report,
    }
    if budget is not None:
        body["inflight_bytes"], body["inflight_budget"] = budget.used, budget.capacity
    return body, 503 if degraded else 200
