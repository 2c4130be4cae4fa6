"""The proxies' `RolloutRecord`, and ``/timwatch/records``, one handler for both proxies
(`proxy.http.forward.records`): the held records with a -inf log-prob listed as null (JSON has
no infinity), and the counters."""

from __future__ import annotations

import asyncio
import math
import tracemalloc
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest

from timwatch.sidecar.proxy.capture import CaptureStore
from timwatch.sidecar.proxy.records import HELD_OVERHEAD_BYTES, RolloutRecord
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


def test_a_record_holds_its_arrays_per_token_and_reads_back() -> None:
    rec = RolloutRecord("r", [1, 2**40], [3, 4, 5], [-0.5, -1.0, -2.0], ["a", "a", None], "stop")
    assert rec.input_ids is not None and rec.input_ids.dtype == np.int64  # 2**40 needs 64 bits
    assert rec.output_ids.dtype == np.int32 and rec.runs == (("a", 2), (None, 1))
    assert rec.versions == ("a", "a", None) and rec.versions_as_int() is None
    assert RolloutRecord.from_dict(rec.to_dict()) == rec
    # arrays that are views of larger buffers (a reader's scratch, a peer's answer) are copied
    scratch, ids = np.zeros(1000), np.arange(1000, dtype=np.int64) + 2**40
    viewed = RolloutRecord("v", ids[:2], ids[:3], scratch[:3], runs=(("a", 3),),
                           entropy_lower=scratch[3:6], entropy_tail=scratch[6:9])  # fmt: skip
    arrays = (viewed.input_ids, viewed.output_ids, viewed.logp, viewed.entropy_lower)
    assert all(a is not None and a.flags.owndata for a in (*arrays, viewed.entropy_tail))
    assert viewed.nbytes == 4 * 3 * 8 + 2 * 8 + HELD_OVERHEAD_BYTES + 1 + 64  # int64 ids
    with pytest.raises(ValueError, match="logp has 2 entries"):
        RolloutRecord("r", None, [3, 4, 5], [-0.5, -1.0], ["a"] * 3)
    with pytest.raises(ValueError, match="versions do not cover 3 tokens"):
        RolloutRecord("r", None, [3, 4, 5], [-0.5] * 3, runs=(("a", 2),))


def test_nbytes_bounds_what_held_records_allocate() -> None:
    """`RolloutRecord.nbytes` (what the capture store's byte bound counts) against what
    tracemalloc sees 16 records of 4,096 tokens take in a store, built from lists as the object
    path builds them: within `HELD_OVERHEAD_BYTES` per record (about 1 % here)."""
    rng = np.random.default_rng(0)
    n, count = 4096, 16
    prompt = rng.integers(0, 150_000, 512).tolist()
    ids = rng.integers(0, 150_000, n).tolist()
    logp, lower, tail = (rng.random(n).tolist() for _ in range(3))
    store = CaptureStore()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(count):
            store.add(
                RolloutRecord(
                    f"{i:036d}", prompt, ids, logp, ["step-1"] * n, "length", "step-1",
                    lower, tail, "topk",
                )
            )  # fmt: skip
        used = (tracemalloc.get_traced_memory()[0] - before) / count
    finally:
        tracemalloc.stop()
    counted = store.counters.held_bytes / count
    assert counted == store.snapshot()[0].nbytes
    assert abs(counted - used) <= HELD_OVERHEAD_BYTES
