"""The per-app machinery that keeps the service answering while the store is stuck.

`Serving` holds the incremental ``/metrics`` renderer and the one thread it renders on (never the
shared AnyIO threadpool, where ingests may be blocked on the store), the in-flight body budget,
the ingest slots, the background store pinger behind ``/healthz`` and the thread that copies
other replicas' finishes from the store (`FinishSync`). `create_app` builds one;
its lifespan starts and stops it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..store import Store
from .admission import InflightBudget, IngestSlots
from .exposition import Exposition
from .finish_sync import FinishSync
from .health import Pinger
from .runs import RunRegistry
from .settings import Settings

__all__ = ["Serving"]


@dataclass
class Serving:
    exposition: Exposition
    budget: InflightBudget
    slots: IngestSlots
    pinger: Pinger
    finish_sync: FinishSync
    _scrapes: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="timwatch-scrape")
    )

    @classmethod
    def build(cls, settings: Settings, store: Store, runs: RunRegistry) -> Serving:
        return cls(
            Exposition(runs),
            InflightBudget(settings.inflight_budget),
            IngestSlots(),
            Pinger(store),
            FinishSync(store, runs),
        )

    async def metrics_text(self) -> bytes:
        """The exposition, rendered on the scrape thread (one scrape at a time)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._scrapes, self.exposition.render)

    def start(self) -> None:
        self.pinger.start()
        self.finish_sync.start()

    def stop(self) -> None:
        self.pinger.stop()
        self.finish_sync.stop()
        self._scrapes.shutdown(wait=False, cancel_futures=True)
