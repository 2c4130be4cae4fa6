"""Finishes taken by other replicas reach this one's exposition.

``POST /v1/runs/{run}/finish`` lands on one replica behind a load balancer; the others would
keep exporting the run unfinished for the whole run TTL (a day), and the per-run stall alert
would fire once the finishing replica's grace ended. `FinishSync` reads the store's
``finished_at`` of the runs this replica holds unfinished every `interval` seconds, on a daemon
thread (never on the scrape path: ``/metrics`` does not touch the store), and marks them finished
as of that time (`RunRegistry.finished_elsewhere`). One indexed query per interval, whatever the
number of runs; a store that is down only delays it.
"""

from __future__ import annotations

import logging

from ..core.errors import TimwatchError
from ..store import Store
from .background import BackgroundThread
from .runs import RunRegistry

__all__ = ["FINISH_SYNC_INTERVAL_S", "FinishSync"]

FINISH_SYNC_INTERVAL_S = 5.0

log = logging.getLogger("timwatch.api")


class FinishSync(BackgroundThread):
    """Copies store finishes into `runs` every `interval` seconds until `stop`."""

    def __init__(
        self, store: Store, runs: RunRegistry, interval: float = FINISH_SYNC_INTERVAL_S
    ) -> None:
        super().__init__("timwatch-finish")
        self.store, self.runs, self.interval = store, runs, interval

    def sync_once(self) -> list[str]:
        """One pass: the runs newly marked finished."""
        found = self.store.finished_runs(self.runs.unfinished())
        return [r for r, at in sorted(found.items()) if self.runs.finished_elsewhere(r, at)]

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sync_once()
            except TimwatchError:
                pass  # the store is down: the pinger and /healthz report it
            except Exception:  # a bug or an unexpected driver error: report, keep going
                log.exception("finish sync failed")
