"""`proxy.http.state.DeferredCaptures`: captures of answers already sent run later, never lost.

They run in the order the answers went out: at `flush` (which the next upstream request and
every reader of the capture store call), on the loop's timer when nothing flushes, or at once
when too many wait. A failing capture is logged and the others still run.
"""

from __future__ import annotations

import asyncio

import pytest

from timwatch.sidecar.proxy.http.state import DeferredCaptures


def test_flush_runs_waiting_captures_in_order_once() -> None:
    async def main() -> list[int]:
        ran: list[int] = []
        deferred = DeferredCaptures(delay_s=60.0)
        for i in range(3):
            deferred.add(lambda i=i: ran.append(i))
        assert ran == [] and len(deferred) == 3
        deferred.flush()
        deferred.flush()
        return ran

    assert asyncio.run(main()) == [0, 1, 2]


def test_the_timer_runs_them_when_nothing_flushes() -> None:
    async def main() -> list[int]:
        ran: list[int] = []
        done = asyncio.Event()
        deferred = DeferredCaptures(delay_s=0.001)
        deferred.add(lambda: (ran.append(1), done.set()))
        await asyncio.wait_for(done.wait(), 30)  # nothing flushes: only the timer can run it
        assert len(deferred) == 0
        return ran

    assert asyncio.run(main()) == [1]


def test_too_many_waiting_run_at_once() -> None:
    async def main() -> list[int]:
        ran: list[int] = []
        deferred = DeferredCaptures(delay_s=60.0, max_pending=2)
        for i in range(3):
            deferred.add(lambda i=i: ran.append(i))
        assert len(deferred) == 0
        return ran

    assert asyncio.run(main()) == [0, 1, 2]


def test_a_failing_capture_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    def boom() -> None:
        raise ValueError("bad answer")

    async def main() -> list[int]:
        ran: list[int] = []
        deferred = DeferredCaptures(delay_s=60.0)
        deferred.add(boom)
        deferred.add(lambda: ran.append(2))
        deferred.flush()
        return ran

    assert asyncio.run(main()) == [2]
    assert "deferred capture failed" in caplog.text
