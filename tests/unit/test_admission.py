"""Admission control without HTTP: the in-flight budget is given back however a request ends,
and the ingest slots refuse the one past the limit with 503 + Retry-After."""

from __future__ import annotations

import asyncio

import pytest

from timwatch.monitor.core.errors import ApiError
from timwatch.monitor.service.admission import InflightBudget, IngestSlots


def test_reservations_share_the_budget_and_are_given_back_on_errors() -> None:
    budget = InflightBudget(100)
    with budget.reservation("overloaded") as a:
        a.take(60)
        with pytest.raises(ApiError) as refused, budget.reservation("overloaded") as b:
            b.take(30)
            b.take(20)  # 110 > 100
        assert refused.value.status == 503 and refused.value.reason == "overloaded"
        assert refused.value.headers["Retry-After"] == "1"
        assert budget.used == 60  # b's 30 came back when its block raised
    assert budget.used == 0
    with pytest.raises(ValueError):
        InflightBudget(0)


def test_ingest_slots_refuse_past_the_limit_and_free_on_exit() -> None:
    async def go() -> None:
        slots = IngestSlots(2, wait=0.01)
        async with slots.enter(), slots.enter():
            assert slots.busy == 2
            with pytest.raises(ApiError) as refused:
                async with slots.enter():
                    pass
            assert refused.value.status == 503 and refused.value.reason == "overloaded"
            assert refused.value.headers["Retry-After"] == "1"
        assert slots.busy == 0
        async with slots.enter(0.0):  # no wait: still admitted while a slot is free
            assert slots.busy == 1
        with pytest.raises(RuntimeError):
            async with slots.enter():
                raise RuntimeError("the ingest failed")
        assert slots.busy == 0

    asyncio.run(go())
