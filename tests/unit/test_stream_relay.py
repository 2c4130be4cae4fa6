"""Streams through the SGLang proxy's relays (`tests.helpers.sglang_relay`): the client gets the
upstream's bytes, and the records equal the object path's, however the stream is cut into reads.

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
from tests.helpers.sglang_relay import relayed
from timwatch.sidecar.proxy.records import RolloutRecord
from timwatch.sidecar.proxy.sglang import stream as relay
from timwatch.sidecar.proxy.sglang.answers import Capturer
from timwatch.sidecar.proxy.sglang.wire import SampleState, plan_request


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

    return await relayed(cap, plan, chunks())


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
    got: list[RolloutRecord] = []
    counters = {"requests": 0, "wire_errors": 0, "upstream_errors": 0}
    cap = Capturer(got.append, counters, None)
    assert asyncio.run(_relay(cap, plan, _cuts(raw, how))) == raw
    assert counters["wire_errors"] == 0
    want = {r.rid: r for r in _object_records(raw)}
    assert len(want) == (2 if batch else 1)
    have = {r.rid: r for r in got}
    assert have.keys() == want.keys()
    for rid, w in want.items():
        h = have[rid]
        assert (h.output_ids.tolist(), h.logp.tolist(), h.finish_reason, h.versions) == (
            w.output_ids.tolist(),
            w.logp.tolist(),
            w.finish_reason,
            w.versions,
        )


def _chunked(raw: bytes) -> tuple[bytes, list[int]]:
    """``raw`` as SGLang sends it: one HTTP chunk per frame; and where each chunk starts."""
    out, starts, at = [], [], 0
    for frame in (f + b"\n\n" for f in raw.split(b"\n\n")[:-1]):
        starts.append(at)
        piece = b"%x\r\n" % len(frame) + frame + b"\r\n"
        out.append(piece)
        at += len(piece)
    return b"".join(out) + b"0\r\n\r\n", starts


async def _through_upstream(wire: bytes, cuts: list[int], plan: Any, cap: Capturer) -> list[bytes]:
    """Relay ``wire`` (a chunked body) through `Upstream` and `relay_stream` once per cut: a
    loopback server writes it in two writes split there, a pause between. Returns the relayed
    bodies; all requests must share one keep-alive connection."""
    from timwatch.sidecar.proxy.http.client import Upstream

    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        for cut in cuts:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n" + wire[:cut]
            )
            await writer.drain()
            await asyncio.sleep(0.002)
            writer.write(wire[cut:])
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    up = Upstream(f"http://127.0.0.1:{port}", timeout_s=10)
    bodies = []
    try:
        for _ in cuts:
            resp = await up.request("POST", "/generate", [], b"{}")
            try:
                bodies.append(await relayed(cap, plan, resp.chunks()))
            finally:
                resp.release()
        assert connections == 1  # every answer ended cleanly: the connection was kept
    finally:
        await up.aclose()
        server.close()
        await server.wait_closed()
    return bodies


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_chunked_upstream_relays_bytes_and_records_at_every_cut(incremental: bool) -> None:
    """The upstream client's own de-chunking (`proxy.http.dechunk`) under the relay: reads split at
    every byte position of a chunk-size line, of its CRLF and of the data's CRLF."""
    body = {
        "input_ids": [1, 2, 3],
        "return_logprob": True,
        "stream": True,
        "sampling_params": {"max_new_tokens": 12},
    }
    plan = plan_request(body, None)
    assert plan is not None and not plan.changed
    raw = _stream(plan.body, incremental)
    wire, starts = _chunked(raw)
    chunk = starts[3]  # a chunk mid-stream
    size_line = wire.index(b"\r\n", chunk) + 2
    data_end = starts[4] - 2
    cuts = sorted(
        {*range(chunk, size_line + 2), *range(data_end - 1, data_end + 4), 0, len(wire) - 3}
    )
    got: list[RolloutRecord] = []
    counters = {"requests": 0, "wire_errors": 0, "upstream_errors": 0}
    cap = Capturer(got.append, counters, None)
    bodies = asyncio.run(_through_upstream(wire, cuts, plan, cap))
    assert bodies == [raw] * len(cuts)
    assert counters["wire_errors"] == 0
    (want,) = _object_records(raw)
    assert len(got) == len(cuts)
    for h in got:
        assert (h.output_ids.tolist(), h.logp.tolist(), h.finish_reason) == (
            want.output_ids.tolist(),
            want.logp.tolist(),
            want.finish_reason,
        )


def test_broken_chunked_framing_is_an_upstream_error_and_drops_the_connection() -> None:
    from timwatch.monitor.core.errors import UpstreamError
    from timwatch.sidecar.proxy.http.client import Upstream

    async def run() -> int:
        connections = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            writer.write(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                b"5\r\nhello\r\nzz\r\n"  # a chunk size that is not hex
            )
            await writer.drain()
            await reader.read()  # until the proxy's client closes

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        up = Upstream(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", timeout_s=10)
        try:
            for _ in range(2):
                resp = await up.request("POST", "/generate", [], b"{}")
                got = []
                with pytest.raises(UpstreamError, match="chunk"):  # C pass or llhttp
                    async for c in resp.chunks():
                        got.append(c)
                resp.release()
                assert b"".join(got) in (b"", b"hello")
        finally:
            await up.aclose()
            server.close()
            await server.wait_closed()
        return connections

    assert asyncio.run(run()) == 2  # the broken connection was not reused


@pytest.mark.parametrize("native", [True, False], ids=["c", "fallback"])
def test_a_malformed_chunk_of_a_changed_request_is_counted_and_still_restored(
    native: bool,
) -> None:
    """The last chunk lacks its log-prob list (a wire error): the sample is dropped and counted,
    and the client still gets the chunk without the members the proxy added."""
    from timwatch.sidecar.proxy import native as native_mod

    plan = plan_request({"input_ids": [1, 2], "stream": True}, None)
    assert plan is not None and plan.changed
    meta = {"id": "r", "finish_reason": {"type": "length"}, "output_token_logprobs_length": 2}
    raw = b"data: " + orjson.dumps({"text": "ab", "output_ids": [3, 4], "meta_info": meta})
    counters = {"requests": 0, "wire_errors": 0, "upstream_errors": 0}
    got: list[RolloutRecord] = []
    before = native_mod.use_native(native)
    try:
        out = asyncio.run(_relay(Capturer(got.append, counters, None), plan, [raw + b"\n\n"]))
    finally:
        native_mod.use_native(before)
    assert got == [] and counters["wire_errors"] == 1
    sent = orjson.loads(out[6:])
    assert "output_token_logprobs_length" not in sent["meta_info"]
    assert sent["meta_info"]["id"] == "r" and sent["output_ids"] == [3, 4]
