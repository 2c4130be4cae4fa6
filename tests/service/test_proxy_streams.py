"""Streams the SGLang proxy relays as they arrive (`proxy.http.relay`), unchanged ones with the
upstream's own chunk framing (`relay.RawStream`).

A real proxy process (uvicorn) in front of a byte-exact upstream run in this process: it
replays a stream the SGLang stand-in (`tests/helpers/fake_sglang.py`; real SGLang needs a GPU)
sent, re-chunked at sizes that split frames anywhere and written in pieces with pauses, so the
proxy's reads end anywhere (inside a chunk-size line, a CRLF, a frame). The client reads raw
bytes from one keep-alive socket and compares their body with what the upstream sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from tests.helpers.loopserver import LoopServer, running
from tests.helpers.procs import fake_sglang_process, sglang_proxy_process
from timwatch.sidecar.proxy.http import client as upstream_client
from timwatch.sidecar.proxy.http import dechunk
from timwatch.sidecar.proxy.http.client import Upstream
from timwatch.sidecar.proxy.sglang.wire import SampleState

BODY: dict[str, Any] = {
    "input_ids": [5, 6, 7, 8],
    "return_logprob": True,
    "sampling_params": {"max_new_tokens": 40},
    "stream": True,
}


class RawUpstream(LoopServer):
    """An HTTP/1.1 upstream that answers every request with ``self.wire`` (the chunked body,
    written in ``self.writes`` pieces, ``self.pause`` s apart) and records, per request, the
    connection it came on; ``self.aborted`` counts answers whose connection went away,
    ``self.answered`` answers whose last byte went to the socket."""

    def __init__(self) -> None:
        super().__init__()
        self.wire = b"0\r\n\r\n"
        self.writes: list[int] = []
        self.pause = 0.0
        self.conns: list[int] = []
        self.aborted = 0
        self.answered = 0
        self._next = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn, self._next = self._next, self._next + 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                self.conns.append(conn)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                at, wire, pause = 0, self.wire, self.pause  # the test may set the next ones
                for size in [*self.writes, len(wire)]:
                    if at >= len(wire):
                        break
                    writer.write(wire[at : at + size])
                    at += size
                    await writer.drain()
                    if pause:
                        await asyncio.sleep(pause)
                self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            if self.conns and self.conns[-1] == conn:
                self.aborted += 1  # gone while answering (not an idle connection closed)
        finally:
            writer.close()


def raw_upstream() -> contextlib.AbstractContextManager[RawUpstream]:
    return running(RawUpstream())


def _chunked(body: bytes, rng: random.Random, hi: int) -> bytes:
    out, at = [], 0
    while at < len(body):
        step = rng.randint(1, hi)
        part = body[at : at + step]
        ext = b";x=1" if rng.random() < 0.1 else b""
        out.append(b"%x%s\r\n%s\r\n" % (len(part), ext, part))
        at += step
    return b"".join(out) + b"0\r\n\r\n"


def _request() -> bytes:
    payload = orjson.dumps(BODY)
    return (
        b"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(payload) + payload
    )


def _read_head(sock: socket.socket, size: int) -> tuple[bytes, bytes]:
    """(head, the body bytes read with it) of the next answer on a keep-alive socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(size)
        if not more:
            raise ConnectionError(f"closed in the head: {data!r}")
        data += more
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _read_answer(sock: socket.socket, size: int = 65536) -> tuple[bytes, bytes]:
    """(head, raw chunked body up to and including the last chunk) from a keep-alive socket,
    read ``size`` bytes at a time."""
    head, rest = _read_head(sock, size)
    parts, tail, total = [rest], rest[-16:], len(rest)
    while not (tail.endswith(b"\r\n0\r\n\r\n") or (total == 5 and tail == b"0\r\n\r\n")):
        more = sock.recv(size)
        if not more:
            raise ConnectionError("closed in the body")
        parts.append(more)
        total, tail = total + len(more), (tail + more)[-16:]
    return head, b"".join(parts)


