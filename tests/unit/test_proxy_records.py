"""``/timwatch/records``, one handler for both proxies (`proxy.http.forward.records`): the held
records with a -inf log-prob listed as null (JSON has no infinity), and the counters."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from timwatch.sidecar.proxy.capture import CaptureStore
from timwatch.sidecar.proxy.records import RolloutRecord
from timwatch.sidecar.proxy.sglang.app import create_app as create_sglang
from timwatch.sidecar.proxy.vllm.app import create_app as create_vllm


def _get(app: Any, path: str) -> Any:
    async def go() -> Any:
        transport = httpx.ASGITransport(app=app)  # no lifespan: these paths need no upstream
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            response = await client.get(path)
        assert response.status_code == 200
        return response.json()

    return asyncio.run(go())


@pytest.mark.parametrize("create", [create_sglang, create_vllm], ids=["sglang", "vllm"])
def test_records_list_a_minus_inf_logprob_as_null(create: Callable[..., Any]) -> None:
    store = CaptureStore()
    store.add(
        RolloutRecord(
            rid="r1",
            input_ids=(1, 2),
            output_ids=(5, 6, 7),
            logp=(-0.5, -math.inf, -1.25),
            versions=("v1", "v1", "v2"),
            finish_reason="stop",
            weight_version="v2",
        )
    )
    body = _get(create("http://127.0.0.1:9", capture=store), "/timwatch/records")
    (record,) = body["records"]
    assert record["rid"] == "r1" and record["logp"] == [-0.5, None, -1.25]
    assert record["versions"] == ["v1", "v1", "v2"]
    assert body["capture"]["captured"] == 1 and body["proxy"]["requests"] == 0
    assert len(store) == 1  # read, not popped
