"""What one proxy instance holds, whatever its engine, and the captures it runs off the
response path.

`ProxyState` holds the upstream's URL and client, the capture store, the timeout, the counters
and the captures still deferred (`DeferredCaptures`); its `commit` puts a finished record in
the store. Each proxy extends it with what only that proxy holds
(`proxy.sglang.app.SglangState`, `proxy.vllm.app.VllmState`), so `proxy.http.forward` and
`proxy.join` read one type and import neither proxy. `serving` runs a state's lifetime in its
app's lifespan.

Invariant: every reader of the capture store calls `settle_captures` first, so a record whose
answer already went out is in the store before anyone can look for it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from ..capture import CaptureStore
from ..records import RolloutRecord
from .client import Upstream

__all__ = ["DeferredCaptures", "ProxyState", "serving", "settle_captures"]

log = logging.getLogger(__name__)


class DeferredCaptures:
    """Captures of answers already sent, run off the response path.

    A capture waits until the next planned request has been written upstream (the engine then
    computes its answer while the proxy captures), at most ``delay_s`` when no request comes,
    and never past `flush`, which every reader of the capture store calls first; with more
    than ``max_pending`` waiting, the newest runs at once. So a record is in the store before
    anyone can look for it, and the bytes waiting are bounded (``max_pending`` answers)."""

    def __init__(self, *, delay_s: float = 0.02, max_pending: int = 64) -> None:
        self.delay_s, self.max_pending = delay_s, max_pending
        self._pending: list[Callable[[], None]] = []
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, capture: Callable[[], None]) -> None:
        self._pending.append(capture)
        if len(self._pending) > self.max_pending:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.delay_s, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            pending, self._pending = self._pending, []
            for capture in pending:
                try:
                    capture()
                except Exception:  # a capture must never take the proxy down
                    log.exception("deferred capture failed")


class ProxyState:
    """Everything one proxy instance holds whatever its engine: upstream client, capture store,
    timeout, counters, deferred captures."""

    def __init__(
        self,
        upstream: str,
        *,
        capture: CaptureStore,
        timeout_s: float | None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.capture = capture
        self.timeout_s = timeout_s
        self._client: Upstream | None = None
        self.deferred = DeferredCaptures()
        # whether its records carry top-k entropy bounds (the join then reports the rollout's)
        self.rollout_entropy = False
        self.counters = {
            "requests": 0,
            "wire_errors": 0,
            "upstream_errors": 0,
            "partial_streams": 0,
            "raw_streams": 0,
        }

    def client(self) -> Upstream:
        if self._client is None:
            raise RuntimeError("proxy client not started (lifespan not run)")
        return self._client

    def commit(self, record: RolloutRecord) -> None:
        self.capture.add(record)


def settle_captures(state: ProxyState) -> None:
    """Run the captures still deferred: every reader of the capture store calls this first."""
    state.deferred.flush()


@asynccontextmanager
async def serving(state: ProxyState) -> AsyncIterator[None]:
    """The proxy's lifetime, inside its app's lifespan: the upstream client is opened on
    ``state``; on exit the captures still deferred run, then the client is closed."""
    client = state._client = Upstream(state.upstream, timeout_s=state.timeout_s)
    try:
        # Everything allocated so far lives as long as the proxy: keep it out of the
        # collector's scans, which then only walk what requests allocate.
        gc.freeze()
        yield
    finally:
        settle_captures(state)
        await client.aclose()
        state._client = None
