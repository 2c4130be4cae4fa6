"""The SGLang proxy at engine speed: exact bytes through it, and memory under its byte bound.

Real uvicorn processes on loopback. SGLang needs a GPU, so two stand-ins answer in SGLang
0.5.x's format: `tests/helpers/fake_sglang.py` (exact model, the stand-in's own JSON writer)
and `benchmarks/sglang_standin.py` (SGLang's compact orjson bytes, long answers, fast enough
that one read holds many stream chunks and chunks split across reads). Real vLLM/SGLang streams
are not available on this machine; the comparisons are against these stand-ins.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from tests.helpers.procs import fake_sglang_process, sglang_proxy_process
from timwatch.sidecar.proxy.sglang.wire import SampleState

TOPK = 3


def _raw(url: str, body: dict[str, Any]) -> bytes:
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        return resp.read()


def _counters(proxy: str) -> dict[str, Any]:
    return httpx.get(f"{proxy}/timwatch/counters", timeout=10).json()


BODIES: dict[str, dict[str, Any]] = {
    # the proxy changes nothing: the client already asks for all it needs
    "unchanged": {"input_ids": [5, 6, 7, 8], "return_logprob": True, "top_logprobs_num": TOPK},
    # the proxy adds log-probs, top-k and prompt ids, and cuts them out again
    "plain": {"text": "a plain client"},
    # the proxy raises top-k from 1 to 3 and trims the rows back
    "top1": {"input_ids": [9, 3], "return_logprob": True, "top_logprobs_num": 1},
}


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
@pytest.mark.parametrize("fast", [False, True], ids=["fake_sglang", "standin"])
def test_streams_and_answers_through_the_proxy_equal_the_upstream_bytes(
    fast: bool, incremental: bool
) -> None:
    tokens = 700 if fast else 24
    with (
        fake_sglang_process(incremental, fast=fast) as up,
        sglang_proxy_process(up, "--topk", str(TOPK)) as proxy,
    ):
        captured = 0
        expected: list[tuple[list[int], list[float]]] = []
        for name, extra in sorted(BODIES.items()):
            if fast and name == "top1":
                continue  # the fast stand-in's rows are not real top-k: trimming differs
            for streamed in (False, True):
                body = {"sampling_params": {"max_new_tokens": tokens}, **extra}
                body.update(stream=streamed, rid=uuid.uuid4().hex)
                direct = _raw(up, body)
                through = _raw(proxy, body)
                if fast:  # its ids are per answer, not taken from the request
                    direct, through = _same_rid(direct), _same_rid(through)
                assert through == direct, (name, streamed)
                captured += 1
                expected.append(_sample(up, body, direct))
        counters = _counters(proxy)
        assert counters["capture"]["captured"] == captured
        assert counters["proxy"]["wire_errors"] == 0
        held = httpx.get(f"{proxy}/timwatch/records", timeout=30).json()["records"]
        got = [(r["output_ids"], r["logp"]) for r in held]
        assert got == expected


def _sample(up: str, body: dict[str, Any], direct: bytes) -> tuple[list[int], list[float]]:
    """Token ids and log-probs of one answer, read by the object path from the upstream's
    answer to the request with log-probs on."""
    raw = direct
    if not body.get("return_logprob"):
        raw = _raw(up, dict(body, return_logprob=True))
    state = SampleState()
    if not body["stream"]:
        state.feed(orjson.loads(raw), stream=False)
    for frame in raw.split(b"\n\n") if body["stream"] else []:
        if frame.startswith(b"data: {"):
            state.offer(orjson.loads(frame[6:]))
    if state.pending is not None:
        state.add(state.pending())
    return np.concatenate(state.ids).tolist(), np.concatenate(state.logps).tolist()


def _same_rid(raw: bytes) -> bytes:
    key = b'"id":"'
    out, at = [], 0
    while (k := raw.find(key, at)) >= 0:
        end = raw.index(b'"', k + len(key))
        out += [raw[at : k + len(key)], b"RID"]
        at = end
    return b"".join(out) + raw[at:]


def test_held_records_stay_under_the_byte_bound_and_drops_are_counted() -> None:
    bound = 400_000
    tokens = 1024
    with (
        fake_sglang_process(False, fast=True) as up,
        sglang_proxy_process(up, "--max-held-bytes", str(bound)) as proxy,
    ):
        body = {
            "input_ids": list(range(64)),
            "sampling_params": {"max_new_tokens": tokens},
            "return_logprob": True,
        }
        with httpx.Client(timeout=30) as client:
            for _ in range(60):  # ~60 x 14 KB: well past the bound, and no trainer collects
                assert client.post(f"{proxy}/generate", json=body).status_code == 200
        c = _counters(proxy)
    cap = c["capture"]
    assert cap["captured"] == 60
    assert cap["held_bytes"] <= bound
    assert cap["evicted"] > 0 and cap["evicted_bytes"] > 0
    assert c["held_records"] == cap["captured"] - cap["evicted"]
    per_record = (cap["held_bytes"] + cap["evicted_bytes"]) / cap["captured"]
    assert per_record / tokens <= 40