def _read_answer_length(sock: socket.socket, size: int) -> tuple[bytes, int]:
    """(head, de-chunked body length) of one chunked answer from a keep-alive socket, counted
    as it arrives: no copy of the body is kept, so the next request follows at once (the
    proxy's server closes a connection idle for 5 s, as uvicorn does by default)."""
    head, buf = _read_head(sock, size)
    length, skip = 0, 0  # skip: bytes of the current chunk's data and its CRLF still unread
    while True:
        if skip and len(buf) < skip:
            skip -= len(buf)
            buf = b""
        elif skip:
            buf, skip = buf[skip:], 0
            continue
        elif b"\r\n" in buf:
            line, _, buf = buf.partition(b"\r\n")
            chunk = int(line.split(b";")[0], 16)
            if chunk == 0:
                while not buf.startswith(b"\r\n"):  # no trailers from the proxy
                    more = sock.recv(size)
                    if not more:
                        raise ConnectionError("closed in the last chunk")
                    buf += more
                assert buf == b"\r\n"
                return head, length
            length, skip = length + chunk, chunk + 2
            continue
        more = sock.recv(size)
        if not more:
            raise ConnectionError("closed in the body")
        buf += more


def _dechunk(wire: bytes) -> bytes:
    out, at = [], 0
    while True:
        eol = wire.index(b"\r\n", at)
        size = int(wire[at:eol].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(wire[eol + 2 : eol + 2 + size])
        at = eol + 4 + size


def _object_record(sse: bytes) -> tuple[list[int], list[float]]:
    state = SampleState()
    for frame in sse.split(b"\n\n"):
        if frame.startswith(b"data: {"):
            state.offer(orjson.loads(frame[6:]))
    if state.pending is not None:
        state.add(state.pending())
    return np.concatenate(state.ids).tolist(), np.concatenate(state.logps).tolist()


def _counters(proxy: str) -> dict[str, Any]:
    return httpx.get(f"{proxy}/timwatch/counters", timeout=10).json()


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_client_gets_the_upstream_bytes_cut_anywhere_on_one_keep_alive_connection(
    incremental: bool,
) -> None:
    with fake_sglang_process(incremental) as sglang:
        sse = httpx.post(f"{sglang}/generate", json=BODY, timeout=60).content
    want = _object_record(sse)
    raw_path = dechunk.available()  # the proxy runs in this environment
    with raw_upstream() as up, sglang_proxy_process(up.url) as proxy:
        port = int(proxy.rsplit(":", 1)[1])
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        answers = 0
        for seed, (chunk_hi, write_hi) in enumerate([(7, 13), (300, 50), (4000, 997), (9, 1)]):
            rng = random.Random(seed)
            up.wire = _chunked(sse, rng, chunk_hi)
            sizes, total = [], 0
            while total < len(up.wire) and len(sizes) < 60:
                sizes.append(rng.randint(1, write_hi))
                total += sizes[-1]
            up.writes, up.pause = sizes, 0.002
            sock.sendall(_request())
            head, raw = _read_answer(sock)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert b"transfer-encoding: chunked" in head.lower()
            if raw_path:
                assert raw == up.wire, seed  # the upstream's framing, byte for byte
            assert _dechunk(raw) == sse
            answers += 1
        # the same connection still serves a plain request after the streams
        sock.sendall(b"GET /timwatch/healthz HTTP/1.1\r\nhost: t\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.close()
        counters = _counters(proxy)
        held = httpx.get(f"{proxy}/timwatch/records", timeout=30).json()["records"]
    # with the upstream's own framing where the C pass de-chunks, else through public ASGI
    assert counters["proxy"]["raw_streams"] == (answers if raw_path else 0)
    assert counters["proxy"]["wire_errors"] == 0
    assert counters["capture"]["captured"] == answers
    # every answer was captured; the replays share one rid, so the store holds one record
    assert held and all((r["output_ids"], r["logp"]) == want for r in held)


def test_a_client_leaving_mid_stream_closes_the_upstream_connection() -> None:
    with fake_sglang_process(True) as sglang:
        sse = httpx.post(f"{sglang}/generate", json=BODY, timeout=60).content
    with raw_upstream() as up, sglang_proxy_process(up.url) as proxy:
        port = int(proxy.rsplit(":", 1)[1])
        up.wire = _chunked(sse * 40, random.Random(1), 200)
        up.writes, up.pause = [512] * 400, 0.01  # about 4 s of stream
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(_request())
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.close()
        deadline = time.monotonic() + 10
        while up.aborted == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert up.aborted == 1  # the proxy closed its upstream connection
        # and goes on serving, on a fresh upstream connection
        up.wire, up.writes, up.pause = _chunked(sse, random.Random(2), 50), [], 0.0
        with httpx.Client(timeout=30) as client:
            assert client.post(f"{proxy}/generate", json=BODY).content == sse
        assert up.conns[-1] != up.conns[0]


def test_a_client_that_stops_reading_pauses_the_upstream_and_then_gets_every_byte() -> None:
    """Flow control: while the client reads nothing, the proxy stops reading the upstream (its
    write to the upstream socket blocks) instead of holding the stream in memory."""
    with fake_sglang_process(True) as sglang:
        sse = httpx.post(f"{sglang}/generate", json=BODY, timeout=60).content
    # far more than the socket buffers on the way can hold (loopback: a few MB each)
    big = sse * (48_000_000 // len(sse))
    with raw_upstream() as up, sglang_proxy_process(up.url) as proxy:
        port = int(proxy.rsplit(":", 1)[1])
        up.wire, up.writes, up.pause = _chunked(big, random.Random(4), 4000), [], 0.0
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        sock.sendall(_request())
        first = sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200")
        time.sleep(2)  # reading nothing: the proxy would have relayed 48 MB in well under 2 s
        assert up.answered == 0  # the upstream is still blocked writing
        head, _, rest = first.partition(b"\r\n\r\n")
        while not rest.endswith(b"\r\n0\r\n\r\n"):
            more = sock.recv(1 << 20)
            assert more, "closed in the body"
            rest += more
        sock.close()
        assert _dechunk(rest) == big
        assert up.answered == 1


def test_an_upstream_connection_its_reader_paused_goes_back_to_the_pool_reading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`release` returns a connection whose reading was paused (more than `HIGH_WATER` bytes
    waited for the reader) to the pool reading, where a pause left on it would make the next
    request sent on it wait forever."""
    monkeypatch.setattr(upstream_client, "HIGH_WATER", 1000)
    frames = b"data: {}\n\n" * 2000
    with raw_upstream() as up:
        up.wire = _chunked(frames, random.Random(8), 700)
        up.writes, up.pause = [4000] * 6, 0.02

        async def read_twice() -> list[bytes]:
            client = Upstream(up.url, timeout_s=10)
            bodies = []
            for _ in range(2):
                resp = await client.request("POST", "/generate", [], b"{}")
                pieces = []
                while (piece := await resp.next()) is not None:
                    pieces.append(piece)  # each read is over HIGH_WATER: reading paused
                resp.release()
                bodies.append(b"".join(pieces))
            await client.aclose()
            return bodies

        assert asyncio.run(asyncio.wait_for(read_twice(), 60)) == [frames, frames]
        assert len(set(up.conns)) == 1  # the second request went out on the same connection


@pytest.mark.slow  # a load test: the full suite runs it, the quick tier does not
def test_cumulative_streams_at_engine_speed_are_relayed_whole_one_after_another() -> None:
    """Eight 4,096-token cumulative streams (339 MB each) from the fast stand-in, read at full
    speed: the client's socket fills and drains thousands of times, and a drain can land
    between the relay pausing the upstream and its loop looking (that pause was once never
    undone and the stream hung after a few hundred MB)."""
    body = {**BODY, "sampling_params": {"max_new_tokens": 4096}}
    with fake_sglang_process(False, fast=True) as up, sglang_proxy_process(up) as proxy:
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{up}/generate", json=body) as direct,
        ):
            size = sum(len(part) for part in direct.iter_raw())
        port = int(proxy.rsplit(":", 1)[1])
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        payload = orjson.dumps(body)
        request = (
            b"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(payload) + payload
        )
        for _ in range(8):
            sock.sendall(request)
            head, length = _read_answer_length(sock, 1 << 20)
            assert head.startswith(b"HTTP/1.1 200")
            assert length == size
        sock.close()
        counters = _counters(proxy)
    assert counters["capture"]["captured"] == 8


def test_broken_upstream_framing_closes_the_client_connection_and_is_not_reused() -> None:
    good = b"data: {}\n\n"
    with raw_upstream() as up, sglang_proxy_process(up.url) as proxy:
        port = int(proxy.rsplit(":", 1)[1])
        up.wire = b"%x\r\n%s\r\nzz\r\nbroken\r\n0\r\n\r\n" % (len(good), good)
        up.writes, up.pause = [len(good) + 5, 5], 0.05
        sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        sock.sendall(_request())
        got = b""
        while more := sock.recv(65536):  # closed by the proxy, never hung
            got += more
        sock.close()
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert body == b"%x\r\n%s\r\n" % (len(good), good)  # no last chunk: an error to the client
        up.wire = b"%x\r\n%s\r\n0\r\n\r\n" % (len(good), good)
        up.writes, up.pause = [], 0.0
        with httpx.Client(timeout=30) as client:
            assert client.post(f"{proxy}/generate", json=BODY).content == good
        assert up.conns == [0, 1]  # the broken connection was not used again


def test_an_engine_decoding_one_frame_per_write_for_longer_than_the_timeout() -> None:
    """How an engine decoding writes: one frame per chunk and per write, 100 ms apart, the
    stream lasting over 1 s against the proxy's 0.5 s upstream timeout. The proxy reads each frame
    as it comes, and the timeout counts from the last read: the
    stream is relayed byte for byte and captured. A gap of 1.5 s between two writes is still a
    timeout: the client's connection closes before the last chunk."""
    with fake_sglang_process(True) as sglang:
        sse = httpx.post(f"{sglang}/generate", json=BODY, timeout=60).content
    want = _object_record(sse)
    frames = [f + b"\n\n" for f in sse.split(b"\n\n") if f]
    assert b"".join(frames) == sse and len(frames) > 10
    chunks = [b"%x\r\n%s\r\n" % (len(f), f) for f in frames]
    with raw_upstream() as up, sglang_proxy_process(up.url, "--timeout", "0.5") as proxy:
        port = int(proxy.rsplit(":", 1)[1])
        up.wire = b"".join(chunks) + b"0\r\n\r\n"
        up.writes, up.pause = [len(c) for c in chunks], 0.1
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        started = time.monotonic()
        sock.sendall(_request())
        head, raw = _read_answer(sock)
        took = time.monotonic() - started
        sock.close()
        assert head.startswith(b"HTTP/1.1 200"), head
        assert _dechunk(raw) == sse
        assert took > 1.0  # longer than the timeout
        held = httpx.get(f"{proxy}/timwatch/records", timeout=30).json()["records"]
        assert [(r["output_ids"], r["logp"]) for r in held] == [want]
        counters = _counters(proxy)
        assert counters["proxy"]["upstream_errors"] == 0
        up.writes, up.pause = [sum(len(c) for c in chunks[:5])], 1.5
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(_request())
        with pytest.raises(ConnectionError):
            _read_answer(sock)
        sock.close()
        assert _counters(proxy)["capture"]["captured"] == 1  # the broken one is not
