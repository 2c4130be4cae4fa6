"""Streams relayed by `proxy.relay.relay_stream`: the client gets the upstream's bytes, and the
records equal the object path's, however the stream is cut into reads.

Streams come from the SGLang stand-in (`tests/helpers/fake_sglang.py`, in process; real SGLang
needs a GPU), cumulative and incremental, one sample and a batch of two (chunks carry
``"index"``). The large-chunk threshold is lowered so that short streams also take the path
long cumulative chunks take (held by reference, read only when needed).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

import tests.helpers.fake_sglang as fake
from timwatch.sidecar.proxy import relay
from timwatch.sidecar.proxy.records import HeldRecord, RolloutRecord
from timwatch.sidecar.proxy.relay import Capturer, relay_stream
from timwatch.sidecar.proxy.sglang_wire import SampleState, plan_request


def _stream(req: dict[str, Any], incremental: bool) -> bytes:
    """The bytes the stand-in sends for ``req``, chunks of a batch interleaved as it does."""
    samples, items, batch = fake._build(fake.Fake(incremental), req)
    offsets, live, out = [0] * len(samples), list(range(len(samples))), []
    while live:
        for i in list(live):
            s = samples[i]
            s.step()
            obj = s.answer(req, items[i], offsets[i] if incremental else 0)
            offsets[i] = len(s.ids)
            if batch:
                obj["index"] = i
            out.append(b"data: " + fake._dumps(obj) + b"\n\n")
            if s.finish is not None:
                live.remove(i)
    return b"".join(out) + b"data: [DONE]\n\n"


def _object_records(raw: bytes) -> list[RolloutRecord]:
    states: dict[int, SampleState] = {}
    done = []
    for frame in raw.split(b"\n\n"):
        if not frame.startswith(b"data: {"):
            continue
        out = orjson.loads(frame[6:])
        state = states.setdefault(out.get("index", 0), SampleState())
        state.offer(out)
        if out["meta_info"]["finish_reason"] is not None:
            done.append(state.record(out["meta_info"], fallback_prompt=None, vocab_size=None))
    return done


def _cuts(raw: bytes, how: str) -> list[bytes]:
    if how == "whole":
        return [raw]
    if how == "frames":
        return [f + b"\n\n" for f in raw.split(b"\n\n")[:-1]]
    rng = random.Random(len(raw))
    sizes = {"tiny": (1, 9), "mid": (50, 700), "big": (2000, 9000)}[how]
    out, at = [], 0
    while at < len(raw):
        step = rng.randint(*sizes)
        out.append(raw[at : at + step])
        at += step
    return out


async def _relay(cap: Capturer, plan: Any, reads: list[bytes]) -> bytes:
    async def chunks() -> AsyncIterator[bytes]:
        for r in reads:
            yield r

    return b"".join([c async for c in relay_stream(cap, plan, chunks())])


@pytest.mark.parametrize("how", ["whole", "frames", "tiny", "mid", "big"])
@pytest.mark.parametrize("batch", [False, True], ids=["one", "batch"])
@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
@pytest.mark.parametrize("small", [4096, 200], ids=["default", "low-threshold"])
def test_relayed_stream_keeps_bytes_and_records(
    monkeypatch: pytest.MonkeyPatch, how: str, batch: bool, incremental: bool, small: int
) -> None:
    monkeypatch.setattr(relay, "_SMALL_FRAME", small)
    ids: Any = [[1, 2, 3], [4, 5]] if batch else [1, 2, 3]
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "stream": True,
        "sampling_params": {"max_new_tokens": 40},
    }
    plan = plan_request(body, None)
    assert plan is not None and not plan.changed
    raw = _stream(plan.body, incremental)
    got: list[HeldRecord] = []
    counters = {"requests": 0, "wire_errors": 0, "upstream_errors": 0}
    cap = Capturer(got.append, counters, None)
    assert asyncio.run(_relay(cap, plan, _cuts(raw, how))) == raw
    assert counters["wire_errors"] == 0
    want = {r.rid: r for r in _object_records(raw)}
    assert len(want) == (2 if batch else 1)
    have = {r.rid: r for r in (h.unpack() for h in got)}
    assert have.keys() == want.keys()
    for rid, w in want.items():
        h = have[rid]
        assert (h.output_ids, h.logp, h.finish_reason, h.versions) == (
            w.output_ids,
            w.logp,
            w.finish_reason,
            w.versions,
        )
